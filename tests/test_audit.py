"""--mode=audit on a generated folder with planted problems (issue 40 part 4): recall and precision per
kind; wrong labels found with out-of-fold probabilities (issue 52 part 1), against cleanlab on the same
probabilities; and, from a small trained run, --mode=predict's explanations and the eval report's
overlays."""

import json
import logging
import os
import shutil
import time

import numpy as np
import pytest
from PIL import Image
from planted import compilation_cache_in, make_digits_folder, make_planted_folder, score

from configs import cifar10, digits
from flaxtpu.data import audit
from flaxtpu.evaluation import explain
from flaxtpu.loop import train
from flaxtpu.modes import audit as audit_mode
from flaxtpu.modes import audit_folds, predict
from flaxtpu.modes import eval as eval_mode
from flaxtpu.settings.errors import ConfigError, UserError

# The fold runs of the planted folder's audits train at 16 px: its classes are colours, learnt as well
# (12 of 12 flips found, none wrongly), and a fold run's 60 steps cost a quarter of 32 px's.
FOLD_RUNS = {'dataset.image_size': 16}


def _config(folder, **overrides):
  config = cifar10.get_config()  # the default cnn
  config.dataset.folder = folder
  config.dataset.image_size = 32  # the planted near copies are 24-48 px
  config.dataset.skip_corrupt = True  # training steps over the planted broken files
  config.batch_size = 32
  config.num_train_steps = 60
  config.log_every_steps = 30
  config.eval_every_steps = 60
  config.checkpoint_every_steps = 60
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(scope='module', autouse=True)
def compilation_cache(tmp_path_factory):
  """The CLI's persistent compilation cache (flaxtpu/main.py) for this module: an audit's fold runs
  compile the same programs, so the first fold run compiles them and the others read them back, as
  `--mode=audit` does from the command line. Dropped at the module's end."""
  with compilation_cache_in(str(tmp_path_factory.mktemp('jax_cache'))):
    yield


@pytest.fixture(scope='module')
def planted(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('planted'))
  return root, make_planted_folder(root)


@pytest.fixture(scope='module')
def trained(planted, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('run'))
  train.train_and_evaluate(_config(planted[0]), workdir)
  return workdir


@pytest.fixture(scope='module')
def digits_audit(tmp_path_factory):
  """An audit of 1,000 embedded digits (8x8 PNGs) with 10 flipped labels, by the digits recipe (configs/
  digits.py: the CNN, Adam, 20 epochs) in 5 fold runs of 248 steps (audit.steps_fraction=0.4 of the run's
  620, for the test's time; the default 1.0 measured 7 of 10 in its 8 suspects, fold accuracies
  0.937-0.979 against chance 0.109, in 143 s): (report, flipped paths, (config, workdir))."""
  root = str(tmp_path_factory.mktemp('digits'))
  flipped = set(make_digits_folder(root, count=1000, flips=10, seed=0))
  config = digits.get_config()
  config.dataset.name, config.dataset.folder = '', root
  config.dataset.train_split = config.dataset.eval_split = 'train'  # one split: all 1,000 audited
  config.compilation_cache_dir = 'none'
  config.log_every_steps = 1000
  config.audit.steps_fraction = 0.4
  workdir = str(tmp_path_factory.mktemp('digits_audit'))
  return audit_mode.run_audit(config, workdir), flipped, (config, workdir)


def test_audit_finds_every_planted_copy_and_broken_file(planted, tmp_path, caplog):
  root, truth = planted
  with caplog.at_level(logging.INFO):
    audit_mode.run_audit(_config(root, **{'audit.folds': 0}), str(tmp_path))
  with open(tmp_path / 'audit.json') as f:
    report = json.load(f)
  assert list(report) == sorted(audit_mode.SCHEMA)  # exactly the issue's keys
  rates = score(report, truth)
  print(json.dumps(rates))
  for kind in ('exact_duplicates', 'near_duplicates', 'leaks', 'unreadable'):
    assert rates[kind]['recall'] == 1.0 and rates[kind]['precision'] == 1.0, (kind, rates[kind])
  # audit.folds=0: no search for wrong labels, and the log says so.
  assert report['suspected_mislabels'] == []
  assert report['mislabel_search'] == {'method': 'none', 'why': 'audit.folds=0: not looked for',
                                       'rule': 'prune_by_noise_rate'}
  assert 'suspected mislabels: 0' in caplog.text and 'audit.folds=0: not looked for' in caplog.text
  assert report['class_counts']['test'] == {'red': 15, 'green': 15, 'blue': 15}
  assert sum(report['class_counts']['train'].values()) == 120 + 6 + 6 + 3 + 3 + 12  # unreadable left out
  assert (tmp_path / 'audit.png').stat().st_size > 10_000


