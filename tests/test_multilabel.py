"""task=multilabel: the sigmoid loss, class weights, mAP/F1/thresholds, and a short run whose eval,
predict, report, export and fine-tuning work; multiclass balanced accuracy."""

import csv
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from PIL import Image
from sklearn.metrics import average_precision_score, f1_score

from configs import cifar10
from conftest import restore_checkpoint
from flaxtpu.augmentation import augment
from flaxtpu.exporters import export
from flaxtpu.io import metrics
from flaxtpu.loop import train
from flaxtpu.modes import eval as eval_mode
from flaxtpu.modes import predict, restore
from flaxtpu.report import metrics as report_metrics
from flaxtpu.settings.errors import UserError
from flaxtpu.step import parallel, placing, steps
from flaxtpu.transfer import finetune
from flaxtpu.weights import checkpoint

CLASSES = ('red', 'green', 'blue', 'yellow')
COLOURS = np.array([(230, 40, 40), (40, 220, 40), (50, 60, 240), (230, 220, 40)], np.uint8)


def make_scenes(count: int, seed: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """uint8 images [count, size, size, 3] holding 0-3 squares of the 4 colours (one per quadrant,
  no colour twice) on dark noise, and their multi-hot tags uint8 [count, 4]."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 50, (count, size, size, 3)).astype(np.uint8)
  tags = np.zeros((count, len(CLASSES)), np.uint8)
  half = size // 2
  for i in range(count):
    present = rng.choice(len(CLASSES), rng.integers(0, 4), replace=False)
    quadrants = rng.choice(4, len(present), replace=False)
    for colour, quadrant in zip(present, quadrants):
      top, left = (quadrant // 2) * half + 1, (quadrant % 2) * half + 1
      images[i, top:top + half - 2, left:left + half - 2] = COLOURS[colour]
      tags[i, colour] = 1
  return images, tags


def _logit(p):
  p = np.asarray(p, np.float64)
  return np.log(p) - np.log1p(-p)


# --- the loss ------------------------------------------------------------------------------------


def _numpy_bce(logits, targets):
  p = 1 / (1 + np.exp(-logits))
  return -(targets * np.log(p) + (1 - targets) * np.log(1 - p))


def test_sigmoid_loss_with_label_smoothing_and_class_weights_by_hand():
  logits = np.array([[2.0, -1.0, 0.5, -3.0], [-0.5, 1.5, -2.0, 0.0], [0.3, 0.2, -0.1, 4.0]], np.float32)
  tags = np.array([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 1]], np.uint8)  # a row without any tag too
  weights = np.array([1.0, 2.0, 0.5, 3.0], np.float32)
  smoothing = 0.2
  # timm's BinaryCrossEntropy: absent tags s / C, present ones 1 - s + s / C.
  off, on = smoothing / 4, 1 - smoothing + smoothing / 4
  expected_targets = np.where(tags == 1, on, off)
  task = steps.Task(model=None, num_classes=4, image_shape=(8, 8, 3), augment=None, label_smoothing=smoothing,
                    mean=None, std=None, multilabel=True, class_weights=weights)
  hard = steps.label_targets(jnp.asarray(tags), task)
  targets = optax.smooth_labels(hard, smoothing)
  np.testing.assert_allclose(targets, expected_targets, rtol=1e-6)
  losses = steps.loss_per_example(jnp.asarray(logits), targets, hard, multilabel=True, class_weights=weights)
  by_hand = (_numpy_bce(logits.astype(np.float64), expected_targets) * weights).sum(axis=1)
  np.testing.assert_allclose(losses, by_hand, rtol=1e-5)
  # Summed over the classes, averaged over the batch (big_vision's sigmoid_xent): unweighted, smoothed 0.
  plain = steps.loss_per_example(jnp.asarray(logits), hard, hard, multilabel=True).mean()
  assert float(plain) == pytest.approx(_numpy_bce(logits.astype(np.float64), tags).sum(1).mean(), rel=1e-5)


def test_weighted_softmax_loss_by_hand_also_mixed():
  logits = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 1.0], [-1.0, 3.0, 0.0]], np.float32)
  labels = np.array([0, 2, 1])
  weights = np.array([1.0, 4.0, 0.5], np.float32)
  log_softmax = logits - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
  one_hot = np.eye(3)[labels]
  losses = steps.loss_per_example(jnp.asarray(logits), jnp.asarray(one_hot), jnp.asarray(one_hot),
                                  multilabel=False, class_weights=weights)
  # Keras' class_weight: each example's loss times the weight of its class.
  np.testing.assert_allclose(losses, -log_softmax[np.arange(3), labels] * weights[labels], rtol=1e-5)
  # A mixed example (70% class 0, 30% class 1) weighs 0.7 w0 + 0.3 w1, its smoothed targets aside.
  hard = np.array([[0.7, 0.3, 0.0]])
  smoothed = optax.smooth_labels(jnp.asarray(hard), 0.1)
  loss = steps.loss_per_example(jnp.asarray(logits[:1]), smoothed, jnp.asarray(hard), multilabel=False,
                                class_weights=weights)
  expected = -(np.asarray(smoothed)[0] * log_softmax[0]).sum() * (0.7 * 1.0 + 0.3 * 4.0)
  assert float(loss[0]) == pytest.approx(expected, rel=1e-5)


def _random_state(placement: placing.Placement, seed: int = 0):
  """A train state of random parameters (and zero optimizer state) laid out as `placement` lays it
  out, without compiling the model's initialiser."""
  rng = np.random.default_rng(seed)
  put = lambda leaf, value: jax.device_put(value.astype(leaf.dtype), leaf.sharding)
  abstract = placement.abstract_state
  zeros = jax.tree.map(lambda leaf: put(leaf, np.zeros(leaf.shape)), abstract)
  return placement.from_saveable(zeros.replace(
      params=jax.tree.map(lambda leaf: put(leaf, rng.normal(0, 0.2, leaf.shape)), abstract.params)))


def test_class_weights_scale_the_train_loss_as_expected():
  """The loss train steps of the Keras CNN report, from one state, against numpy on its logits."""
  images, tags = make_scenes(8, seed=1, size=8)
  labels = np.array([0, 1, 2, 0, 1, 2, 2, 3], np.int32)
  config = cifar10.get_config()
  config.batch_size, config.num_train_steps = 8, 1
  mesh = jax.make_mesh((1, 1), ('data', 'fsdp'), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:1])

  def placed(task_name: str, class_weights=None) -> tuple[steps.Task, placing.Placement]:
    config.task = task_name
    task = steps.create_task(config, num_classes=4, image_shape=images.shape[1:], mean=np.zeros(3),
                             std=np.ones(3), length=train.run_length(config, 8), class_weights=class_weights)
    return task, placing.place(task, mesh, config)

  task, placement = placed('multilabel', np.ones(4, np.float32))
  state = _random_state(placement)  # the same arrays for each task
  logits = np.asarray(placement.logits(state, placement.put_eval_batch((images,))[0]), np.float64)

  def loss(placed_task: tuple[steps.Task, placing.Placement], batch_labels) -> float:
    placement = placed_task[1]
    copy = jax.tree.map(jnp.copy, state)  # the step donates the state it is given
    _, step_metrics = placement.train_step(copy, placement.put_train_batch((images, batch_labels)))
    return float(step_metrics.compute()['loss'])

  weights = np.array([2.0, 0.5, 1.0, 3.0], np.float32)  # each class's term times its weight
  assert loss(placed('multilabel', weights), tags) == pytest.approx(
      (_numpy_bce(logits, tags) * weights).sum(1).mean(), rel=1e-4)
  log_softmax = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  per_example = -log_softmax[np.arange(8), labels]
  weighted = loss(placed('multiclass', weights), labels)  # each example's loss times its class's weight
  assert weighted == pytest.approx(np.mean(weights[labels] * per_example), rel=1e-4)
  assert weighted != pytest.approx(per_example.mean(), rel=1e-2)


