"""Issue 41 part 5: SWA inside a run, BatchNorm statistics recomputed, model soups (flaxtpu.average)."""

import json
import os
import shutil
import subprocess
import sys
import types

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import (
  assert_same_state,
  metric_rows,
  restore_checkpoint,
  signal_at_step,
  tiny_dataset,
  tree_digest,
)
from flaxtpu import average
from flaxtpu.loop import train
from flaxtpu.optimizers import swa
from flaxtpu.settings import defaults, lengths
from flaxtpu.settings.errors import ConfigError, UserError, printable
from flaxtpu.step import bn_recompute, steps
from flaxtpu.validation import config as config_lib


def _config(folder=None, **overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({
      'model.name': 'cnn', 'batch_size': 16, 'num_train_steps': 12, 'log_every_steps': 4,
      'eval_every_steps': 6, 'checkpoint_every_steps': 3, 'compilation_cache_dir': 'none',
      'schedule.name': 'constant', 'optimizer.name': 'sgd', 'optimizer.learning_rate': 0.05,
      **({'dataset.folder': folder} if folder else {}), **overrides})
  config_lib.validate(config)
  return config


SWA = {'swa.every': 2, 'swa.start': 4.0, 'swa.bn_batches': 2, 'checkpoint_every_steps': 6}


# --- the running mean, step by step ------------------------------------------------------


def test_swa_is_the_mean_of_the_weights_at_the_averaged_steps():
  config = _config(**{'num_train_steps': 7, 'swa.every': 2, 'swa.start': 0.5})
  assert swa.start_step(config, 7) == 4  # 3.5 rounded up to a multiple of every
  dataset = tiny_dataset()
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=dataset.mean, std=dataset.std,
                           length=lengths.run_length(config, 64))
  state = steps.init_state(task, 0)
  step = jax.jit(lambda state, batch: steps.train_step(state, batch, task=task))
  rng, states = np.random.default_rng(1), []
  for _ in range(7):
    rows = rng.choice(64, 16, replace=False)
    state, _ = step(state, (dataset.train.images[rows], dataset.train.labels[rows]))
    states.append(state)
  averaged = [states[3], states[5]]  # steps 4 and 6
  expected = jax.tree.map(lambda *leaves: np.mean([np.asarray(x) for x in leaves], axis=0),
                          *[s.params for s in averaged])
  assert int(state.swa['count']) == 2
  for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(state.swa['params']), strict=True):
    np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7)
  assert not np.allclose(jax.tree.leaves(state.swa['params'])[0], jax.tree.leaves(state.params)[0])
  assert steps.init_state(steps.create_task(_config(), num_classes=3, image_shape=(8, 8, 3), mean=None,
                                            std=None, length=lengths.run_length(_config(), 64)), 0).swa == {}


@pytest.mark.parametrize('overrides, message', [
    ({'swa.every': -1}, 'swa.every=-1 must be an integer >= 0'),
    ({'swa.every': 2, 'swa.start': 2.5}, 'swa.start=2.5 must be a fraction'),
    ({'swa.every': 3, 'optimizer.accumulate_steps': 2}, 'must be a multiple of optimizer.accumulate_steps'),
    ({'eval.swa': True}, 'eval.swa=True needs an SWA'),
    ({'checkpoint.best_metric': 'eval_accuracy_swa'}, 'needs an SWA of the weights'),
])
def test_swa_keys_are_checked(overrides, message):
  with pytest.raises(ConfigError, match=message):
    _config(**overrides)


# --- BatchNorm statistics recomputed ------------------------------------------------------


class _TwoNorms(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    x = nn.Dense(4)(x.reshape(len(x), -1))
    x = nn.BatchNorm(use_running_average=not train, momentum=0.99)(x)
    x = nn.Dense(3)(nn.relu(x))
    return nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)


