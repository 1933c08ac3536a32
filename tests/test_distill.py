"""Distillation: the loss by hand, what the teacher sees in each recipe, whole runs from a teacher workdir."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import digits
from conftest import assert_same_state, metric_rows, restore_checkpoint, signal_at_step, tiny_dataset
from flaxtpu.augmentation import augment
from flaxtpu.loop import train
from flaxtpu.settings import lengths
from flaxtpu.settings.errors import UserError
from flaxtpu.step import parallel, steps
from flaxtpu.transfer import distill
from flaxtpu.validation import config as config_lib
from flaxtpu.validation.config import ConfigError
from flaxtpu.weights import checkpoint, pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- the loss -------------------------------------------------------------------------------


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_kl_is_t_squared_times_the_softmax_kl_and_the_cross_entropy_for_one_hot_targets():
  rng = np.random.default_rng(0)
  student, teacher = rng.normal(size=(4, 5)) * 3, rng.normal(size=(4, 5)) * 3
  p, q = _softmax(teacher / 2.0), _softmax(student / 2.0)
  by_hand = 4.0 * np.sum(p * (np.log(p) - np.log(q)), axis=-1)
  np.testing.assert_allclose(distill.kl_per_example(jnp.asarray(student), jnp.asarray(p), 2.0, False),
                             by_hand, rtol=1e-5)
  one_hot = np.eye(5)[[0, 3, 1, 4]]  # 0 log 0 = 0: the KL is the cross-entropy
  cross_entropy = -np.log(_softmax(student))[np.arange(4), [0, 3, 1, 4]]
  np.testing.assert_allclose(distill.kl_per_example(jnp.asarray(student), jnp.asarray(one_hot), 1.0, False),
                             cross_entropy, rtol=1e-5)
  assert float(distill.kl_per_example(jnp.asarray(student), jnp.asarray(_softmax(student)), 1.0,
                                      False).max()) < 1e-6


def test_multilabel_kl_is_the_binary_kl_summed_over_tags():
  rng = np.random.default_rng(1)
  student, teacher = rng.normal(size=(3, 6)) * 2, rng.normal(size=(3, 6)) * 2
  sigmoid = lambda x: 1 / (1 + np.exp(-x))
  p, q = sigmoid(teacher / 3.0), sigmoid(student / 3.0)
  by_hand = 9.0 * np.sum(p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q)), axis=-1)
  np.testing.assert_allclose(distill.kl_per_example(jnp.asarray(student), jnp.asarray(p), 3.0, True),
                             by_hand, rtol=1e-5)


def _step_config(**overrides):
  config = digits.get_config()
  config.update_from_flattened_dict({'optimizer.name': 'sgd', 'optimizer.learning_rate': 0.0,
                                     'schedule.name': 'constant', 'schedule.warmup_epochs': 0.0,
                                     'label_smoothing': 0.1, 'dataset.normalize': 'standardize',
                                     'compilation_cache_dir': 'none',
                                     **overrides})
  return config


def _teacher(loss, alpha, temperature):
  """A CNN teacher with its own normalisation and its classes in another order than the run's."""
  config = _step_config()
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=np.zeros(3), std=np.ones(3))
  teacher = distill.Teacher(model=task.model, mean=np.array([0.5, 0.4, 0.3], np.float32),
                            std=np.array([0.2, 0.25, 0.3], np.float32), order=np.array([2, 0, 1]), loss=loss,
                            alpha=alpha, temperature=temperature, multilabel=False)
  return teacher, steps.init_model(task, seed=7)