def test_audit_scores_each_image_out_of_fold_and_ranks_the_flipped_labels_first(planted, tmp_path, caplog):
  """No trained run needed: 5 fold runs of the recipe (its 60 steps each) score the fold they did not see,
  and audit.json gives their held-out accuracies beside chance (1/3)."""
  root, truth = planted
  with caplog.at_level(logging.INFO):
    report = audit_mode.run_audit(_config(root, **FOLD_RUNS), str(tmp_path))
  rates = score(report, truth)['suspected_mislabels']
  search = report['mislabel_search']
  print(json.dumps(rates), json.dumps(search))
  assert rates['recall'] >= 0.8 and rates['precision'] >= 0.9, rates  # measured 12 of 12 (11 at 30 steps)
  assert search['method'] == 'folds' and search['folds'] == 5 and search['steps'] == 60
  assert search['verdict'] == 'listed' and search['uniform_chance'] == 0.3333 and search['chance'] < 0.4
  assert len(search['fold_accuracies']) == 5 and min(search['fold_accuracies']) > 2 * search['chance']
  assert search['scored'] == 195 and not search['reused']  # both splits' readable images
  assert '195 images <= audit.fold_limit=100,000' in search['why']
  scores = [row['score'] for row in report['suspected_mislabels']]
  assert scores == sorted(scores, reverse=True)
  top = report['suspected_mislabels'][0]
  assert top['path'] in truth['flipped'] and top['label'] != top['predicted']
  assert top['predicted_probability'] > top['label_probability']
  assert caplog.text.count('audit: fold run ') == 5


def test_audit_ranks_planted_flips_of_real_digits_in_its_top_20(digits_audit):
  """Issue 52's check: 10 labels flipped among 1,000 images. The run's own model found 5 in its top 20;
  the digits recipe's fold runs find 9 (7, 8, 9, 10 and 7 with other flips: seeds 0-4)."""
  report, flipped, _ = digits_audit
  ranked = [row['path'] for row in report['suspected_mislabels']]
  found = len(set(ranked[:20]) & flipped)
  print(f'{found} of 10 flips in the top 20 of {len(ranked)} suspects', report['mislabel_search'])
  assert found >= 7
  assert found / min(20, len(ranked)) >= 0.6  # precision in the top 20 (measured 9 of 12)
  assert report['mislabel_search']['held_out_accuracy'] > 0.93  # each fold run predicts its held-out fold


def test_out_of_fold_suspects_are_cleanlabs_on_the_same_probabilities(digits_audit):
  """The rule is implemented here in numpy; cleanlab (the test extra) gives the same suspects in the same
  order."""
  filtering = pytest.importorskip('cleanlab.filter')
  report, _, _ = digits_audit
  with np.load(os.path.join(report['mislabel_search']['directory'], audit_folds.PROBABILITIES)) as saved:
    paths, labels, probabilities = list(saved['paths']), saved['labels'], saved['probabilities']
  assert probabilities.shape == (1000, 10) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-4)
  theirs = filtering.find_label_issues(labels, probabilities, filter_by='prune_by_noise_rate',
                                       return_indices_ranked_by='normalized_margin', n_jobs=1)
  assert [row['path'] for row in report['suspected_mislabels']] == [paths[i] for i in theirs]
  for rule in audit.RULES:
    ours = audit.find_label_issues(labels, probabilities, rule).ranked
    theirs = filtering.find_label_issues(labels, probabilities, filter_by=rule,
                                         return_indices_ranked_by='normalized_margin', n_jobs=1)
    assert ours.tolist() == theirs.tolist(), rule


