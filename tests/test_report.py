"""flaxtpu.report: per-class numbers, top-5 and ECE against hand computations; the files; curves; the CLI."""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flaxtpu.report import metrics, plots, writer
from flaxtpu.settings.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMES = ['cat', 'dog', 'frog']

# 8 examples, 3 classes, written as probabilities (logits = their logs, so softmax gives them back).
# No confidence sits on a 1/15 bin edge. Per example: label, probabilities -> prediction, ECE bin.
CASE = [
    (0, [0.90, 0.05, 0.05]),  # cat, 0.90 right, bin 13
    (0, [0.62, 0.30, 0.08]),  # cat, 0.62 right, bin 9
    (0, [0.20, 0.70, 0.10]),  # dog, 0.70 wrong, bin 10
    (1, [0.10, 0.82, 0.08]),  # dog, 0.82 right, bin 12
    (1, [0.05, 0.10, 0.85]),  # frog, 0.85 wrong, bin 12
    (1, [0.50, 0.40, 0.10]),  # cat, 0.50 wrong, bin 7
    (2, [0.02, 0.03, 0.95]),  # frog, 0.95 right, bin 14
    (2, [0.25, 0.33, 0.42]),  # frog, 0.42 right, bin 6
]
LABELS = np.array([label for label, _ in CASE])
LOGITS = np.log(np.array([probs for _, probs in CASE]))
# Singleton bins: |1 - 0.9| + |1 - 0.62| + |0 - 0.7| + |0 - 0.5| + |1 - 0.95| + |1 - 0.42| = 2.31, each 1/8;
# bin 12 holds 2 (accuracy 1/2, confidence 0.835): 2/8 * 0.335.
ECE = 2.31 / 8 + 2 / 8 * 0.335


def test_eval_report_matches_hand_computation():
  result = metrics.eval_report(LOGITS, LABELS, NAMES)
  np.testing.assert_array_equal(result['confusion'], [[2, 1, 0], [1, 1, 1], [0, 0, 2]])
  np.testing.assert_array_equal(result['support'], [3, 3, 2])
  np.testing.assert_array_equal(result['correct'], [2, 1, 2])
  np.testing.assert_array_equal(result['predicted'], [3, 2, 3])
  np.testing.assert_allclose(result['precision'], [2 / 3, 1 / 2, 2 / 3])
  np.testing.assert_allclose(result['recall'], [2 / 3, 1 / 3, 1.0])
  np.testing.assert_allclose(result['accuracy'], result['recall'])
  assert result['top1_accuracy'] == 5 / 8
  assert 'top5_accuracy' not in result  # 3 classes: top-5 would always be 100%.
  np.testing.assert_allclose(result['confidence'], [0.9, 0.62, 0.7, 0.82, 0.85, 0.5, 0.95, 0.42])
  assert result['ece'] == pytest.approx(ECE, abs=1e-9)
  bins = result['reliability']
  assert len(bins['count']) == 15 and bins['count'].sum() == 8
  np.testing.assert_array_equal(np.flatnonzero(bins['count']), [6, 7, 9, 10, 12, 13, 14])
  assert bins['count'][12] == 2
  assert bins['accuracy'][12] == 0.5 and bins['confidence'][12] == pytest.approx(0.835)
  assert np.isnan(bins['accuracy'][0])  # An empty bin has no accuracy (not 0).


def test_eval_report_is_stable_for_huge_logits():
  shifted = LOGITS.astype(np.float32) * 1 + np.float32(1e4) * np.arange(1, 9, dtype=np.float32)[:, None]
  result = metrics.eval_report(shifted, LABELS, NAMES)
  assert np.isfinite(result['confidence']).all()
  assert result['top1_accuracy'] == 5 / 8
  assert result['ece'] == pytest.approx(ECE, abs=5e-3)  # float32 at 1e4 keeps ~3 decimals.
  np.testing.assert_allclose(metrics.softmax(np.array([[1000.0, 1000.0, -1000.0]])), [[0.5, 0.5, 0.0]])