@pytest.mark.parametrize('loss', ['soft', 'hard', 'function_matching'])
def test_the_train_loss_is_the_mixture_of_label_and_teacher_terms_computed_by_hand(loss):
  temperature = 1.0 if loss == 'hard' else 2.0
  config = _step_config(**{'augment.mixup_alpha': 1.0})
  dataset = tiny_dataset()
  teacher, teacher_variables = _teacher(loss, 0.7, temperature)
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=dataset.mean, std=dataset.std,
                           length=lengths.run_length(config, 64), teacher=teacher)
  state = steps.init_state(task, 0)
  images, labels = dataset.train.images[:8], dataset.train.labels[:8]
  _, step_metrics = steps.train_step(state, (images, labels), teacher_variables=teacher_variables, task=task)

  # By hand: the images the student sees, normalised its way; the teacher's, normalised its way.
  key, positions = jax.random.fold_in(state.rng, 0), jnp.arange(8)
  pixels = jnp.asarray(images, jnp.float32) / 255.0
  student_in = (pixels - dataset.mean) / dataset.std
  one_hot = np.eye(3)[labels]

  def teacher_probs(x):  # teacher logits of [0, 1] pixels x, in the run's class order
    logits = teacher.model.apply({'params': teacher_variables.params,
                                  'batch_stats': teacher_variables.batch_stats},
                                 (x - teacher.mean) / teacher.std, train=False)[:, [2, 0, 1]]
    if loss == 'hard':
      return np.eye(3)[np.argmax(logits, -1)]
    return _softmax(np.asarray(logits) / temperature)

  mixed_in, mixed_labels = augment.mix_batch(key, student_in, jnp.asarray(one_hot, jnp.float32),
                                             positions, config.augment)
  if loss == 'function_matching':  # the very mixed image
    targets = teacher_probs(np.asarray(mixed_in) * dataset.std + dataset.mean)
  else:  # the image before mixing, its probabilities mixed as the labels
    _, targets = augment.mix_batch(key, student_in, jnp.asarray(teacher_probs(pixels), jnp.float32),
                                   positions, config.augment)
  logits = np.asarray(task.model.apply({'params': state.params, 'batch_stats': state.batch_stats},
                                       mixed_in, train=True, mutable=['batch_stats'])[0])
  log_q = np.log(_softmax(logits))
  smoothed = np.asarray(mixed_labels) * 0.9 + 0.1 / 3
  label_loss = -(smoothed * log_q).sum(-1)
  targets = np.asarray(targets)
  log_q_t = np.log(_softmax(logits / temperature))
  kl = temperature ** 2 * (np.where(targets > 0, targets * np.log(np.maximum(targets, 1e-30)), 0)
                           - targets * log_q_t).sum(-1)
  assert not np.allclose(np.asarray(mixed_in), np.asarray(student_in))  # mixup did mix
  np.testing.assert_allclose(float(step_metrics.distill_kl.compute()), kl.mean(), rtol=2e-4)
  np.testing.assert_allclose(float(step_metrics.loss.compute()), (0.3 * label_loss + 0.7 * kl).mean(),
                             rtol=2e-4)


@pytest.mark.parametrize('overrides, message', [
    ({'distill.loss': 'kd'}, "config.distill.loss='kd'"),
    ({'distill.alpha': 1.5}, 'config.distill.alpha=1.5 must be in [0, 1]'),
    ({'distill.temperature': 0.0}, 'config.distill.temperature=0.0 must be > 0'),
    ({'distill.loss': 'hard', 'distill.temperature': 4.0}, 'config.distill.loss=hard'),
    ({'distill.step': 'newest'}, "config.distill.step='newest'"),
])
def test_bad_distill_settings_are_one_line_each(overrides, message):
  config = _step_config(**{'distill.teacher': '/some/run', 'optimizer.learning_rate': 0.1, **overrides})
  with pytest.raises(ConfigError, match=message.replace('[', r'\[').replace(']', r'\]')):
    config_lib.validate(config)


# --- whole runs -----------------------------------------------------------------------------


def _run_config(**overrides):
  config = digits.get_config()  # the small CNN on the embedded 8x8 digits
  config.update_from_flattened_dict({'num_train_steps': 12, 'eval_every_steps': 6,
                                     'checkpoint_every_steps': 6, 'log_every_steps': 3,
                                     'compilation_cache_dir': 'none', **overrides})
  return config


@pytest.fixture(scope='module')
def teacher_workdir(tmp_path_factory):
  """A wider, trained teacher: the CNN on the digits for 60 steps."""
  workdir = str(tmp_path_factory.mktemp('teacher'))
  train.train_and_evaluate(_run_config(num_train_steps=60, eval_every_steps=30, checkpoint_every_steps=30),
                           workdir)
  return workdir


def test_a_distilled_run_keeps_only_the_student_and_logs_the_teacher_term(tmp_path, teacher_workdir):
  plain, distilled = str(tmp_path / 'plain'), str(tmp_path / 'distilled')
  train.train_and_evaluate(_run_config(), plain)
  results = train.train_and_evaluate(_run_config(**{'distill.teacher': teacher_workdir, 'distill.alpha': 0.5,
                                                    'distill.temperature': 2.0}), distilled)
  saved_plain, saved = restore_checkpoint(plain, 12), restore_checkpoint(distilled, 12)
  assert jax.tree.structure(saved) == jax.tree.structure(saved_plain)  # no teacher arrays in it
  rows = metric_rows(distilled)
  kl = [row['train_distill_kl'] for row in rows if 'train_distill_kl' in row]
  assert len(kl) == 4 and all(value > 0 for value in kl)
  assert 'train_distill_kl' not in json.dumps(metric_rows(plain))
  record = checkpoint.Checkpoints(distilled, _run_config(), read_only=True).read_record(12)
  teacher_best = checkpoint.Checkpoints(teacher_workdir, _run_config(), read_only=True).best_step()
  assert record['distill'] == {'teacher': teacher_workdir, 'step': teacher_best}
  assert 0.0 <= results['eval_accuracy'] <= 1.0