def test_bn_recompute_is_the_equal_weight_mean_of_numpy_batch_statistics():
  rng = np.random.default_rng(0)
  batches = [(rng.integers(0, 256, (8, 2, 2, 3)).astype(np.uint8), np.zeros(8, np.int32)) for _ in range(3)]
  model = _TwoNorms()
  variables = model.init(jax.random.PRNGKey(0), np.zeros((1, 2, 2, 3), np.float32))
  task = types.SimpleNamespace(model=model, mean=None, std=None)
  placement = types.SimpleNamespace(parallelism='jit', put_train_batch=lambda batch: batch)
  stats = bn_recompute.recompute(task, placement, variables['params'], variables['batch_stats'], batches)
  params = jax.tree.map(np.asarray, variables['params'])
  first, second = [], []
  for images, _ in batches:
    h = (images / 255.0).reshape(8, -1) @ params['Dense_0']['kernel'] + params['Dense_0']['bias']
    first.append((h.mean(0), h.var(0)))
    normed = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)  # train mode: the batch's own statistics
    g = np.maximum(normed, 0) @ params['Dense_1']['kernel'] + params['Dense_1']['bias']
    second.append((g.mean(0), g.var(0)))
  for name, per_batch in (('BatchNorm_0', first), ('BatchNorm_1', second)):
    np.testing.assert_allclose(stats[name]['mean'], np.mean([m for m, _ in per_batch], 0), atol=2e-6)
    np.testing.assert_allclose(stats[name]['var'], np.mean([v for _, v in per_batch], 0), rtol=2e-5,
                               atol=1e-6)
  # The model's own momentum is untouched: a train step still moves its running mean by 1 - 0.99.
  _, updates = model.apply(variables, batches[0][0] / 255.0, train=True, mutable=['batch_stats'])
  np.testing.assert_allclose(updates['batch_stats']['BatchNorm_0']['mean'], 0.01 * first[0][0], atol=1e-7)


# --- SWA in whole runs ---------------------------------------------------------------------


@pytest.fixture(scope='module')
def swa_run(image_folder, tmp_path_factory):
  """A cnn run with SWA (steps 4, 6, ..., 12 averaged): the resume reference and a soup ingredient."""
  workdir = str(tmp_path_factory.mktemp('swa'))
  return workdir, train.train_and_evaluate(_config(image_folder, **SWA), workdir)


def test_swa_run_resumes_bit_for_bit_and_logs_the_average(swa_run, image_folder, tmp_path, monkeypatch):
  reference_dir, reference = swa_run
  saved = restore_checkpoint(reference_dir, 12)
  assert int(saved['swa']['count']) == 5
  assert {'eval_accuracy_swa', 'eval_loss_swa'} <= set(reference)
  rows = [row for row in metric_rows(reference_dir) if 'eval_accuracy' in row]
  assert [('eval_accuracy_swa' in row) for row in rows] == [True, True]  # steps 6 and 12
  signal_at_step(monkeypatch, 5)
  stopped = train.train_and_evaluate(_config(image_folder, **SWA), str(tmp_path))
  assert stopped['stopped_at_step'] < 12
  monkeypatch.undo()
  results = train.train_and_evaluate(_config(image_folder, **SWA), str(tmp_path))
  assert_same_state(restore_checkpoint(str(tmp_path), 12), saved)
  assert metric_rows(str(tmp_path)) == metric_rows(reference_dir)
  assert results['eval_accuracy_swa'] == reference['eval_accuracy_swa']
  # Turned off, the run resumes the same checkpoint (its mean read and dropped) and goes on without one.
  results = train.train_and_evaluate(_config(image_folder, **{**SWA, 'swa.every': 0, 'num_train_steps': 14}),
                                     str(tmp_path))
  assert results['step'] == 14 and 'eval_accuracy_swa' not in results
  assert restore_checkpoint(str(tmp_path), 14)['swa'] == {}


