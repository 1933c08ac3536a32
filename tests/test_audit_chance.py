"""--mode=audit says when it cannot tell (issue 70, the audit): fold models that learnt nothing list no
suspects and audit.json says why, with each fold model's held-out accuracy beside chance; no audit lists
most of a dataset; the fold runs train the trained run's own recipe and are at least as long as it."""

import json
import logging
import os

import numpy as np
import pytest
from PIL import Image
from planted import compilation_cache_in

from configs import digits
from flaxtpu.data import audit
from flaxtpu.data.spec import saved_config
from flaxtpu.modes import audit as audit_mode
from flaxtpu.modes import audit_folds


@pytest.fixture(scope='module', autouse=True)
def compilation_cache(tmp_path_factory):
  """The CLI's persistent compilation cache (flaxtpu/main.py): the second fold run reads the programs the
  first compiled, as `--mode=audit` does from the command line."""
  with compilation_cache_in(str(tmp_path_factory.mktemp('jax_cache'))):
    yield


def _random_label_digits(root: str, count: int, seed: int = 0) -> None:
  """root/train/<digit>/*.png: `count` embedded 8x8 digits, each filed under a digit drawn at random
  (nothing about an image tells its label)."""
  from flaxtpu.data.sources.embedded import embedded_arrays  # pylint: disable=g-import-not-at-top
  images, _, _ = embedded_arrays('digits', 'train')
  rng = np.random.default_rng(seed)
  for i, index in enumerate(rng.permutation(len(images))[:count]):
    folder = os.path.join(root, 'train', str(int(rng.integers(10))))
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(np.asarray(images[index]).squeeze()).save(os.path.join(folder, f'{i:04d}.png'))


def _digits_config(root: str, **overrides):
  config = digits.get_config()
  config.dataset.name, config.dataset.folder = '', root
  config.dataset.train_split = config.dataset.eval_split = 'train'
  config.compilation_cache_dir = 'none'
  config.log_every_steps = 1000
  config.update_from_flattened_dict(overrides)
  return config


def test_chance_fold_accuracies_and_the_verdicts_rule():
  labels = np.array([0] * 6 + [1] * 2 + [2] * 2)
  assert audit.chance(labels, 4) == {'chance': 0.6, 'uniform_chance': 0.25, 'majority_share': 0.6}
  assert audit.chance(np.arange(10) % 10, 10)['chance'] == 0.1
  probabilities = np.eye(3)[[0, 0, 0, 0, 0, 0, 1, 2, 2, 1]]  # fold 0: 5 of 5 right, fold 1: 3 of 5
  assert audit.fold_accuracies(labels, probabilities, np.arange(10) // 5) == [1.0, 0.6]
  # 1.5 x chance, at most halfway from chance to 1.
  assert audit.learnt_threshold(0.1) == pytest.approx(0.15)
  assert audit.learnt_threshold(1 / 3) == pytest.approx(0.5)
  assert audit.learnt_threshold(0.8) == pytest.approx(0.9)
  assert audit.verdict([0.9, 0.95], 0.1, 10, 100, 'x') == ('listed', '')
  outcome, line = audit.verdict([0.12, 0.14], 0.1, 3, 100, 'train longer')
  assert outcome == 'near_chance' and '0.130 is near chance 0.100 (under 0.150' in line
  assert line.endswith('; train longer') and '\n' not in line
  outcome, line = audit.verdict([0.5, 0.5], 0.1, 26, 100, 'train longer')
  assert outcome == 'too_many' and 'flags 26 of 100 images (26% > 25%)' in line and 'refused' in line
  assert audit.verdict([0.5, 0.5], 0.1, 25, 100, 'x')[0] == 'listed'  # a quarter exactly is listed


def test_fold_models_that_learn_nothing_list_no_suspects_and_say_so(tmp_path, caplog):
  """300 digits under random labels, 2 fold runs of 10 steps: no fold model can beat chance, so confident
  learning's verdict would be noise (it flags most of them anyway: `withheld`). Measured (5 folds of 20
  steps): fold accuracies 0.098-0.117 (mean 0.103), chance 0.14 (majority class; 1/10 = 0.1), 172 withheld."""
  root = str(tmp_path / 'data')
  _random_label_digits(root, 300)
  config = _digits_config(root, num_epochs=0.0, num_train_steps=10,
                          **{'audit.folds': 2, 'audit.min_epochs': 0})  # fold runs of 10 steps exactly
  workdir = str(tmp_path / 'audit')
  with caplog.at_level(logging.INFO):
    audit_mode.run_audit(config, workdir)
  with open(os.path.join(workdir, 'audit.json')) as f:
    report = json.load(f)
  search = report['mislabel_search']
  print(json.dumps({key: search[key] for key in ('fold_accuracies', 'held_out_accuracy', 'chance',
                                                 'uniform_chance', 'majority_share', 'withheld')}))
  assert report['suspected_mislabels'] == []
  assert search['verdict'] == 'near_chance'
  assert len(search['fold_accuracies']) == 2 and all(0 <= a <= 1 for a in search['fold_accuracies'])
  assert search['uniform_chance'] == 0.1 and 0.1 <= search['chance'] == search['majority_share'] < 0.2
  assert search['held_out_accuracy'] < 1.5 * search['chance']
  assert search['steps'] == 10 and search['recipe'].startswith('the given config')
  assert search['run_eval_accuracy'] is None
  assert 'audit.steps_fraction' in search['note'] and 'num_epochs' in search['note']
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and 'no suspected mislabels listed' in r.getMessage()]
  assert len(warnings) == 1 and 'near chance' in warnings[0]
  assert "fold models' held-out accuracy: " in caplog.text and 'no trained run' in caplog.text


