"""--mode=audit on a generated folder with planted problems (issue 40 part 4): recall and precision per
kind; and, from the same small trained run, --mode=predict's explanations and the eval report's overlays."""

import json
import logging
import os
import shutil

import numpy as np
import pytest
from PIL import Image
from planted import make_planted_folder, score

from configs import cifar10
from flaxtpu import audit, explain, train
from flaxtpu.errors import UserError
from flaxtpu.modes import audit as audit_mode
from flaxtpu.modes import eval as eval_mode
from flaxtpu.modes import predict


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


@pytest.fixture(scope='module')
def planted(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('planted'))
  return root, make_planted_folder(root)


@pytest.fixture(scope='module')
def trained(planted, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('run'))
  train.train_and_evaluate(_config(planted[0]), workdir)
  return workdir


def test_audit_finds_every_planted_copy_and_broken_file(planted, tmp_path, caplog):
  root, truth = planted
  with caplog.at_level(logging.INFO):
    audit_mode.run_audit(_config(root), str(tmp_path))
  with open(tmp_path / 'audit.json') as f:
    report = json.load(f)
  assert list(report) == sorted(audit_mode.SCHEMA)  # exactly the keys
  rates = score(report, truth)
  print(json.dumps(rates))
  for kind in ('exact_duplicates', 'near_duplicates', 'leaks', 'unreadable'):
    assert rates[kind]['recall'] == 1.0 and rates[kind]['precision'] == 1.0, (kind, rates[kind])
  # No trained run: no suspects, and the log says why.
  assert report['suspected_mislabels'] == []
  assert 'suspected mislabels: 0 (no trained run in' in caplog.text
  assert report['class_counts']['test'] == {'red': 15, 'green': 15, 'blue': 15}
  assert sum(report['class_counts']['train'].values()) == 120 + 6 + 6 + 3 + 3 + 12  # unreadable left out
  assert (tmp_path / 'audit.png').stat().st_size > 10_000


def test_audit_with_a_trained_run_ranks_the_flipped_labels_first(planted, trained):
  root, truth = planted
  report = audit_mode.run_audit(_config(root), trained)
  rates = score(report, truth)['suspected_mislabels']
  print(json.dumps(rates))
  assert rates['recall'] >= 0.9 and rates['precision'] >= 0.8, rates
  scores = [row['score'] for row in report['suspected_mislabels']]
  assert scores == sorted(scores, reverse=True)
  top = report['suspected_mislabels'][0]
  assert top['path'] in truth['flipped'] and top['label'] != top['predicted']


def test_audit_refuses_sources_of_no_image_files(tmp_path):
  config = _config('')
  config.dataset.name = 'mnist'
  with pytest.raises(UserError, match=r'--mode=audit reads image files .* not a TFDS dataset'):
    audit_mode.run_audit(config, str(tmp_path))


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