def test_top5_accuracy_with_seven_classes():
  ramp = np.arange(7, dtype=np.float32)  # Class 6 best, class 0 worst.
  logits = np.stack([ramp, ramp, ramp, ramp, np.zeros(7), np.zeros(7)])
  # Rank of the true class: 6 (out), 4 (in), 0 (in, top-1), 5 (out); all-tied rows rank in index order
  # like argmax: class 4 is 5th (in), class 5 is 6th (out).
  labels = np.array([0, 2, 6, 1, 4, 5])
  result = metrics.eval_report(logits, labels, [f'c{i}' for i in range(7)])
  assert result['top1_accuracy'] == 1 / 6
  assert result['top5_accuracy'] == 3 / 6
  brute_force = np.argsort(-logits, axis=1, kind='stable')[:, :5]
  assert result['top5_accuracy'] == np.mean([label in row for label, row in zip(labels, brute_force)])


def test_eval_report_rejects_mismatched_inputs():
  with pytest.raises(ValueError, match='class names'):
    metrics.eval_report(LOGITS, LABELS, NAMES[:2])
  with pytest.raises(ValueError, match='labels must be'):
    metrics.eval_report(LOGITS, LABELS[:5], NAMES)
  with pytest.raises(ValueError, match=r'\[0, 3\)'):
    metrics.eval_report(LOGITS, LABELS + 1, NAMES)


def _check_png(path, min_side=200):
  assert os.path.getsize(path) > 2000, path
  with Image.open(path) as image:
    assert image.format == 'PNG'
    assert min(image.size) >= min_side, image.size
    image.verify()


def test_write_eval_report_files(tmp_path):
  images = np.random.default_rng(0).integers(0, 256, (8, 8, 8, 3), dtype=np.uint8)
  summary = writer.write_eval_report(str(tmp_path), LOGITS, LABELS, NAMES, images=images)
  assert summary['eval_ece'] == pytest.approx(ECE)
  assert 'eval_top5_accuracy' not in summary
  assert summary['report_files'] == ['per_class.csv', 'confusion.png', 'mistakes.png', 'reliability.png',
                                     'report.html']
  assert sorted(os.listdir(tmp_path)) == sorted(summary['report_files'])  # No temporary files left behind.
  json.dumps(summary)  # Goes into eval.json as is.
  with open(tmp_path / 'per_class.csv', newline='') as f:
    rows = list(csv.DictReader(f))
  assert [row['class'] for row in rows] == NAMES
  cat, dog, frog = rows
  assert (cat['support'], cat['correct'], cat['most_confused_with'], cat['most_confused_count']) == (
      '3', '2', 'dog', '1')
  assert float(cat['precision']) == pytest.approx(2 / 3) and float(cat['recall']) == pytest.approx(2 / 3)
  assert float(dog['precision']) == 0.5 and float(dog['recall']) == pytest.approx(1 / 3)
  assert dog['accuracy'] == dog['recall']
  assert (dog['most_confused_with'], dog['most_confused_count']) == ('cat', '1')  # Tie: lower index.
  assert (frog['most_confused_with'], frog['most_confused_count'], frog['recall']) == ('', '0', '1.0')
  for name in ('confusion.png', 'mistakes.png', 'reliability.png'):
    _check_png(tmp_path / name)