def test_mixup_and_cutmix_mix_multi_hot_targets_with_the_images():
  count = 16
  own = np.arange(1.0, count + 1)  # each image one value: how much of it is left tells its weight
  images = jnp.asarray(np.broadcast_to(own[:, None, None, None], (count, 6, 6, 3)))
  tags = np.random.default_rng(0).integers(0, 2, (count, 5)).astype(np.float32)
  config = ml_collections.ConfigDict({'mixup_alpha': 0.4, 'cutmix_alpha': 1.0, 'mix_prob': 1.0,
                                      'mix_switch_prob': 0.5})
  mix = jax.jit(lambda key, images, targets: augment.mix_batch(key, images, targets, jnp.arange(count),
                                                               config))
  mixed, targets = (np.asarray(x) for x in mix(jax.random.PRNGKey(3), images, jnp.asarray(tags)))
  other = np.asarray(augment.partner(jnp.asarray(own)))
  cut = np.all((mixed == own[:, None, None, None]) | (mixed == other[:, None, None, None]), axis=(1, 2, 3))
  keep = np.where(cut, (mixed == own[:, None, None, None]).mean(axis=(1, 2, 3)),  # CutMix: the area kept
                  (mixed[:, 0, 0, 0] - other) / (own - other))  # mixup: keep x own + (1 - keep) x partner's
  assert cut.any() and not cut.all() and not np.allclose(keep, 1)
  partner_tags = np.asarray(augment.partner(jnp.asarray(tags)))
  np.testing.assert_allclose(targets, keep[:, None] * tags + (1 - keep[:, None]) * partner_tags, atol=1e-5)