def test_an_audit_that_would_flag_most_images_refuses(tmp_path, monkeypatch, caplog):
  """Fold models right on 40% of 10 balanced classes (above 1.5 x chance) and confidently wrong on the
  rest: confident learning would flag most images; none are listed, and one line says why."""
  root = str(tmp_path / 'data')
  _random_label_digits(root, 200)
  rng = np.random.default_rng(0)

  def out_of_fold(config, workdir, pool, class_names, channels, method, backbone, run_steps=0):
    labels = pool.labels
    wrong = (labels + rng.integers(1, 10, len(labels))) % 10
    predicted = np.where(rng.random(len(labels)) < 0.4, labels, wrong)
    probabilities = np.full((len(labels), 10), 0.02, np.float32)
    probabilities[np.arange(len(labels)), predicted] = 0.82
    return audit_folds.OutOfFold(np.arange(len(labels)), probabilities, {'folds': 5, 'steps': 7},
                                 np.arange(len(labels)) % 5)

  monkeypatch.setattr(audit_folds, 'out_of_fold', out_of_fold)
  with caplog.at_level(logging.INFO):
    report = audit_mode.run_audit(_digits_config(root), str(tmp_path / 'audit'))
  search = report['mislabel_search']
  print(json.dumps({key: search[key] for key in ('held_out_accuracy', 'chance', 'withheld', 'verdict')}))
  assert report['suspected_mislabels'] == [] and search['verdict'] == 'too_many'
  assert search['withheld'] > 100 and search['held_out_accuracy'] > 1.5 * search['chance']
  assert f'flags {search["withheld"]} of 200 images' in search['note']
  assert caplog.text.count('no suspected mislabels listed') == 2  # the warning, and the summary's line


def test_the_fold_runs_train_the_trained_runs_recipe_at_its_length(tmp_path, monkeypatch, caplog):
  """A workdir holding a run (config.json, results.json): the fold runs take its recipe (its 120 steps,
  its learning rate), not the given config's, and audit.json carries its eval accuracy. The fold runs'
  config is caught before training."""
  root = str(tmp_path / 'data')
  _random_label_digits(root, 100)
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  trained = _digits_config(root, num_epochs=0.0, num_train_steps=120, **{'optimizer.learning_rate': 1e-3})
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(saved_config(trained, 1), f)
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump({'step': 120, 'eval_accuracy': 0.874}, f)
  caught = {}

  def train_folds(fold_config, *args):
    caught['config'] = fold_config
    raise RuntimeError('caught')

  monkeypatch.setattr(audit_folds, '_train_folds', train_folds)
  given = _digits_config(root, **{'audit.steps_fraction': 0.5})  # the recipe's 20 epochs, without the run's
  with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match='caught'):
    audit_mode.run_audit(given, workdir)
  fold = caught['config']
  assert fold.num_train_steps == 60 and fold.optimizer.learning_rate == 1e-3  # 0.5 x the run's 120
  assert fold.audit.steps_fraction == 0.5  # the audit's own settings stay the given config's
  assert 'train the recipe of the run in' in caplog.text
  assert 'optimizer.learning_rate: 0.003 -> 0.001' in caplog.text
  assert 'num_train_steps: -1 -> 120' in caplog.text
  # Its eval accuracy beside the fold models' (scoring faked: the fold runs are not what is tested here).
  monkeypatch.setattr(audit_folds, 'out_of_fold', lambda config, workdir, pool, *args: audit_folds.OutOfFold(
      np.arange(len(pool.labels)), np.eye(10, dtype=np.float32)[pool.labels], {'folds': 5},
      np.arange(len(pool.labels)) % 5))
  report = audit_mode.run_audit(given, workdir)
  search = report['mislabel_search']
  assert search['run_eval_accuracy'] == 0.874 and search['fold_accuracies'] == [1.0] * 5
  assert search['recipe'] == f'the run in {workdir} ({os.path.join(workdir, "config.json")})'


def test_a_fold_run_is_at_least_as_long_as_the_run():
  """At the default audit.steps_fraction=1: num_train_steps as set; num_epochs over the run's train split
  when that is longer than its epochs over the fold's K - 1 folds, and the epoch-set schedule points
  move with it; never under audit.min_epochs (10) epochs over the fold's images."""
  config = _digits_config('', num_epochs=20.0, **{'schedule.warmup_epochs': 2.0})
  assert config.audit.steps_fraction == 1.0
  assert audit_folds.fold_steps(config, 800) == 500  # 20 epochs of 25 steps over 800 images
  assert audit_folds.fold_steps(config, 800, run_steps=625) == 625  # the run's 20 epochs over 1,000
  folds = np.arange(1000) % 5
  fold = audit_folds._fold_config(config, 1000, folds, run_steps=625)  # pylint: disable=protected-access
  assert fold.num_train_steps == 625 and fold.schedule.warmup_epochs == pytest.approx(2.5)
  steps = _digits_config('', num_epochs=0.0, num_train_steps=300)
  assert audit_folds.fold_steps(steps, 800, run_steps=300) == 300
  steps.audit.steps_fraction = 0.5
  assert audit_folds._fold_config(steps, 1000, folds, 300).num_train_steps == 250  # pylint: disable=protected-access
  # ... where 250 steps are audit.min_epochs=10 epochs of 25 over the fold's 800 images; 0 lifts that floor.
  steps.audit.min_epochs = 0.0
  assert audit_folds._fold_config(steps, 1000, folds, 300).num_train_steps == 150  # pylint: disable=protected-access
  short = _digits_config('', num_epochs=3.0)  # a short recipe: 10 epochs over the fold's images
  assert audit_folds.fold_steps(short, 800, run_steps=94) == 250