def test_class_names_with_dollar_signs_are_drawn_as_written(tmp_path, monkeypatch):
  # Folder names are class names; with two '$' matplotlib read '$^$' as TeX math and failed to parse it
  # (the run ended without its report), and drew '$5 - $10' as the italic formula '5 - 10'.
  import matplotlib
  names = ['$^$', '$5 - $10', 'frog']
  drawn = []
  save_figure = plots._save_figure

  def save_and_record(figure, path):
    figure.canvas.draw()
    drawn.extend((text.get_text(), text.get_parse_math()) for axes in figure.axes
                 for text in axes.get_xticklabels() + axes.get_yticklabels() if text.get_text())
    save_figure(figure, path)

  monkeypatch.setattr(plots, '_save_figure', save_and_record)
  summary = writer.write_eval_report(str(tmp_path), LOGITS, LABELS, names)
  assert summary['report_files'] == ['per_class.csv', 'confusion.png', 'reliability.png', 'report.html']
  assert ('$^$', False) in drawn and ('$5 - $10', False) in drawn
  assert not any(parse_math for _, parse_math in drawn)
  assert matplotlib.rcParams['text.parse_math']  # The caller's own setting is left as it was.
  with open(tmp_path / 'per_class.csv', newline='') as f:
    assert [row['class'] for row in csv.DictReader(f)] == names
  _check_png(tmp_path / 'confusion.png')


def test_write_eval_report_grayscale_callable_images_and_suffix(tmp_path):
  gray = np.random.default_rng(0).integers(0, 256, (8, 6, 6, 1), dtype=np.uint8)
  seen = []
  summary = writer.write_eval_report(str(tmp_path), LOGITS, LABELS, NAMES,
                                     images=lambda i: seen.append(i) or gray[i], suffix='_ema')
  assert summary['report_files'] == ['per_class_ema.csv', 'confusion_ema.png', 'mistakes_ema.png',
                                     'reliability_ema.png', 'report_ema.html']
  assert seen == [4, 2, 5]  # The 3 mistakes, most confident first (0.85, 0.70, 0.50).
  _check_png(tmp_path / 'mistakes_ema.png', min_side=100)
  no_images = writer.write_eval_report(str(tmp_path / 'plain'), LOGITS, LABELS, NAMES)
  assert 'mistakes.png' not in no_images['report_files']
  assert not (tmp_path / 'plain' / 'mistakes.png').exists()


def test_a_new_picture_is_a_function_and_one_line_in_the_list(tmp_path, monkeypatch):
  drawn = []

  def plot_accuracy(path, report):
    drawn.append((os.path.basename(path), report['top1_accuracy'], list(report['support'])))
    with open(path, 'wb') as f:
      f.write(b'not a real png')

  picture = plots.Picture('accuracy', ('classification',), plot_accuracy)
  monkeypatch.setattr(plots, 'PICTURES', [*plots.PICTURES, picture])
  summary = writer.write_eval_report(str(tmp_path), LOGITS, LABELS, NAMES, suffix='_raw')
  assert summary['report_files'] == ['per_class_raw.csv', 'confusion_raw.png', 'reliability_raw.png',
                                     'accuracy_raw.png', 'report_raw.html']
  assert 'accuracy_raw.png' in (tmp_path / 'report_raw.html').read_text()  # the page shows it too
  assert drawn == [('accuracy_raw.png', 5 / 8, [3, 3, 2])]  # 3 mistakes of 8; 3 cats, 3 dogs, 2 frogs
  assert sorted(os.listdir(tmp_path)) == sorted(summary['report_files'])
  tags = np.array([[1, 0, 0], [0, 1, 1]])
  multilabel = writer.write_eval_report(str(tmp_path / 'tags'), LOGITS[:2], tags, NAMES)
  assert multilabel['report_files'] == ['per_class.csv', 'confusion.png', 'reliability.png',
                                        'thresholds.json', 'report.html']
  assert len(drawn) == 1  # a picture of the classification task only