def test_a_second_audit_of_the_same_data_and_recipe_trains_nothing(digits_audit, monkeypatch, caplog):
  report, _, (config, workdir) = digits_audit
  monkeypatch.setattr(train, 'train_and_evaluate', lambda *args, **kwargs: pytest.fail('trained again'))
  started = time.time()
  with caplog.at_level(logging.INFO):
    again = audit_mode.run_audit(config, workdir)
  assert time.time() - started < 0.5 * report['mislabel_search']['seconds']
  assert again['mislabel_search']['reused'] and not report['mislabel_search']['reused']
  assert again['suspected_mislabels'] == report['suspected_mislabels']
  assert 'read back from' in caplog.text and '(nothing trained)' in caplog.text


def test_a_changed_label_or_recipe_trains_new_fold_models(digits_audit, monkeypatch):
  """The key holds the images' contents and labels and the recipe: another of either is another key."""
  _, flipped, (config, workdir) = digits_audit
  def trains(*args):
    raise RuntimeError('trains')

  monkeypatch.setattr(audit_folds, '_train_folds', trains)
  other = config.copy_and_resolve_references()
  other.optimizer.learning_rate = 1e-3
  with pytest.raises(RuntimeError, match='trains'):
    audit_mode.run_audit(other, workdir)
  path = sorted(flipped)[0]
  fixed = os.path.join(os.path.dirname(os.path.dirname(path)), '0' if '/0/' not in path else '1')
  shutil.move(path, os.path.join(fixed, 'moved.png'))
  try:
    with pytest.raises(RuntimeError, match='trains'):
      audit_mode.run_audit(config, workdir)
  finally:
    shutil.move(os.path.join(fixed, 'moved.png'), path)


def test_a_large_audit_trains_fold_models_on_a_sample(planted, tmp_path):
  """Over audit.fold_limit images and no frozen backbone: fold runs on a stratified sample of that many."""
  root, truth = planted
  report = audit_mode.run_audit(_config(root, **{'audit.fold_limit': 90, **FOLD_RUNS}), str(tmp_path))
  search = report['mislabel_search']
  assert search['method'] == 'sample' and search['scored'] == 90
  assert search['why'].startswith('195 images > audit.fold_limit=90 and no frozen backbone')
  with np.load(os.path.join(search['directory'], audit_folds.PROBABILITIES)) as saved:
    sampled = set(saved['paths'].tolist())
  assert len(sampled) == 90 and {row['path'] for row in report['suspected_mislabels']} <= sampled
  in_sample = set(truth['flipped']) & sampled
  found = {row['path'] for row in report['suspected_mislabels']} & in_sample
  assert len(found) >= 0.75 * len(in_sample), (len(found), len(in_sample))
  # Fold runs draw no end-of-run pictures (train_and_evaluate(pictures=False)): nobody looks at them.
  fold_run = os.path.join(search['directory'], 'fold_0')
  assert os.path.exists(os.path.join(fold_run, 'results.json'))
  assert not {'per_class.csv', 'curves.png', 'confusion.png'} & set(os.listdir(fold_run))


@pytest.mark.parametrize('backbone', ['trained run', 'init_from'])
def test_a_large_audit_probes_frozen_features_out_of_fold(planted, trained, tmp_path, backbone):
  """Over audit.fold_limit images with a backbone: a linear probe per fold on its embeddings of every image,
  from the run in the workdir, or from init_from.checkpoint's weights (here the same run's, as a fine-tuning
  recipe names them)."""
  root, truth = planted
  config = _config(root, **{'audit.fold_limit': 90})
  workdir = trained
  if backbone == 'init_from':
    config.init_from.checkpoint, workdir = trained, str(tmp_path)
  report = audit_mode.run_audit(config, workdir)
  search = report['mislabel_search']
  print(json.dumps(search))
  assert search['method'] == 'features' and search['scored'] == 195
  assert search['why'].startswith('195 images > audit.fold_limit=90 and audit.large=auto: a linear probe')
  named = 'the trained run in' if backbone == 'trained run' else 'config.init_from.checkpoint='
  assert named in search['why']
  rates = score(report, truth)['suspected_mislabels']
  assert rates['recall'] >= 0.75 and rates['precision'] >= 0.75, rates


