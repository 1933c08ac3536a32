"""--mode=calibrate: temperature scaling, split-conformal prediction sets, calibration.json, and their use
by eval, predict and the report."""

import csv
import json
import logging
import math
import os

import numpy as np
import pytest
from PIL import Image

from configs import digits
from flaxtpu.loop import train
from flaxtpu.modes import calibrate as calibrate_mode
from flaxtpu.modes import eval as eval_mode
from flaxtpu.modes import predict as predict_mode
from flaxtpu.report import calibration, conformal
from flaxtpu.report import metrics as report_metrics
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import UserError
from flaxtpu.validation import config as config_lib

# --- the math, on generated data ------------------------------------------------------------------


def _generated(count, classes=10, seed=0):
  """Probabilities of a perfectly calibrated model and labels drawn from them; the spread of the
  Dirichlet makes some examples easy (one class dominant) and some hard (flat)."""
  rng = np.random.default_rng(seed)
  concentration = rng.choice([0.1, 1.0], count)[:, None] * np.ones(classes)
  probabilities = np.array([rng.dirichlet(alpha) for alpha in concentration])
  labels = np.array([rng.choice(classes, p=p) for p in probabilities])
  return probabilities, labels


def test_fit_temperature_recovers_the_temperature_that_made_the_labels():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (8_000, 10))
  probabilities = report_metrics.softmax(logits / 2.5)  # an overconfident model: true T = 2.5
  labels = (probabilities.cumsum(axis=1) > rng.random((len(logits), 1))).argmax(axis=1)
  fitted = calibration.fit_temperature(logits, labels)
  assert fitted == pytest.approx(2.5, rel=0.08)
  grid = np.exp(np.linspace(np.log(1), np.log(5), 100))  # the minimum of the NLL, by brute force
  best = grid[np.argmin([calibration.nll(logits, labels, t) for t in grid])]
  assert fitted == pytest.approx(best, rel=0.02)
  ece_before, _ = report_metrics.confidence_calibration(logits, labels)
  ece_after, _ = report_metrics.confidence_calibration(logits / fitted, labels)
  assert ece_after < 0.02 < 0.1 < ece_before


@pytest.mark.parametrize('score,randomize', [('aps', True), ('raps', True), ('aps', False)])
def test_prediction_sets_cover_held_out_data_at_the_target(score, randomize):
  """Split conformal: coverage >= 1 - alpha in expectation; randomised, also <= 1 - alpha + 1/(n+1).
  Checked on 4,000 held-out examples within a 3-sigma binomial margin; hard examples get larger sets."""
  probabilities, labels = _generated(6_000)
  n, coverage = 2_000, 0.9
  rule = conformal.SetRule(threshold=0.0, score=score, randomize=randomize, raps_lambda=0.01, raps_k=1,
                           seed=3)
  threshold = conformal.threshold(conformal.true_class_scores(probabilities[:n], labels[:n], rule), coverage)
  held_out = probabilities[n:], labels[n:]
  sets = conformal.prediction_sets(held_out[0], rule._replace(seed=4, threshold=threshold))
  summary = conformal.set_summary(sets, held_out[1])
  margin = 3 * math.sqrt(coverage * (1 - coverage) / len(held_out[1]))
  assert summary['set_coverage'] >= coverage - margin
  logits = np.log(np.maximum(held_out[0], 1e-300)) + 5.0  # the same sets from logits
  np.testing.assert_array_equal(conformal.prediction_sets(logits, rule._replace(seed=4, threshold=threshold),
                                                          logits=True), sets)
  if randomize:
    assert summary['set_coverage'] <= coverage + 1 / (n + 1) + margin
  sizes, wrong = sets.sum(axis=1), held_out[0].argmax(axis=1) != held_out[1]
  assert sizes[wrong].mean() > sizes[~wrong].mean() + 1  # harder images, larger sets
  assert 1 < summary['set_size'] < 10


