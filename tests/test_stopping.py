"""Early stopping and the plateau schedule: when they act, what they write, and exact resumes."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import digits
from conftest import ROOT, assert_same_state, metric_rows, restore_checkpoint, signal_at_step
from flaxtpu.loop import train
from flaxtpu.optimizers.plateau import Plateau
from flaxtpu.settings import defaults
from flaxtpu.validation import config as config_lib

# Every 4 steps an evaluation; eval_loss never improves by min_delta=1, so with patience 3 the run
# stops at the 4th evaluation (step 16), its best the first (step 4).
STOPPING = {'early_stopping.metric': 'eval_loss', 'early_stopping.min_delta': 1.0,
            'early_stopping.patience': 3}
# eval_accuracy falls at step 8 with this rate: patience 1 drops the rate there, x0.1.
PLATEAU = {'schedule.name': 'plateau', 'schedule.plateau_patience': 1,
           'schedule.plateau_metric': 'eval_accuracy', 'optimizer.learning_rate': 0.03, 'num_train_steps': 24}


def _config(**overrides):
  config = digits.get_config()  # the small CNN on the embedded 8x8 digits
  config.num_train_steps = 40
  config.eval_every_steps = 4
  config.checkpoint_every_steps = 8
  config.log_every_steps = 4
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


def _flags(overrides):
  return [f'--config.{key}={value}' for key, value in overrides.items()]


def test_plateau_scale_drops_by_the_factor_after_patience_evaluations():
  config = defaults.get_config()
  config.update_from_flattened_dict({'schedule.name': 'plateau', 'schedule.plateau_patience': 2,
                                     'schedule.final_lr_fraction': 0.005})
  plateau = Plateau(config)  # eval_loss, minimised
  state, scales = plateau.initial(), []
  for loss in (1.0, 0.9, 0.95, 0.9, 0.8, 0.85, 0.85, 0.85, 0.85, 0.85, 0.85):
    state = plateau.update(json.loads(json.dumps(state)), {'eval_loss': loss})  # as Progress keeps it
    scales.append(round(state['scale'], 6))
  assert scales == [1, 1, 1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.005, 0.005, 0.005]  # floored at final_lr_fraction
  config.schedule.plateau_metric = 'eval_accuracy'  # maximised
  plateau = Plateau(config)
  state = plateau.initial()
  for accuracy in (0.5, 0.6, 0.6, 0.59):
    state = plateau.update(state, {'eval_accuracy': accuracy})
  assert round(state['scale'], 6) == 0.1 and state['best_value'] == pytest.approx(-0.6)


@pytest.mark.parametrize('overrides, fragment', [
    ({'schedule.plateau_patience': 3}, "has no effect on schedule.name='constant'"),
    ({'schedule.name': 'plateau', 'schedule.plateau_metric': 'accuracy'}, 'not an eval metric'),
    ({'schedule.name': 'plateau', 'schedule.factor': 2.0}, 'factor=2.0 < 1'),
    ({'early_stopping.metric': 'loss'}, 'early_stopping.metric'),
    ({'early_stopping.metric': 'auto', 'checkpoint.best_metric': ''}, 'name the metric'),
    ({'early_stopping.mode': 'up'}, 'early_stopping.mode'),
    ({'early_stopping.patience': 0}, 'early_stopping.patience'),
])
def test_config_refuses_bad_stopping_and_plateau_keys(overrides, fragment):
  config = defaults.get_config()
  config.update_from_flattened_dict(overrides)
  with pytest.raises(config_lib.ConfigError, match=fragment.replace('(', r'\(')):
    config_lib.validate(config)


@pytest.fixture(scope='module')
def stopped_early(tmp_path_factory):
  """The CLI's run that stops early, uninterrupted (8 CPU devices, as the in-process runs)."""
  workdir = str(tmp_path_factory.mktemp('stopped_early'))
  process = subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py', f'--workdir={workdir}',
       *_flags({'num_train_steps': 40, 'eval_every_steps': 4, 'checkpoint_every_steps': 8,
                'log_every_steps': 4, 'compilation_cache_dir': 'none'}),
       *_flags(STOPPING)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  return workdir, process