# --- mAP, F1 and thresholds ----------------------------------------------------------------------


def test_average_precision_by_hand_and_against_sklearn_with_ties():
  probabilities = np.array([[0.9, 0.1, 0.2],
                            [0.8, 0.4, 0.6],
                            [0.8, 0.35, 0.6],
                            [0.3, 0.8, 0.1]])
  tags = np.array([[1, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]], np.uint8)  # class 2 never present
  result = report_metrics.multilabel_report(_logit(probabilities), tags, ['a', 'b', 'c'])
  # Class a: 0.9 (+) alone, then 0.8 (-) and 0.8 (+) tied: AP = 0.5 x 1 + 0.5 x 2/3.
  # Class b: 0.8 (-), 0.4 (-), 0.35 (+), 0.1 (+): AP = 0.5 x 1/3 + 0.5 x 2/4.
  np.testing.assert_allclose(result['average_precision'][:2], [5 / 6, 5 / 12])
  assert np.isnan(result['average_precision'][2])
  assert result['map'] == pytest.approx((5 / 6 + 5 / 12) / 2)  # classes with a positive only
  for c in range(2):
    expected = average_precision_score(tags[:, c], probabilities[:, c])
    assert result['average_precision'][c] == pytest.approx(expected)
  assert result['map_micro'] == pytest.approx(average_precision_score(tags, probabilities, average='micro'))
  assert list(result['support']) == [2, 2, 0]

  rng = np.random.default_rng(0)
  probabilities = np.clip(np.round(rng.random((60, 6)), 1), 0.05, 0.95)  # many ties
  tags = (rng.random((60, 6)) < 0.3).astype(np.uint8)
  result = report_metrics.multilabel_report(_logit(probabilities), tags, list('abcdef'))
  np.testing.assert_allclose(result['average_precision'],
                             [average_precision_score(tags[:, c], probabilities[:, c]) for c in range(6)])
  assert result['map'] == pytest.approx(average_precision_score(tags, probabilities, average='macro'))
  assert result['map_micro'] == pytest.approx(average_precision_score(tags, probabilities, average='micro'))


def _f1(tags, predicted) -> float:
  tp = np.sum(predicted & (tags == 1))
  return 2 * tp / (np.sum(predicted) + np.sum(tags == 1))