def test_eval_swa_restores_the_average_that_the_run_scored(swa_run, image_folder):
  from flaxtpu.data import pipeline
  from flaxtpu.evaluation.evaluate import evaluate
  from flaxtpu.modes.restore import restore
  workdir, results = swa_run
  eval_config = defaults.derived(_config(image_folder, **SWA), {'eval.swa': True})
  placement, state, step, _ = restore(eval_config, workdir)
  assert step == 12 and swa.weights_name(eval_config.eval) == 'swa'
  assert_same_state(jax.device_get(state.params), restore_checkpoint(workdir, 12)['swa']['params'])
  scores, _ = evaluate(placement, state, pipeline.load(eval_config, need_train=False), 16)
  assert scores['eval_loss'] == pytest.approx(results['eval_loss_swa'], rel=1e-6)
  assert scores['eval_loss'] != pytest.approx(results['eval_loss'], rel=1e-3)


@pytest.mark.slow  # ~25 s of CPU: a BatchNorm model's run; the cnn runs below check the rest of the path
def test_swa_statistics_are_recomputed_saved_and_read_by_eval_swa(image_folder, tmp_path):
  from flaxtpu.data import pipeline
  from flaxtpu.evaluation.evaluate import evaluate
  from flaxtpu.modes.restore import restore
  workdir = str(tmp_path / 'run')
  # Evaluated at step 3 (recomputed statistics, then training goes on) and at step 6.
  config = _config(image_folder, **{**SWA, 'model.name': 'fastnet_s', 'num_train_steps': 6,
                                    'eval_every_steps': 3, 'checkpoint_every_steps': 6, 'swa.every': 3,
                                    'swa.start': 3.0})
  results = train.train_and_evaluate(config, workdir)
  saved = restore_checkpoint(workdir, 6)
  assert int(saved['swa']['count']) == 2
  # Recomputed for the mean, not the raw weights' running statistics (nor the initial ones).
  assert not np.allclose(jax.tree.leaves(saved['swa']['batch_stats'])[0],
                         jax.tree.leaves(saved['batch_stats'])[0])
  # eval/predict/export's restore with eval.swa reads the mean and its statistics: it scores exactly
  # what the end of the run logged as *_swa.
  eval_config = defaults.derived(config, {'eval.swa': True})
  placement, state, step, _ = restore(eval_config, workdir)
  assert step == 6
  assert_same_state(jax.device_get(state.batch_stats), saved['swa']['batch_stats'])
  scores, _ = evaluate(placement, state, pipeline.load(eval_config, need_train=False), 16)
  assert scores['eval_accuracy'] == pytest.approx(results['eval_accuracy_swa'], abs=1e-6)
  assert scores['eval_loss'] == pytest.approx(results['eval_loss_swa'], rel=1e-5)
  assert swa.weights_name(eval_config.eval) == 'swa'


def test_schedule_free_batch_norm_statistics_are_recomputed_at_x_before_each_evaluation(
    image_folder, tmp_path, monkeypatch):
  """Schedule-free takes gradients at y, so the running statistics are y's: before an evaluation they are
  recomputed at x (the parameters every reader scores), and the evaluated step's checkpoint holds them."""
  calls = []
  real = bn_recompute.recompute

  def spy(task, placement, params, batch_stats, batches):
    statistics = real(task, placement, params, batch_stats, batches)
    calls.append((jax.device_get(params), jax.device_get(statistics)))
    return statistics

  monkeypatch.setattr(bn_recompute, 'recompute', spy)
  config = _config(image_folder, **{'model.name': 'fastnet_s', 'optimizer.name': 'schedule_free_sgd',
                                    'num_train_steps': 4, 'eval_every_steps': 4, 'checkpoint_every_steps': 4,
                                    'swa.bn_batches': 2})
  train.train_and_evaluate(config, str(tmp_path / 'run'))
  saved = restore_checkpoint(str(tmp_path / 'run'), 4)
  assert len(calls) == 1  # the one evaluation
  assert_same_state(calls[0][0], saved['params'])  # recomputed at x, the saved parameters
  assert_same_state(calls[0][1], saved['batch_stats'])  # and saved as scored
  calls.clear()
  train.train_and_evaluate(_config(image_folder, **{'model.name': 'fastnet_s', 'num_train_steps': 4,
                                                     'eval_every_steps': 4}), str(tmp_path / 'sgd'))
  assert not calls  # other optimizers keep their running statistics