def test_features_without_a_backbone_is_refused_in_one_line(planted, tmp_path):
  root, _ = planted
  with pytest.raises(UserError, match='config.audit.large=features needs frozen embeddings'):
    audit_mode.run_audit(_config(root, **{'audit.fold_limit': 90, 'audit.large': 'features'}), str(tmp_path))


def test_audit_refuses_sources_of_no_image_files(tmp_path):
  config = _config('')
  config.dataset.name = 'mnist'
  with pytest.raises(UserError, match=r'--mode=audit reads image files .* not a TFDS dataset'):
    audit_mode.run_audit(config, str(tmp_path))


def test_confident_learning_is_cleanlabs_rule():
  """On out-of-sample-like probabilities of many shapes (2-14 classes, 50-3,000 examples, 0-30% noise,
  saturated or not), both rules give cleanlab's suspects in cleanlab's order."""
  filtering = pytest.importorskip('cleanlab.filter')
  for seed in range(24):
    rng = np.random.default_rng(seed)
    count, classes = int(rng.integers(50, 3000)), int(rng.integers(2, 15))
    true = rng.integers(0, classes, count)
    labels = true.copy()
    noisy = rng.random(count) < rng.uniform(0, 0.3)
    labels[noisy] = rng.integers(0, classes, noisy.sum())
    logits = rng.normal(0, rng.uniform(0.5, 3), (count, classes))
    logits[np.arange(count), true] += rng.uniform(0.5, 5)
    logits *= 10 if seed % 3 == 0 else 1  # probabilities of exactly 0 and 1, ties included
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = (probabilities / probabilities.sum(axis=1, keepdims=True)).astype(np.float32)
    for rule in audit.RULES:
      ours = audit.find_label_issues(labels, probabilities, rule)
      theirs = filtering.find_label_issues(labels, probabilities, filter_by=rule,
                                           return_indices_ranked_by='normalized_margin', n_jobs=1)
      assert ours.ranked.tolist() == theirs.tolist(), (seed, rule)
      assert np.all(ours.likely[ours.ranked] != labels[ours.ranked])


def test_folds_are_stratified_and_keep_copies_together():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 4, 1000)
  groups = np.arange(1000)
  groups[500:560] = groups[440:500]  # 60 images with a copy
  folds = audit.assign_folds(labels, groups, 5, seed=0)
  assert np.all(folds[500:560] == folds[440:500])
  assert np.ptp(np.bincount(folds)) <= 14  # sizes within a few images
  for label in range(4):
    per_fold = np.bincount(folds[labels == label], minlength=5)
    assert np.ptp(per_fold) <= 14, per_fold
  assert np.array_equal(folds, audit.assign_folds(labels, groups, 5, seed=0))  # the same every audit


def test_the_method_follows_the_audits_size():
  assert audit.choose_method(1000, 0, 50_000, 'auto', '')[0] == 'none'
  assert audit.choose_method(50_000, 5, 50_000, 'auto', 'x')[0] == 'folds'
  assert audit.choose_method(50_001, 5, 50_000, 'auto', 'config.init_from.checkpoint=y')[0] == 'features'
  assert audit.choose_method(50_001, 5, 50_000, 'auto', '')[0] == 'sample'
  assert audit.choose_method(50_001, 5, 50_000, 'sample', 'x')[0] == 'sample'


@pytest.mark.parametrize('key, value, message', [
    ('folds', 1, 'must be 0 .* or 2..50'), ('steps_fraction', 0.0, r'must lie in \(0, 10\]'),
    ('steps_fraction', 11.0, r'must lie in \(0, 10\]'), ('min_epochs', -1.0, r'must lie in \[0, 1000\]'),
    ('fold_limit', 9, 'at least 2 x audit.folds'), ('large', 'all', 'must be one of auto, features, sample'),
    ('rule', 'both', 'must be one of prune_by_noise_rate, confident_learning')])