def test_thresholds_maximise_f1_by_brute_force():
  rng = np.random.default_rng(1)
  probabilities = np.clip(np.round(rng.random((80, 5)), 2), 0.01, 0.99)
  tags = (rng.random((80, 5)) < probabilities * 0.8).astype(np.uint8)  # informative, imperfect
  tags[:, 4] = 0  # a class without examples takes the global threshold
  result = report_metrics.multilabel_report(_logit(probabilities), tags, list('abcde'))
  candidates = np.unique(probabilities)
  best_micro = max(_f1(tags, probabilities >= t) for t in candidates)
  chosen = result['threshold']
  assert result['f1'] == pytest.approx(best_micro)
  assert f1_score(tags.ravel(), probabilities.ravel() >= chosen) == pytest.approx(best_micro)
  assert not np.isin(chosen, candidates)  # between two scores, not on one
  for c in range(4):
    best = max(_f1(tags[:, c], probabilities[:, c] >= t) for t in candidates)
    assert result['f1_per_class'][c] == pytest.approx(best)
    assert f1_score(tags[:, c], probabilities[:, c] >= result['class_thresholds'][c]) == pytest.approx(best)
  assert result['class_thresholds'][4] == chosen
  exact = np.all((probabilities >= chosen) == (tags == 1), axis=1).mean()
  scalars = report_metrics.multilabel_metrics(result)
  assert scalars == {'eval_map': result['map'], 'eval_map_micro': result['map_micro'],
                     'eval_f1': result['f1'],
                     'eval_threshold': chosen, 'eval_accuracy': pytest.approx(exact)}
  fixed = report_metrics.multilabel_report(_logit(probabilities), tags, list('abcde'), threshold=0.7)
  assert fixed['threshold'] == 0.7 and np.all(fixed['class_thresholds'] == 0.7)
  assert fixed['f1'] == pytest.approx(f1_score(tags.ravel(), probabilities.ravel() >= 0.7))
  tp = ((probabilities >= 0.7) & (tags == 1)).sum(0)
  np.testing.assert_array_equal(fixed['tp'], tp)


# --- multiclass balanced accuracy ----------------------------------------------------------------


def test_balanced_accuracy_by_hand():
  labels = np.array([0, 0, 0, 0, 1, 1, 2, 0])  # class 3 has no example; the last row is padding
  predictions = np.array([0, 0, 0, 1, 0, 1, 2, 2])
  mask = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
  one_hot = np.eye(4)[labels]
  first = metrics.BalancedAccuracy.from_model_output(
      label_one_hot=jnp.asarray(one_hot[:4]), accuracy=jnp.asarray(predictions[:4] == labels[:4]),
      mask=jnp.asarray(mask[:4]))
  second = metrics.BalancedAccuracy.from_model_output(
      label_one_hot=jnp.asarray(one_hot[4:]), accuracy=jnp.asarray(predictions[4:] == labels[4:]),
      mask=jnp.asarray(mask[4:]))
  by_hand = (3 / 4 + 1 / 2 + 1 / 1) / 3  # recall of classes 0, 1, 2
  assert float(first.merge(second).compute()) == pytest.approx(by_hand)
  logits = np.eye(4)[predictions[:7]] * 5.0
  assert report_metrics.eval_report(logits, labels[:7], list('abcd'))['balanced_accuracy'] == \
      pytest.approx(by_hand)


# --- a short multilabel run: training, eval, predict, report, export, fine-tuning ------------------


def _write_scenes(root, images, tags, split):
  """PNGs under root/split/ and their rows for labels.csv: path, ';'-separated tags (none: empty), split."""
  os.makedirs(os.path.join(root, split), exist_ok=True)
  rows = []
  for i, (image, row) in enumerate(zip(images, tags)):
    path = f'{split}/{i:04d}.png'
    Image.fromarray(image).save(os.path.join(root, path))
    rows.append([path, ';'.join(CLASSES[c] for c in np.flatnonzero(row)), split])
  return rows