def test_early_stopping_saves_writes_results_says_why_and_exits_0(stopped_early):
  workdir, process = stopped_early
  assert process.returncode == 0, process.stderr[-3000:]
  with open(os.path.join(workdir, 'results.json')) as f:
    results = json.load(f)
  assert results['step'] == 16
  assert {k: v for k, v in results['stopped_early'].items() if k not in ('best', 'value')} == {
      'step': 16, 'metric': 'eval_loss', 'best_step': 4, 'patience': 3}
  assert os.path.exists(os.path.join(workdir, 'checkpoints', '16'))
  assert os.path.exists(os.path.join(workdir, 'per_class.csv'))
  line = next(line for line in process.stderr.splitlines() if 'stopped early' in line)
  assert 'at step 16: eval_loss has not improved' in line and 'at step 4, for 3 evaluations' in line
  assert 'the best checkpoint by eval_accuracy is step' in line
  assert 'checkpoint.best_metric=eval_accuracy is not early_stopping.metric=eval_loss' in line


def test_early_stopping_resumed_stops_where_an_uninterrupted_run_does(stopped_early, tmp_path, monkeypatch):
  reference_dir, _ = stopped_early
  with open(os.path.join(reference_dir, 'results.json')) as f:
    reference = json.load(f)
  workdir = str(tmp_path)
  # The prefetcher runs ahead of the loop by a few steps: the stop lands after 2 evaluations without
  # improvement (steps 8, 12) and before the third.
  signal_at_step(monkeypatch, 16)
  stopped = train.train_and_evaluate(_config(**STOPPING), workdir)
  assert 12 <= stopped['stopped_at_step'] < 16
  monkeypatch.undo()
  results = train.train_and_evaluate(_config(**STOPPING), workdir)
  assert results['stopped_early'] == reference['stopped_early']  # 1 more evaluation, not 3
  for key in ('step', 'eval_accuracy', 'eval_loss', 'train_loss'):
    assert results[key] == reference[key]
  assert_same_state(restore_checkpoint(workdir, 16), restore_checkpoint(reference_dir, 16))
  assert metric_rows(workdir) == metric_rows(reference_dir)
  again = train.train_and_evaluate(_config(**STOPPING), workdir)  # a finished run: nothing to train
  assert again['stopped_early'] == reference['stopped_early']
  assert sorted(map(int, filter(str.isdigit, os.listdir(os.path.join(workdir, 'checkpoints')))))[-1] == 16


def test_plateau_under_pmap_drops_the_rate_as_under_jit(tmp_path):
  jit_dir, pmap_dir = str(tmp_path / 'jit'), str(tmp_path / 'pmap')
  train.train_and_evaluate(_config(**PLATEAU), jit_dir)
  train.train_and_evaluate(_config(parallelism='pmap', **PLATEAU), pmap_dir)
  rates = lambda workdir: [row['learning_rate'] for row in metric_rows(workdir) if 'learning_rate' in row]
  assert rates(pmap_dir) == rates(jit_dir) and rates(jit_dir)[-1] == pytest.approx(0.003)
  # The scale lives in the (replicated) optimizer state and is saved with it.
  scale = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(restore_checkpoint(pmap_dir, 24))
           if 'plateau_scale' in jax.tree_util.keystr(path)]
  assert len(scale) == 1 and float(np.asarray(scale[0]).reshape(-1)[0]) == pytest.approx(0.1)


def test_plateau_resumed_continues_with_the_same_scale(tmp_path, monkeypatch):
  reference_dir, workdir = str(tmp_path / 'uninterrupted'), str(tmp_path / 'resumed')
  reference = train.train_and_evaluate(_config(**PLATEAU), reference_dir)
  rates = [row['learning_rate'] for row in metric_rows(reference_dir) if 'learning_rate' in row]
  assert rates[:2] == [0.03, 0.03] and rates[2:] == [pytest.approx(0.003)] * (len(rates) - 2)
  signal_at_step(monkeypatch, 14)  # after the drop at step 8: the scale must survive the resume
  assert 8 < train.train_and_evaluate(_config(**PLATEAU), workdir)['stopped_at_step'] < 14
  monkeypatch.undo()
  results = train.train_and_evaluate(_config(**PLATEAU), workdir)
  assert_same_state(restore_checkpoint(workdir, 24), restore_checkpoint(reference_dir, 24))
  assert metric_rows(workdir) == metric_rows(reference_dir)
  for key in ('step', 'eval_accuracy', 'eval_loss', 'train_loss'):
    assert results[key] == reference[key]