def test_conformal_threshold_is_the_finite_sample_quantile():
  scores = np.arange(1, 11) / 10  # n = 10: ceil(11 x 0.8) / 10 = 0.9 -> the 9th smallest
  assert conformal.threshold(scores, 0.8) == 0.9
  assert conformal.threshold(scores, 0.95) == math.inf  # too few points for 95%: every class
  probabilities = np.array([[0.6, 0.3, 0.1]])
  aps = conformal.SetRule(threshold=0.9, randomize=False)
  assert conformal.prediction_sets(probabilities, aps).tolist() == [[True, True, False]]  # 0.6, 0.9 <= 0.9
  raps = aps._replace(score='raps', raps_lambda=0.2, raps_k=1)  # 0.6, 0.9 + 0.2 > 0.9
  assert conformal.prediction_sets(probabilities, raps).tolist() == [[True, False, False]]


# --- calibration.json, checked on read -------------------------------------------------------------

GOOD = {'temperature': 1.5, 'step': 10, 'weights': 'raw', 'tta': 'none', 'num_classes': 10,
        'coverage': 0.9, 'set_threshold': 0.95, 'set_score': 'aps', 'randomize': True, 'raps_lambda': 0.0,
        'raps_k': 1, 'seed': 0}


@pytest.mark.parametrize('key,value,message', [
    ('temperature', -1, '"temperature" is -1, not a positive finite number'),
    ('temperature', 'NaN', '"temperature" is "NaN", not a positive finite number'),
    ('step', 1.5, '"step" is 1.5, not a checkpoint step'),
    ('coverage', 1.2, '"coverage" is 1.2, not a number between 0 and 1'),
    ('set_score', 'lac', '"set_score" is "lac", not "aps" or "raps"'),
    ('seed', None, 'has no "seed"'),
])
def test_a_hand_edited_calibration_json_is_one_line_naming_the_file_and_key(tmp_path, key, value, message):
  record = dict(GOOD)
  if value is None:
    del record[key]
  else:
    record[key] = value
  path = tmp_path / 'calibration.json'
  path.write_text(json.dumps(record))
  with pytest.raises(UserError, match=f'{path}.*{message.replace("(", ".")}.*re-run --mode=calibrate') as e:
    calibration.read(str(path))
  assert '\n' not in str(e.value)
  path.write_text('{"temperature": 1.5,')  # cut off
  with pytest.raises(UserError, match='cannot be read as JSON'):
    calibration.read(str(path))
  path.write_text(json.dumps(GOOD))
  assert calibration.read(str(path))['temperature'] == 1.5


def test_calibration_split_is_checked_before_anything_is_read(caplog):
  config = digits.get_config()
  config.calibrate.split = 'train[:10%]'  # the run trained on all of train
  with pytest.raises(UserError, match=r"calibrate.split='train\[:10%\]' overlaps the training split 'train'"):
    calibrate_mode.calibration_split(config)
  config.calibrate.split = ''
  with caplog.at_level(logging.WARNING):
    assert calibrate_mode.calibration_split(config) == 'test'
  assert 'calibrating on the eval split' in caplog.text and 'optimistic' in caplog.text
  config.dataset.train_split, config.calibrate.split = 'train[:80%]', 'train[80%:]'
  assert calibrate_mode.calibration_split(config) == 'train[80%:]'
  config.calibrate.split = 'test+train[75%:]'  # 5% of train was trained on
  with pytest.raises(UserError, match='overlaps the training split'):
    calibrate_mode.calibration_split(config)
  config.task = 'multilabel'
  with pytest.raises(UserError, match='--mode=calibrate .* this run is task=multilabel'):
    calibrate_mode.calibrate(config, '/nonexistent')


# --- the modes, on a trained run -------------------------------------------------------------------


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """The small CNN on the embedded digits, trained briefly: about 90% accurate and overconfident."""
  config = digits.get_config()
  config.update_from_flattened_dict({'num_train_steps': 90, 'eval_every_steps': 90,
                                     'checkpoint_every_steps': 90, 'log_every_steps': 30,
                                     'compilation_cache_dir': 'none'})
  config_lib.validate(config)
  workdir = str(tmp_path_factory.mktemp('calibrated'))
  train.train_and_evaluate(config, workdir)
  return config, workdir


def _with(config, **overrides):
  return defaults.derived(config, {key.replace('__', '.'): value for key, value in overrides.items()})