# --- model soups ---------------------------------------------------------------------------


@pytest.fixture(scope='module')
def ingredients(swa_run, image_folder, tmp_path_factory):
  """Two cnn runs from the same seed: the SWA run (lr 0.05) and one blown up by lr 30."""
  bad = str(tmp_path_factory.mktemp('lr30'))
  once = {'eval_every_steps': 12, 'checkpoint_every_steps': 12, 'log_every_steps': 12}
  train.train_and_evaluate(_config(image_folder, **{'optimizer.learning_rate': 30.0, **once}), bad)
  return swa_run[0], bad


def _params(workdir):
  return restore_checkpoint(workdir, 12)['params']


def test_a_run_averaged_with_itself_is_the_run(ingredients, tmp_path):
  run, _ = ingredients
  results = average.make_soup([run, run], str(tmp_path / 'soup'))
  assert_same_state(_params(str(tmp_path / 'soup')), _params(run))
  with open(os.path.join(run, 'results.json')) as f:
    assert results['eval_accuracy'] == json.load(f)['eval_accuracy']
  with open(tmp_path / 'soup' / 'eval.json') as f:
    scored = json.load(f)
  assert scored['eval_accuracy'] == results['eval_accuracy']
  assert scored['checkpoint'] == str(tmp_path / 'soup' / 'checkpoints' / '12')
  assert sorted(os.listdir(tmp_path)) == ['soup']  # the building directory was renamed, nothing left


def test_uniform_soup_is_the_mean_and_greedy_drops_the_bad_ingredient(ingredients, tmp_path):
  good, bad = ingredients
  average.make_soup([good, bad], str(tmp_path / 'uniform'))
  for x, y, soup in zip(jax.tree.leaves(_params(good)), jax.tree.leaves(_params(bad)),
                        jax.tree.leaves(_params(str(tmp_path / 'uniform'))), strict=True):
    np.testing.assert_allclose(soup, (x + y) / 2, rtol=1e-6, atol=1e-6 * np.abs(y).max())
  results = average.make_soup([bad, good], str(tmp_path / 'greedy'), greedy=True)
  assert results['kept'] == [good]
  accuracies = {i['run']: i['held_out_accuracy'] for i in results['ingredients']}
  assert results['held_out_accuracy'] == accuracies[good] > accuracies[bad]
  assert [i.get('kept') for i in results['ingredients']] == [False, True]
  assert results['method'] == 'greedy' and results['held_out_split'] == 'test'


def test_soup_errors_are_one_line_and_touch_nothing(ingredients, tmp_path):
  good, other = ingredients
  before = tree_digest(good)
  with pytest.raises(UserError, match='already holds files; choose a new directory'):
    average.make_soup([other], good)
  assert tree_digest(good) == before
  with pytest.raises(UserError, match=f'--weights=ema but {good} trained without an EMA'):
    average.make_soup([good, other], str(tmp_path / 'out'), weights='ema')
  for field, value, what in (('model', 'resnet20', 'another architecture'),
                             ('class_names', ['a', 'b', 'c'], 'another class list')):
    changed = str(tmp_path / field)
    shutil.copytree(other, changed)
    record_path = os.path.join(changed, 'checkpoints', '12', 'record', 'metadata')
    with open(record_path) as f:
      record = json.load(f)
    with open(record_path, 'w') as f:
      json.dump({**record, field: value}, f)
    with pytest.raises(UserError, match=what) as raised:
      average.make_soup([good, changed], str(tmp_path / 'out'))
    assert '\n' not in printable(str(raised.value)) and not os.path.exists(tmp_path / 'out')
  cli = subprocess.run([sys.executable, '-m', 'flaxtpu.average', f'--workdir={tmp_path / "cli"}', good,
                        str(tmp_path / 'missing')], capture_output=True, text=True, check=False)
  assert cli.returncode == 2
  assert cli.stderr.strip().splitlines()[-1].startswith(f'error: {tmp_path / "missing"} is not a trained run')
  assert not os.path.exists(tmp_path / 'cli')