def test_thousand_classes_stay_readable_and_fast(tmp_path):
  rng = np.random.default_rng(0)
  num_classes, num_examples = 1000, 5000
  labels = rng.integers(0, num_classes, num_examples)
  logits = rng.normal(size=(num_examples, num_classes)).astype(np.float32)
  logits[np.arange(num_examples), labels] += 3.0  # A decent model: most examples right.
  wrong = np.flatnonzero(rng.random(num_examples) < 0.05)
  logits[wrong, (labels[wrong] + 1) % num_classes] += 10.0  # One confusion dominates: class c -> c + 1.
  names = [f'n{i:08d} a long imagenet class name {i}' for i in range(num_classes)]
  start = time.perf_counter()
  summary = writer.write_eval_report(str(tmp_path), logits, labels, names)
  elapsed = time.perf_counter() - start
  assert elapsed < 15, f'{elapsed:.1f} s'  # ~2 s alone; generous for a shared machine.
  assert 0 < summary['eval_top5_accuracy'] <= 1
  with open(tmp_path / 'per_class.csv', newline='') as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == num_classes
  assert sum(int(row['support']) for row in rows) == num_examples
  _check_png(tmp_path / 'confusion.png', min_side=500)
  with Image.open(tmp_path / 'confusion.png') as image:
    assert max(image.size) <= 2500  # A picture, not a 1000 x 1000 grid.
  pairs = metrics.top_confusions(np.array([[5, 0, 3], [1, 4, 3], [0, 7, 2]]), 3)
  assert pairs == [(2, 1, 7), (0, 2, 3), (1, 2, 3)]


METRICS = [
    {'step': 10, 'train_loss': 2.1, 'train_accuracy': 0.2, 'learning_rate': 0.01, 'images_per_sec': 900.0},
    {'step': 20, 'train_loss': 1.7, 'train_accuracy': 0.4, 'learning_rate': 0.02, 'images_per_sec': 1000.0},
    {'step': 20, 'eval_loss': 1.8, 'eval_accuracy': 0.35, 'eval_top5_accuracy': 0.8,
     'eval_accuracy_ema': 0.3},
    {'step': 30, 'train_loss': float('nan'), 'train_accuracy': 0.5, 'learning_rate': 0.015},
]


def _write_metrics(workdir, rows, tail=''):
  workdir.mkdir(exist_ok=True)
  with open(workdir / 'metrics.jsonl', 'w') as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
    f.write(tail)


def test_write_curves_live_run_with_truncated_line(tmp_path):
  _write_metrics(tmp_path, METRICS, tail='{"step": 40, "train_lo')
  path = plots.write_curves(str(tmp_path))
  assert path == str(tmp_path / 'curves.png')
  _check_png(path)
  assert sorted(os.listdir(tmp_path)) == ['curves.png', 'metrics.jsonl']
  keys = sorted({key for row in METRICS for key in row} - {'step'})
  assert plots._curve_panels(keys) == [
      ('loss', ['train_loss', 'eval_loss']),
      ('accuracy', ['train_accuracy', 'eval_accuracy', 'eval_accuracy_ema', 'eval_top5_accuracy']),
      ('learning rate', ['learning_rate']),
      ('images / s', ['images_per_sec']),
  ]


def test_write_curves_bad_workdirs(tmp_path):
  with pytest.raises(UserError, match='no such run directory'):
    plots.write_curves(str(tmp_path / 'missing'))
  with pytest.raises(UserError, match='metrics.jsonl not found'):
    plots.write_curves(str(tmp_path))
  _write_metrics(tmp_path, [], tail='{"step": 1, "tra')
  with pytest.raises(UserError, match='no loss, accuracy or learning-rate values yet'):
    plots.write_curves(str(tmp_path))
  assert not (tmp_path / 'curves.png').exists()


def _cli(*args):
  return subprocess.run([sys.executable, '-m', 'flaxtpu.report', *args], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=60)


def test_cli(tmp_path):
  missing = _cli(str(tmp_path / 'nope'))
  assert missing.returncode == 2
  assert missing.stdout == ''
  assert missing.stderr.startswith('error: ') and len(missing.stderr.strip().splitlines()) == 1
  _write_metrics(tmp_path / 'run', METRICS[:2])
  # The CLI plots without starting JAX: check from the same kind of process.
  done = subprocess.run(
      [sys.executable, '-c', 'import sys; from flaxtpu.report.__main__ import main; '
       'code = main(sys.argv[1:]); '
       'assert "jax" not in sys.modules, "jax imported"; sys.exit(code)', str(tmp_path / 'run')],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == str(tmp_path / 'run' / 'curves.png')
  _check_png(tmp_path / 'run' / 'curves.png')