@pytest.fixture(scope='module')
def scenes_run(tmp_path_factory):
  """A labels.csv of 16x16 scenes (384 train, 128 test) and the Keras CNN trained on it for 60 steps."""
  root = str(tmp_path_factory.mktemp('scenes'))
  train_images, train_tags = make_scenes(384, seed=0)
  test_images, test_tags = make_scenes(128, seed=1)
  rows = _write_scenes(root, train_images, train_tags, 'train') + _write_scenes(root, test_images, test_tags,
                                                                                 'test')
  with open(os.path.join(root, 'labels.csv'), 'w', newline='') as f:
    csv.writer(f).writerows([['path', 'labels', 'split'], *rows])
  config = cifar10.get_config()
  config.update_from_flattened_dict({
      'task': 'multilabel', 'dataset.labels': os.path.join(root, 'labels.csv'), 'dataset.folder': root,
      'dataset.class_weights': 'balanced', 'label_smoothing': 0.05, 'optimizer.learning_rate': 3e-3,
      'batch_size': 32, 'num_train_steps': 60, 'log_every_steps': 20, 'eval_every_steps': 30,
      'checkpoint_every_steps': 60, 'compilation_cache_dir': 'none'})
  workdir = str(tmp_path_factory.mktemp('run'))
  results = train.train_and_evaluate(config, workdir)
  return config, workdir, results, test_images, test_tags


def test_multilabel_run_learns_and_reports(scenes_run):
  config, workdir, results, _, test_tags = scenes_run
  positive_rate = test_tags.mean()  # the mAP of a model that ranks at random
  assert results['eval_map'] > positive_rate + 0.4, (results['eval_map'], positive_rate)
  assert results['eval_map_micro'] > positive_rate + 0.4
  assert 0 < results['eval_threshold'] < 1 and results['eval_f1'] > 0.7
  assert 0 <= results['eval_accuracy'] <= 1 and 'eval_balanced_accuracy' not in results
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['task'] == 'multilabel'
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    evaluations = [row for row in map(json.loads, f) if 'eval_map' in row]
  assert [row['step'] for row in evaluations] == [30, 60]
  with open(os.path.join(workdir, 'per_class.csv'), newline='') as f:
    rows = list(csv.DictReader(f))
  assert [row['class'] for row in rows] == sorted(CLASSES)  # the label file's classes, sorted
  support = {row['class']: int(row['support']) for row in rows}
  assert support == {name: int(test_tags[:, c].sum()) for c, name in enumerate(CLASSES)}
  for row in rows:
    tp, fp, fn = int(row['tp']), int(row['fp']), int(row['fn'])
    assert tp + fn == int(row['support']) and float(row['recall']) == pytest.approx(tp / (tp + fn))
    assert float(row['f1']) == pytest.approx(2 * tp / (2 * tp + fp + fn))
  mean_ap = np.mean([float(row['average_precision']) for row in rows])
  assert mean_ap == pytest.approx(results['eval_map'], rel=1e-5)
  with open(os.path.join(workdir, 'thresholds.json')) as f:
    thresholds = json.load(f)
  assert thresholds['step'] == 60 and thresholds['weights'] == 'raw' and thresholds['split'] == 'test'
  assert thresholds['threshold'] == pytest.approx(results['eval_threshold'])
  assert {name: float(row['threshold']) for name, row in zip(sorted(CLASSES), rows)} == \
      pytest.approx(thresholds['class_thresholds'])
  for name in ('confusion.png', 'mistakes.png', 'reliability.png', 'curves.png'):
    assert os.path.getsize(os.path.join(workdir, name)) > 1000, name


