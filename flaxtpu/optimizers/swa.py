"""Stochastic weight averaging (swa.*): a running mean of the weights inside a run.

From step `swa.start` on, every `swa.every` steps the weights join an equal-weight running mean
(Izmailov et al. 2018; torch.optim.swa_utils.AveragedModel). The mean lives in the train state
(`TrainState.swa`: 'params', 'batch_stats', 'count'), is updated inside the compiled train step as
the EMA is, and is saved in every checkpoint, so a resumed run continues it bit for bit.

Averaged weights never ran a forward pass, so their BatchNorm statistics are recomputed
(`bn_recompute`, update_bn's cumulative average over `swa.bn_batches` train batches) before each
evaluation scores them (`eval_accuracy_swa`, ...); the statistics are kept in the state, so the
checkpoint saved after an evaluation holds what `--config.eval.swa=true` (eval, predict, export)
reads. Runs without BatchNorm skip the recompute. The config checks import no JAX (config.py runs
them before JAX starts), so the functions that compute import it themselves.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from flaxtpu.settings.errors import ConfigError


def check(config: ml_collections.ConfigDict) -> None:
  """The swa.* keys (and eval.swa) on their own and against the optimizer's accumulation."""
  swa = config.swa
  if not isinstance(swa.every, int) or swa.every < 0:
    raise ConfigError(f'config.swa.every={swa.every!r} must be an integer >= 0 (0 = off; e.g. 50 steps '
                      'between averaged weights)')
  start = float(swa.start)
  if not (start >= 0 and (start < 1 or start.is_integer())):
    raise ConfigError(f'config.swa.start={swa.start!r} must be a fraction of the run in [0, 1) (e.g. 0.75) '
                      'or a step number (e.g. 3000)')
  if not isinstance(swa.bn_batches, int) or swa.bn_batches < 1:
    raise ConfigError(f'config.swa.bn_batches={swa.bn_batches!r} must be an integer >= 1 (the train '
                      'batches BatchNorm statistics are recomputed over; e.g. 32)')
  if swa.every and swa.every % config.optimizer.accumulate_steps:
    raise ConfigError(f'config.swa.every={swa.every} must be a multiple of optimizer.accumulate_steps='
                      f'{config.optimizer.accumulate_steps}: weights change once per that many batches')
  if config.eval.swa and not swa.every:
    raise ConfigError('config.eval.swa=True needs an SWA of the weights (config.swa.every > 0); set '
                      '--config.eval.swa=false or --config.swa.every=50')
  if config.eval.swa and config.eval.ema:
    raise ConfigError('config.eval.swa and config.eval.ema both pick the weights to score; set one of them')
  if config.checkpoint.best_metric.endswith('_swa') and not swa.every:
    raise ConfigError(f'config.checkpoint.best_metric={config.checkpoint.best_metric!r} needs an SWA of '
                      'the weights; set --config.swa.every (e.g. 50) or pick eval_accuracy')


def start_step(config: ml_collections.ConfigDict, total_steps: int) -> int:
  """The first step whose weights join the mean: swa.start as a step, or as a fraction of the run's
  `total_steps` (rounded up to a multiple of swa.every, so every averaged step is one of its steps)."""
  start = float(config.swa.start)
  step = int(start) if start >= 1 else int(round(start * total_steps))
  every = max(config.swa.every, 1)
  return max(every, -(-step // every) * every)


def init(params: Any, batch_stats: Any) -> dict:
  """An empty mean (count 0) shaped as the weights; its values are replaced by the first averaged step's."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return {'params': params, 'batch_stats': batch_stats, 'count': jnp.zeros((), jnp.int32)}


def averaged_now(task, step_after, did_update):
  """Whether the weights after train step `step_after` (1-based) join the mean."""
  return (did_update & (step_after >= task.swa_start)
          & ((step_after - task.swa_start) % task.swa_every == 0))


def update(task, swa: dict, step_after, params: Any, did_update) -> dict:
  """The mean after train step `step_after`: params joined with weight 1 / (count + 1) where due.

  The BatchNorm statistics are left as they are: `recompute` replaces them before an evaluation.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  join = averaged_now(task, step_after, did_update)
  count = swa['count'] + join.astype(jnp.int32)
  weight = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
  mean = jax.tree.map(lambda average, new: jnp.where(join, average + (new - average) * weight.astype(
      average.dtype), average), swa['params'], params)
  return {'params': mean, 'batch_stats': swa['batch_stats'], 'count': count}


def view(state):
  """`state` with the SWA weights and their (recomputed) BatchNorm statistics in place of the raw ones."""
  return state.replace(params=state.swa['params'], batch_stats=state.swa['batch_stats'])


def has_average(state) -> bool:
  """Whether `state` carries an SWA that has averaged at least one step (host read of the count)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  swa = getattr(state, 'swa', None)
  if not swa:
    return False
  count = swa['count']  # replicated: this process's first copy (with many processes none holds them all)
  local = count.addressable_data(0) if isinstance(count, jax.Array) else count
  return int(np.asarray(local).reshape(-1)[0]) > 0


def with_recomputed_statistics(state, task, placement, batches) -> Any:
  """`state` whose SWA BatchNorm statistics are those of its averaged weights over `batches`."""
  from flaxtpu.step import bn_recompute  # pylint: disable=g-import-not-at-top
  statistics = bn_recompute.recompute(task, placement, state.swa['params'], state.swa['batch_stats'],
                                      batches)
  return state.replace(swa={**state.swa, 'batch_stats': statistics})


def weights_name(eval_settings) -> str:
  """The weights eval/predict/export and the end-of-run report use: 'swa', 'ema' or 'raw', from a config's
  `eval` section (or a saved run's, as a dict)."""
  return 'swa' if eval_settings.get('swa') else 'ema' if eval_settings.get('ema') else 'raw'


def before_evaluation(config: ml_collections.ConfigDict, task, placement, dataset, state):
  """`state` with its SWA's BatchNorm statistics recomputed (the first swa.bn_batches train batches)
  before an evaluation scores it; `state` itself where there is no SWA (yet) or no BatchNorm."""
  if not task.swa_every or not has_average(state):
    return state
  from flaxtpu.step import bn_recompute  # pylint: disable=g-import-not-at-top
  return with_recomputed_statistics(state, task, placement,
                                    bn_recompute.train_batches(config, dataset, config.swa.bn_batches))