def test_calibrate_then_eval_and_predict_use_the_temperature_and_sets(trained, tmp_path, caplog):
  config, workdir = trained
  held_out = _with(config, dataset__eval_split='test[50%:]', calibrate__split='test[:50%]')
  before = eval_mode.evaluate_checkpoint(held_out, workdir)
  assert 'eval_ece_uncalibrated' not in before and 'eval_set_size' not in before

  fitted = calibrate_mode.calibrate(held_out, workdir)
  with open(os.path.join(workdir, 'calibration.json')) as f:
    assert json.load(f) == pytest.approx(fitted)
  assert fitted['split'] == 'test[:50%]' and fitted['step'] == 90 and fitted['num_examples'] == 180
  assert fitted['nll_after'] < fitted['nll_before'] and fitted['temperature'] != 1.0
  assert calibration.read(os.path.join(workdir, 'calibration.json'))['set_score'] == 'aps'

  after = eval_mode.evaluate_checkpoint(held_out, workdir)
  assert after['eval_accuracy'] == before['eval_accuracy']  # argmax unchanged
  assert after['eval_ece_uncalibrated'] == pytest.approx(before['eval_ece'], abs=1e-6)
  assert after['temperature'] == fitted['temperature']
  assert after['eval_loss'] < before['eval_loss']  # the NLL, now of the calibrated probabilities
  assert 0.8 <= after['eval_set_coverage'] <= 1.0 and 1.0 <= after['eval_set_size'] < 3.0
  with open(os.path.join(workdir, 'eval.json')) as f:
    saved = json.load(f)
  assert {'eval_ece', 'eval_ece_uncalibrated', 'eval_set_coverage', 'eval_set_size'} <= set(saved)
  per_class = next(name for name in after['report_files'] if name.startswith('per_class'))
  with open(os.path.join(workdir, per_class), newline='') as f:
    rows = list(csv.DictReader(f))
  support = np.array([int(row['support']) for row in rows])
  sizes = np.array([float(row['set_size']) for row in rows])
  assert np.sum(sizes * support) / support.sum() == pytest.approx(after['eval_set_size'])
  assert 'set_sizes-test_50pct-.png' in after['report_files']
  page = open(os.path.join(workdir, 'report-test_50pct-.html'), encoding='utf-8').read()
  assert 'ECE before calibration' in page and 'prediction-set coverage' in page

  # predict: calibrated probabilities, and each image's set
  images = tmp_path / 'images'
  images.mkdir()
  from flaxtpu.data import loaders, pipeline
  dataset = pipeline.load(held_out, need_train=False)
  for index in range(6):
    Image.fromarray(loaders.eval_image(dataset, index).squeeze()).save(images / f'{index}.png')
  output = tmp_path / 'predictions.csv'
  rows = predict_mode.predict(_with(held_out, predict__input=str(images), predict__output_csv=str(output)),
                              workdir)
  with open(output, newline='') as f:
    saved_rows = list(csv.DictReader(f))
  assert [row['set'] for row in saved_rows] == [row['set'] for row in rows]
  names = set(dataset.class_names)
  assert all(set(filter(None, row['set'].split(';'))) <= names for row in rows)
  assert any(row['set'] for row in rows)

  # another step's calibration.json is not applied: one warning line, uncalibrated scores
  path = os.path.join(workdir, 'calibration.json')
  with open(path) as f:
    record = json.load(f)
  with open(path, 'w') as f:
    json.dump({**record, 'step': 45}, f)
  with caplog.at_level(logging.WARNING):
    stale = eval_mode.evaluate_checkpoint(held_out, workdir)
  assert 'was fitted on another model (step 45 (this model: 90))' in caplog.text
  assert 'eval_set_size' not in stale and stale['eval_ece'] == pytest.approx(before['eval_ece'], abs=1e-6)
  with open(path, 'w') as f:
    json.dump({**record, 'temperature': 0}, f)
  with pytest.raises(UserError, match='calibration.json: "temperature" is 0, not a positive finite number'):
    eval_mode.evaluate_checkpoint(held_out, workdir)
  with open(path, 'w') as f:
    json.dump(record, f)
