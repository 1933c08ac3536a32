"""Issue 41 in whole runs: new optimizer states resume bit for bit, float16 skips overflows and still stops
on a real divergence, time_budget plans and keeps its length, --mode=lr_find leaves a run untouched."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import assert_same_state, metric_rows, restore_checkpoint, signal_at_step, tree_digest
from flaxtpu.loop import budget_probe, train
from flaxtpu.loop.divergence import TrainingDiverged
from flaxtpu.modes import lr_find
from flaxtpu.optimizers import loss_scale, optim
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import printable
from flaxtpu.validation import config as config_lib


def _config(folder, **overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({
      'dataset.folder': folder, 'model.name': 'cnn', 'batch_size': 16, 'num_train_steps': 12,
      'log_every_steps': 4, 'eval_every_steps': 6, 'checkpoint_every_steps': 3,
      'compilation_cache_dir': 'none',
      'schedule.name': 'constant', **overrides})
  config_lib.validate(config)
  return config


# Every new optimizer state: muon's (its AdamW inside), schedule-free's z with SAM and float16's loss scale
# (started high, so the first steps overflow and are skipped), under accumulation.
STATES = {
    'muon': {'optimizer.name': 'muon', 'optimizer.learning_rate': 0.02, 'optimizer.momentum': 0.95},
    'schedule_free_sam_float16': {'optimizer.name': 'schedule_free_adamw', 'optimizer.learning_rate': 0.003,
                                  'optimizer.sam_rho': 0.05, 'dtype': 'float16',
                                  'optimizer.accumulate_steps': 2},
}


@pytest.fixture(scope='module',
                params=[pytest.param('muon', marks=pytest.mark.slow), 'schedule_free_sam_float16'])
def uninterrupted(request, image_folder, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp(request.param))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(loss_scale, 'INITIAL_SCALE', 2.0 ** 19)  # 3-4 steps overflow before the scale fits
    results = train.train_and_evaluate(_config(image_folder, **STATES[request.param]), workdir)
  return request.param, workdir, results


def test_new_optimizer_states_resume_bit_for_bit(uninterrupted, image_folder, tmp_path, monkeypatch):
  name, reference_dir, reference = uninterrupted
  monkeypatch.setattr(loss_scale, 'INITIAL_SCALE', 2.0 ** 19)
  signal_at_step(monkeypatch, 5)
  stopped = train.train_and_evaluate(_config(image_folder, **STATES[name]), str(tmp_path))
  assert stopped['stopped_at_step'] < 12
  monkeypatch.undo()
  monkeypatch.setattr(loss_scale, 'INITIAL_SCALE', 2.0 ** 19)
  results = train.train_and_evaluate(_config(image_folder, **STATES[name]), str(tmp_path))
  assert_same_state(restore_checkpoint(str(tmp_path), 12), restore_checkpoint(reference_dir, 12))
  assert metric_rows(str(tmp_path)) == metric_rows(reference_dir)
  assert results['eval_accuracy'] == reference['eval_accuracy']
  if 'float16' in name:  # the loss scale is in the checkpoint, and the first window skipped steps
    rows = [row for row in metric_rows(reference_dir) if 'train_loss' in row]
    assert rows[0]['train_skipped_steps'] >= 1 and rows[0]['train_loss'] > 0
    assert rows[-1]['train_skipped_steps'] == 0 and rows[-1]['train_loss_scale'] < 2.0 ** 19
    saved = {optim.path_name(path): leaf for path, leaf in
             jax.tree_util.tree_leaves_with_path(restore_checkpoint(reference_dir, 12))}
    assert float(saved['opt_state/dynamic_scale/scale']) == rows[-1]['train_loss_scale']


def test_float16_real_divergence_stops_with_one_line(image_folder, tmp_path):
  config = _config(image_folder, **{'dtype': 'float16', 'optimizer.name': 'sgd',
                                    'optimizer.learning_rate': 1e6, 'num_train_steps': 40,
                                    'log_every_steps': 40, 'checkpoint_every_steps': 40,
                                    'eval_every_steps': 40})
  with pytest.raises(TrainingDiverged) as raised:
    train.train_and_evaluate(config, str(tmp_path))
  line = printable(str(raised.value))
  assert '\n' not in line and 'NaN/Inf at step' in line and 'float16' in line


def test_lr_find_writes_its_curve_and_leaves_a_runs_checkpoints_bytewise(uninterrupted, image_folder,
                                                                         tmp_path):
  if uninterrupted[0] != 'schedule_free_sam_float16':
    pytest.skip('one run to leave untouched is enough')
  workdir = str(tmp_path / 'run')
  shutil.copytree(uninterrupted[1], workdir)
  before = {name: tree_digest(os.path.join(workdir, name)) if os.path.isdir(os.path.join(workdir, name))
            else open(os.path.join(workdir, name), 'rb').read() for name in os.listdir(workdir)}
  config = _config(image_folder, **{'optimizer.name': 'adam', 'lr_find.steps': 20, 'lr_find.min_lr': 1e-5,
                                    'lr_find.max_lr': 10.0})
  result = lr_find.lr_find(config, workdir)
  after = {name: tree_digest(os.path.join(workdir, name)) if os.path.isdir(os.path.join(workdir, name))
           else open(os.path.join(workdir, name), 'rb').read() for name in before}
  assert after == before
  assert set(os.listdir(workdir)) - set(before) == {'lr_find.json', 'lr_find.png'}
  with open(os.path.join(workdir, 'lr_find.json')) as f:
    saved = json.load(f)
  rates = np.array(saved['rates'])
  np.testing.assert_allclose(rates, 1e-5 * 1e6 ** (np.arange(len(rates)) / 19), rtol=1e-6)
  assert saved == result and saved['rule'] in ('steepest', 'min/10')
  assert 1e-5 <= saved['suggested_lr'] <= rates[-1]
  smoothed = lr_find.smoothed(saved['losses'], 0.98)
  np.testing.assert_allclose(saved['smoothed_losses'], smoothed, rtol=1e-9)
  assert len(rates) == 20 or 'NaN' in saved['stopped'] or 'minimum' in saved['stopped']


def _signal_in_training_at_step(monkeypatch, step_to_signal):
  """SIGTERM at a step of the training loop's batches (not the budget probe's, which also reads batches)."""
  import signal

  from flaxtpu.data import loaders
  real = loaders.train_batches

  def batches(*args, **kwargs):
    probe = kwargs['last_step'] == budget_probe.PROBE_MAX_STEPS + 2 and kwargs['first_step'] == 0
    for step, batch in enumerate(real(*args, **kwargs), kwargs['first_step'] + 1):
      if step == step_to_signal and not probe:
        os.kill(os.getpid(), signal.SIGTERM)
      yield batch

  monkeypatch.setattr(loaders, 'train_batches', batches)


@pytest.mark.slow  # a run of 90 s (and its resume)
def test_time_budget_plans_the_length_ends_the_schedule_and_keeps_the_plan_on_resume(image_folder, tmp_path,
                                                                                    monkeypatch):
  overrides = {'time_budget': '90s', 'num_train_steps': -1, 'schedule.name': 'cosine',
               'optimizer.learning_rate': 0.01, 'log_every_steps': 1, 'eval_every_steps': -1,
               'checkpoint_every_steps': -1}
  _signal_in_training_at_step(monkeypatch, 4)
  stopped = train.train_and_evaluate(_config(image_folder, **overrides), str(tmp_path))
  with open(tmp_path / 'time_budget.json') as f:
    plan = json.load(f)
  assert stopped['stopped_at_step'] < plan['steps']
  monkeypatch.undo()
  results = train.train_and_evaluate(_config(image_folder, **overrides), str(tmp_path))
  with open(tmp_path / 'time_budget.json') as f:
    assert json.load(f) == plan  # kept, not planned again
  assert results['step'] == plan['steps'] > 4
  rows = [row for row in metric_rows(str(tmp_path)) if 'learning_rate' in row]
  # The cosine schedule ran its whole course: its last step is at the end of the decay.
  assert rows[-1]['step'] == plan['steps'] and rows[-1]['learning_rate'] < 0.01 * 0.01
  assert 0 < results['time_budget_used'] and results['time_budget_s'] == 90.0