def test_alpha_zero_trains_as_without_a_teacher(tmp_path, teacher_workdir):
  plain, distilled = str(tmp_path / 'plain'), str(tmp_path / 'alpha0')
  train.train_and_evaluate(_run_config(num_train_steps=6), plain)
  train.train_and_evaluate(_run_config(num_train_steps=6, **{'distill.teacher': teacher_workdir,
                                                             'distill.alpha': 0.0}), distilled)
  for a, b in zip(jax.tree.leaves(restore_checkpoint(plain, 6)['params']),
                  jax.tree.leaves(restore_checkpoint(distilled, 6)['params']), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_stopped_distilled_run_resumes_exactly_on_the_teacher_step_it_started_with(
    tmp_path, teacher_workdir, monkeypatch):
  overrides = {'distill.teacher': teacher_workdir, 'distill.loss': 'function_matching', 'distill.alpha': 1.0,
               'augment.mixup_alpha': 0.5, 'distill.step': 'latest'}
  whole, resumed = str(tmp_path / 'whole'), str(tmp_path / 'resumed')
  train.train_and_evaluate(_run_config(**overrides), whole)
  with monkeypatch.context() as patch:  # a run preempted mid-way (it saves where it stops) ...
    signal_at_step(patch, 7)
    assert 0 < train.train_and_evaluate(_run_config(**overrides), resumed)['stopped_at_step'] < 12
  # ... resumed after `latest` changed its meaning (a newer teacher checkpoint appeared): it must keep
  # reading the teacher step it started with.
  real = checkpoint.Checkpoints.resolve
  moved = lambda self, which, key='eval.checkpoint': 30 if which == 'latest' else real(self, which, key)
  monkeypatch.setattr(checkpoint.Checkpoints, 'resolve', moved)
  train.train_and_evaluate(_run_config(**overrides), resumed)
  assert_same_state(restore_checkpoint(whole, 12), restore_checkpoint(resumed, 12))
  assert metric_rows(whole) == metric_rows(resumed)


def test_pmap_distils_as_jit_does(tmp_path, teacher_workdir):
  overrides = {'distill.teacher': teacher_workdir, 'distill.temperature': 3.0, 'num_train_steps': 6}
  jit_dir, pmap_dir = str(tmp_path / 'jit'), str(tmp_path / 'pmap')
  train.train_and_evaluate(_run_config(**overrides), jit_dir)
  train.train_and_evaluate(_run_config(parallelism='pmap', **overrides), pmap_dir)
  for a, b in zip(jax.tree.leaves(restore_checkpoint(jit_dir, 6)['params']),
                  jax.tree.leaves(restore_checkpoint(pmap_dir, 6)['params']), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_teacher_of_other_classes_or_no_checkpoint_is_one_line(tmp_path, teacher_workdir):
  with pytest.raises(UserError, match='distill.teacher=.* holds no flaxtpu checkpoint'):
    train.train_and_evaluate(_run_config(**{'distill.teacher': str(tmp_path / 'nothing')}),
                             str(tmp_path / 'a'))
  with pytest.raises(UserError, match=r'predicts 10 classes and the data has 3'):
    distill.class_order([str(i) for i in range(10)], ['0', '1', '2'], teacher_workdir)
  assert list(distill.class_order(['b', 'c', 'a'], ['a', 'b', 'c'], 't')) == [2, 0, 1]
  assert not os.path.exists(tmp_path / 'a' / 'checkpoints' / '6')


def test_a_teacher_of_another_size_or_other_classes_is_one_line_naming_both(tmp_path, teacher_workdir):
  """Issue 52 part 3: the teacher (8x8 digits, 10 classes) against a student at 16 px, one resized by
  augment.train_sizes, one of other classes: one line each, before the teacher's weights are read."""
  names = [str(digit) for digit in range(10)]
  config = _run_config(**{'distill.teacher': teacher_workdir})
  mesh = parallel.make_mesh(config)
  with pytest.raises(UserError) as raised:
    distill.load_teacher(config, names, (16, 16, 1), mesh)
  assert str(raised.value) == (
      f"config.distill.teacher={teacher_workdir!r} (cnn) was trained on 8x8 images and the student's data "
      "gives 16x16; train the student at the teacher's size (config.dataset.image_size=8) or distill from a "
      "teacher trained at the student's (a teacher's input is never resized)")
  resized = _run_config(**{'distill.teacher': teacher_workdir, 'augment.train_sizes': ((0.0, 6), (0.5, 8))})
  with pytest.raises(UserError) as raised:
    distill.load_teacher(resized, names, (8, 8, 1), mesh)
  assert str(raised.value) == (
      f"config.distill.teacher={teacher_workdir!r} (cnn) was trained on 8x8 images and "
      "config.augment.train_sizes resizes the student's (and so the teacher's) to 6x6; drop "
      "augment.train_sizes (or distill without it: a teacher's input is never resized)")
  with pytest.raises(UserError) as raised:
    distill.load_teacher(config, names, (8, 8, 3), mesh)
  assert str(raised.value) == (
      f'config.distill.teacher={teacher_workdir!r} (cnn) reads (8, 8, 1) images and the data gives '
      '(8, 8, 3); distill from a teacher trained on images of 3 channels')
  with pytest.raises(UserError) as raised:
    distill.load_teacher(config, names[:3], (8, 8, 1), mesh)
  assert str(raised.value) == (
      f"config.distill.teacher={teacher_workdir!r} predicts 10 classes and the data has 3 (the data lacks "
      "['3', '4', '5']); distill from a teacher of these classes (fine-tune one first with init_from)")
  with pytest.raises(UserError) as raised:
    distill.load_teacher(config, [*names[:9], 'ten'], (8, 8, 1), mesh)
  assert str(raised.value) == (
      f"config.distill.teacher={teacher_workdir!r} predicts 10 classes and the data has 10 (the teacher "
      "lacks ['ten']) (the data lacks ['9']); distill from a teacher of these classes (fine-tune one first "
      'with init_from)')


def test_a_teacher_of_another_size_stops_the_command_in_one_line(tmp_path, teacher_workdir):
  result = subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py', f'--workdir={tmp_path / "run"}',
       f'--config.distill.teacher={teacher_workdir}', '--config.dataset.image_size=16',
       '--config.compilation_cache_dir=none'], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 2, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert errors == [f"error: config.distill.teacher={teacher_workdir!r} (cnn) was trained on 8x8 images and "
                    "the student's data gives 16x16; train the student at the teacher's size "
                    "(config.dataset.image_size=8) or distill from a teacher trained at the student's (a "
                    "teacher's input is never resized)"]
  assert 'Traceback' not in result.stderr
  assert os.listdir(tmp_path / 'run' / 'checkpoints') == []  # stopped before any step


def test_a_published_teacher_scores_images_as_its_source_framework(tmp_path, caplog):
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  from test_pretrained import import_torch, randomise_batch_norm  # pylint: disable=g-import-not-at-top
  torch, _, timm = import_torch()
  torch.manual_seed(0)
  source = randomise_batch_norm(torch, timm.create_model('resnet18', num_classes=3)).eval()
  path = str(tmp_path / 'resnet18_3.safetensors')
  save_file({key: value.contiguous() for key, value in source.state_dict().items()}, path)
  config = _step_config(**{'distill.teacher': path, 'distill.temperature': 2.0})
  names = ['class_2', 'class_0', 'class_1']  # the run's classes in another order than the teacher's
  # Without timm's config.json the file is taken as trained at timm's size for ResNets: never resized.
  with pytest.raises(UserError) as raised:
    distill.load_teacher(config, names, (32, 32, 3), parallel.make_mesh(config))
  assert str(raised.value) == (
      f"config.distill.teacher={path!r} (resnet18) was trained on 224x224 images and the student's data "
      "gives 32x32; train the student at the teacher's size (config.dataset.image_size=224) or distill "
      "from a teacher trained at the student's (a teacher's input is never resized)")
  (tmp_path / 'config.json').write_text(json.dumps({'pretrained_cfg': {'input_size': [3, 32, 32]}}))
  pretrained.describe.cache_clear()
  with caplog.at_level(logging.INFO):
    teacher, variables = distill.load_teacher(config, names, (32, 32, 3), parallel.make_mesh(config))
  assert (f'distill.teacher={path} normalises images with mean (0.485, 0.456, 0.406) std (0.229, 0.224, '
          "0.225) and the student with its train split's mean and std: the teacher is fed the student's "
          'pixels normalised its own way') in caplog.messages
  assert teacher.step == 0 and teacher.source == path and list(teacher.order) == [2, 0, 1]
  pixels = np.random.default_rng(0).random((2, 32, 32, 3)).astype(np.float32)
  mean, std = np.full(3, 0.5, np.float32), np.full(3, 0.25, np.float32)  # the student's normalisation
  ours = teacher.logits(variables, jnp.asarray((pixels - mean) / std), mean, std)
  expected = source(torch.from_numpy(((pixels - teacher.mean) / teacher.std).transpose(0, 3, 1, 2)))
  np.testing.assert_allclose(ours, expected.detach().numpy()[:, [2, 0, 1]], rtol=1e-4, atol=1e-4)