def test_audit_settings_are_checked(key, value, message):
  config = cifar10.get_config()
  config.audit[key] = value
  with pytest.raises(ConfigError, match=message):
    audit.check_config(config)


def test_near_pairs_agree_with_comparing_every_pair():
  rng = np.random.default_rng(0)
  hashes = rng.integers(0, 2**63, 400, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
  flips = rng.integers(0, 64, (100, 5))  # 100 planted neighbours, 1-5 bits away
  near = [h ^ np.bitwise_or.reduce(np.uint64(1) << f[:1 + i % 5].astype(np.uint64))
          for i, (h, f) in enumerate(zip(hashes[:100], flips))]
  hashes = np.concatenate([hashes, np.asarray(near, np.uint64)])
  distance = np.bitwise_count(hashes[:, None] ^ hashes[None, :])
  for bits in (2, 6):
    brute = {(i, j) for i, j in zip(*np.nonzero(np.triu(distance <= bits, 1)))}
    assert {tuple(pair) for pair in audit.near_pairs(hashes, bits).tolist()} == brute
    assert len(brute) >= 20


def test_predict_explain_writes_heatmaps_at_each_images_own_size(planted, trained, tmp_path):
  root, truth = planted
  folder = tmp_path / 'inputs'
  # Same stem in two folders, and two files of one folder with the same stem: nothing overwritten.
  # Their sizes: 32, 24 (JPEG), 48 (JPEG), 32 px.
  for relative, source in (('a/x.png', truth['exact'][0][0]), ('b/x.jpg', truth['near'][0][1]),
                           ('b/y.jpg', truth['near'][1][1]), ('b/y.png', truth['leaks'][0][1])):
    (folder / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, folder / relative)
  config = _config(root)
  config.predict.input = str(folder)
  config.predict.explain = True
  config.predict.output_csv = str(tmp_path / 'predictions.csv')
  rows = predict.predict(config, trained)
  explained = os.path.join(trained, 'explain')
  assert sorted(row['heatmap'] for row in rows) == sorted(os.path.join(explained, name) for name in (
      'a/x.npy', 'b/x.npy', 'b/y.jpg.npy', 'b/y.png.npy'))
  assert {Image.open(row['path']).size for row in rows} == {(32, 32), (24, 24), (48, 48)}
  for row in rows:
    heatmap = np.load(row['heatmap'])
    width, height = Image.open(row['path']).size
    assert heatmap.shape == (height, width) and heatmap.dtype == np.float32
    assert np.all(np.isfinite(heatmap)) and heatmap.min() >= 0
    assert heatmap.max() == pytest.approx(1.0, abs=0.05)
    # Outside the centre crop (crop fraction 0.875 of the shorter side) is 0.
    margin = int(np.floor((1 - 0.875) * min(width, height) / 2))
    if margin:
      assert heatmap[:margin].max() == 0 and heatmap[:, :margin].max() == 0
    overlay = Image.open(row['heatmap'].removesuffix('.npy') + '.overlay.png')
    assert overlay.size == (width, height) and overlay.mode == 'RGB'
  assert 'heatmap' in open(config.predict.output_csv).readline()


def test_eval_mistakes_show_the_heatmaps(planted, trained, monkeypatch):
  """Evaluated on train, whose flipped labels are mistakes: each picture shown is an overlay."""
  drawn = []
  original = explain.overlay
  monkeypatch.setattr(explain, 'overlay', lambda image, heatmap: drawn.append(heatmap) or original(image,
                                                                                                     heatmap))
  config = _config(planted[0])
  config.dataset.eval_split = 'train'
  results = eval_mode.evaluate_checkpoint(config, trained)
  wrong = round((1 - results['eval_accuracy']) * results['num_examples'])
  assert wrong >= 10 and len(drawn) == min(wrong, 25)
  assert all(h.shape == (32, 32) and h.max() == pytest.approx(1.0) for h in drawn)
  assert any(name.startswith('mistakes') for name in results['report_files'])