def test_multilabel_eval_and_predict(scenes_run, tmp_path):
  config, workdir, results, test_images, test_tags = scenes_run
  scored = eval_mode.evaluate_checkpoint(config, workdir)
  for name in ('eval_map', 'eval_map_micro', 'eval_f1', 'eval_threshold', 'eval_accuracy', 'eval_loss'):
    assert scored[name] == pytest.approx(results[name], rel=1e-4), name
  assert scored['num_examples'] == 128
  folder = tmp_path / 'photos'
  folder.mkdir()
  for i in range(4):
    Image.fromarray(test_images[i]).save(folder / f'{i}.png')
  config = config.copy_and_resolve_references()
  config.predict.input, config.predict.output_csv = str(folder), str(tmp_path / 'tags.csv')
  predicted = predict.predict(config, workdir)
  with open(os.path.join(workdir, 'thresholds.json')) as f:
    thresholds = json.load(f)['class_thresholds']
  for row in predicted:
    tags = row['tags'].split(';') if row['tags'] else []
    probabilities = [float(p) for p in row['tag_probabilities'].split(';')] if tags else []
    assert all(p >= thresholds[tag] for tag, p in zip(tags, probabilities))
    assert probabilities == sorted(probabilities, reverse=True)
  with open(tmp_path / 'tags.csv', newline='') as f:
    written = list(csv.DictReader(f))
  assert [os.path.basename(row['path']) for row in written] == [f'{i}.png' for i in range(4)]
  assert list(written[0])[:3] == ['path', 'tags', 'tag_probabilities'] and 'class_1' in written[0]
  # The trained model tags most of these right.
  right = sum(set(row['tags'].split(';') if row['tags'] else []) ==
              {CLASSES[c] for c in np.flatnonzero(test_tags[i])} for i, row in enumerate(predicted))
  assert right >= 2, predicted
  config.eval.threshold = 0.99  # a threshold the user sets wins over the chosen ones
  strict = predict.predict(config, workdir)
  assert sum(len(row['tags'].split(';')) for row in strict if row['tags']) <= sum(
      len(row['tags'].split(';')) for row in predicted if row['tags'])


def test_fine_tuning_a_multilabel_run_into_a_multiclass_one_replaces_the_head(scenes_run):
  config, workdir, *_ = scenes_run
  config = config.copy_and_resolve_references()
  config.task, config.init_from.checkpoint = 'multiclass', workdir
  task = steps.create_task(config, num_classes=4, image_shape=(16, 16, 3), mean=np.zeros(3), std=np.ones(3),
                           length=train.run_length(config, 384))
  placement = placing.place(task, parallel.make_mesh(config), config)
  fresh = _random_state(placement)  # as from the seed, without compiling an initialiser
  state, loaded = finetune.init_from(config, task, placement, fresh, sorted(CLASSES))
  # The same classes, but softmax logits are not sigmoid logits: the head starts afresh, the rest is loaded.
  head = ['Dense_0/bias', 'Dense_0/kernel']
  assert loaded['reinitialised'] == {'the task differs (multilabel there)': head}
  saved = restore_checkpoint(workdir, 60)
  params = parallel.host_copy(placement.to_saveable(state).params)
  np.testing.assert_array_equal(params['stage1']['Conv_0']['kernel'],
                                saved['params']['stage1']['Conv_0']['kernel'])
  np.testing.assert_array_equal(params['Dense_0']['kernel'],
                                parallel.host_copy(placement.to_saveable(fresh).params)['Dense_0']['kernel'])
  config.init_from.keep_head = True
  with pytest.raises(UserError, match='keep_head=True keeps the multilabel head'):
    finetune.init_from(config, task, placement, fresh, sorted(CLASSES))
  config.init_from.checkpoint, config.init_from.keep_head = '', False
  with pytest.raises(checkpoint.CheckpointError, match="task='multilabel' but the config gives 'multiclass'"):
    restore.restore(config, workdir)  # a softmax reading of sigmoid logits is refused


