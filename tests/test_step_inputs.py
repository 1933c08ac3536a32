"""A sweep compiles once: the optimizer's and the loss's numbers are inputs of the train step, so runs that
differ in them only share one program (and every run after the first loads it from the persistent cache)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import cifar10_resnet
from flaxtpu.optimizers import optim, step_inputs
from flaxtpu.settings import lengths
from flaxtpu.step import parallel, placing, steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = 256


def _config(**overrides):
  config = cifar10_resnet.get_config()  # Nesterov SGD, weight decay, warmup + cosine, label smoothing
  config.model.name = 'cnn'
  config.batch_size = 16
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


def _placed(config):
  length = lengths.run_length(config, EXAMPLES)
  task = steps.create_task(config, num_classes=10, image_shape=(8, 8, 3), mean=np.zeros(3), std=np.ones(3),
                           length=length)
  placement = placing.place(task, parallel.make_mesh(config), config)
  rng = np.random.default_rng(0)
  batch = placement.put_train_batch((rng.integers(0, 256, (16, 8, 8, 3), np.uint8),
                                     rng.integers(0, 10, (16,), np.int32)))
  return task, placement, batch


SWEPT = {'optimizer.learning_rate': 0.37, 'optimizer.weight_decay': 1e-3, 'optimizer.momentum': 0.8,
         'label_smoothing': 0.2, 'num_epochs': 182.0, 'schedule.warmup_epochs': 5.0,
         'schedule.final_lr_fraction': 0.01, 'optimizer.grad_clip_norm': 0.0}


@pytest.mark.parametrize('parallelism', ['jit', 'pmap'])
def test_runs_that_differ_in_optimizer_numbers_only_compile_one_program(parallelism):
  def program(**overrides):
    config = _config(parallelism=parallelism, **overrides)
    task, placement, batch = _placed(config)
    state = placing.create_state(task, placement, config.seed)  # under pmap: a copy on each device
    return placement.train_step.lower(state, batch).as_text()

  assert program() == program(**SWEPT)
  assert program(**{'optimizer.name': 'adamw'}) != program()  # a structural key is still a new program


def test_the_step_uses_its_numbers_as_the_constant_step_would():
  """The placed step (numbers as inputs) against train_step with the same numbers compiled in, for the
  swept config: one step from the same state, then the learning rate the schedule gives mid-warmup."""
  config = _config(**{**SWEPT, 'num_epochs': 3.0, 'schedule.warmup_epochs': 1.0})
  task, placement, batch = _placed(config)
  state = placing.create_state(task, placement, config.seed)
  constant = jax.jit(lambda state, batch: steps.train_step(state, batch, task=task))
  expected, expected_metrics = constant(state, batch)
  state = placing.create_state(task, placement, config.seed)
  placed_state, placed_metrics = placement.train_step(state, batch)
  np.testing.assert_allclose(placed_metrics.loss.compute(), expected_metrics.loss.compute(), rtol=1e-6)
  for got, want in zip(jax.tree.leaves(placed_state.params), jax.tree.leaves(expected.params)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  # 16 updates an epoch (256 / 16): a warmup of 16, then cosine over 32 to 0.01 x 0.37.
  schedule = optim.learning_rate_schedule(config, lengths.run_length(config, EXAMPLES))
  np.testing.assert_allclose([float(schedule(u)) for u in (0, 8, 16, 32, 48)],
                             [0.0, 0.185, 0.37, 0.0037 + 0.3663 * 0.5, 0.0037], rtol=1e-6)
  assert task.numbers == step_inputs.of(config, lengths.run_length(config, EXAMPLES))


def _run(workdir, cache, *overrides):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  return subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py', f'--workdir={workdir}',
       '--config.num_train_steps=3', '--config.log_every_steps=3', f'--config.compilation_cache_dir={cache}',
       *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_second_trial_of_a_learning_rate_sweep_loads_its_train_step_from_the_cache(tmp_path):
  cache = str(tmp_path / 'cache')
  first = _run(tmp_path / 'lr_0.003', cache)
  assert first.returncode == 0, first.stderr[-3000:]
  second = _run(tmp_path / 'lr_0.01', cache, '--config.optimizer.learning_rate=0.01',
                '--config.optimizer.b1=0.85', '--config.label_smoothing=0.1', '--config.num_train_steps=4')
  assert second.returncode == 0, second.stderr[-3000:]
  assert '(from XLA)' in first.stderr or '(from persistent cache)' in first.stderr
  assert '(from persistent cache)' in second.stderr, second.stderr[-3000:]
  results = [json.loads((tmp_path / name / 'results.json').read_text()) for name in ('lr_0.003', 'lr_0.01')]
  assert results[1]['memory_plan']['compiled_from'] == 'persistent cache'
  assert results[0]['train_loss'] != results[1]['train_loss']  # the new numbers were used