def test_multilabel_export_says_its_task_and_serves_sigmoids(scenes_run):
  config, workdir, *_ = scenes_run
  summary = export.export_checkpoint(config, workdir)
  assert summary['task'] == 'multilabel' and summary['probabilities'].startswith('sigmoid')
  with open(os.path.join(workdir, 'thresholds.json')) as f:
    assert summary['thresholds'] == pytest.approx(json.load(f)['class_thresholds'])
  assert 'thresholds.json' in summary['thresholds_source']
  import tensorflow as tf  # after the export, which hides accelerators from TensorFlow first
  model = tf.saved_model.load(os.path.join(workdir, 'export', 'saved_model'))
  assert model.task.numpy() == b'multilabel'
  images = make_scenes(3, seed=5)[0]
  outputs = model.signatures['serving_default'](images=tf.constant(images))
  np.testing.assert_allclose(outputs['probabilities'].numpy(),
                             report_metrics.sigmoid(outputs['logits'].numpy()), rtol=1e-5, atol=1e-6)
  if sys.version_info < (3, 11):
    return  # no model.onnx: jax2onnx needs Python 3.11+
  import onnxruntime  # model.onnx: the same logits, the same sigmoids
  session = onnxruntime.InferenceSession(os.path.join(workdir, 'export', 'model.onnx'))
  logits, probabilities = session.run(['logits', 'probabilities'], {'images': images})
  assert summary['check']['onnx']['max_abs_diff'] <= summary['check']['onnx']['allowed_abs_diff']
  np.testing.assert_allclose(logits, outputs['logits'].numpy(), rtol=0, atol=1e-4)
  np.testing.assert_allclose(probabilities, report_metrics.sigmoid(logits), rtol=1e-5, atol=1e-6)


def test_best_checkpoint_by_default_metric_of_the_task():
  config = cifar10.get_config()
  assert checkpoint.best_metric(config) == 'eval_accuracy'  # as set
  config.checkpoint.best_metric = 'auto'
  assert checkpoint.best_metric(config) == 'eval_accuracy'
  config.task = 'multilabel'  # exact match at a tuned threshold is noisy; mAP needs no threshold
  assert checkpoint.best_metric(config) == 'eval_map'


@pytest.mark.parametrize('value, shown', [(5.0, '5.0'), (None, 'null'), (float('nan'), 'NaN'), (-1, '-1'),
                                          ('abc', '"abc"'), (True, 'true')])
def test_a_hand_edited_thresholds_file_is_checked_when_read(tmp_path, value, shown):
  from flaxtpu.evaluation.evaluate import report_about  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import thresholds  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()
  config.task = 'multilabel'
  path = tmp_path / 'thresholds.json'

  def write(class_thresholds):
    path.write_text(json.dumps({**report_about(config, 10), 'class_thresholds': class_thresholds}))

  write({'dog': 0.25, 'cat': 0.4})  # any order: by name
  chosen, source = thresholds.tag_thresholds(config, str(tmp_path), 10, ['cat', 'dog'])
  assert chosen.tolist() == [0.4, 0.25] and 'thresholds.json' in source
  write({'cat': 0.4, 'dog': value})
  with pytest.raises(UserError, match=rf"{path}: the threshold of class 'dog' is {shown}, not a number from "
                                      r'0 to 1; .*--mode=eval to rewrite .*--config.eval.threshold'):
    thresholds.tag_thresholds(config, str(tmp_path), 10, ['cat', 'dog'])
  write({'cat': 0.4})
  with pytest.raises(UserError, match=rf"{path} has no threshold for class 'dog'; "):
    thresholds.tag_thresholds(config, str(tmp_path), 10, ['cat', 'dog'])
  write({'cat': 0.4, 'dgo': 0.5, 'dog': 0.5})
  with pytest.raises(UserError, match=rf"{path} has a threshold for 'dgo', which is not one of the model"):
    thresholds.tag_thresholds(config, str(tmp_path), 10, ['cat', 'dog'])
  path.write_text('{"class_thresholds": {"cat": 0.4,')
  with pytest.raises(UserError, match=rf'{path} cannot be read as JSON \(JSONDecodeError'):
    thresholds.tag_thresholds(config, str(tmp_path), 10, ['cat', 'dog'])
  write({'ant': 0.3})  # another model's classes: not this model's file
  assert thresholds.tag_thresholds(config, str(tmp_path), 10, ['cat', 'dog'])[0].tolist() == [0.5, 0.5]
  config.eval.threshold = 0.7  # the user's choice wins, the file is not read
  path.write_text('not json')
  assert thresholds.tag_thresholds(config, str(tmp_path), 10, ['cat', 'dog'])[0].tolist() == [0.7, 0.7]
