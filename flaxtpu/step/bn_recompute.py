"""BatchNorm statistics recomputed for given weights: torch.optim.swa_utils.update_bn for Flax.

Averaged weights (SWA, model soups) and weights read at another point than the forward passes that
made the running statistics (schedule-free's x, gradients taken at y) need statistics of their own:
each BatchNorm layer's mean and variance averaged over N train batches, with equal weight per batch
(update_bn's cumulative average, `momentum=None`). The statistics are Flax's own batch statistics
(the biased variance its running average keeps), under pmap averaged over the devices as training
averages them.

How: every `nn.BatchNorm` of the model runs with momentum 0 (`nn.intercept_methods`), so its
running statistics after one train-mode forward pass are exactly that batch's; the next layers see
batch-normalised inputs as in training, whatever the running values were. Averages are summed on
the devices and divided once at the end.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxtpu.augmentation import augment
from flaxtpu.step import parallel


def _batch_statistics_only(next_fun, args, kwargs, context):
  """Runs a BatchNorm's __call__ with momentum 0: its running statistics become the batch's."""
  module = context.module
  if not isinstance(module, nn.BatchNorm) or context.method_name != '__call__':
    return next_fun(*args, **kwargs)
  momentum = module.momentum
  object.__setattr__(module, 'momentum', 0.0)  # read at trace time only: the compiled step keeps 0
  try:
    return next_fun(*args, **kwargs)
  finally:
    object.__setattr__(module, 'momentum', momentum)


def batch_statistics(model: nn.Module, params: Any, batch_stats: Any, images: jax.Array) -> Any:
  """Every BatchNorm layer's statistics of one batch of normalised `images` (pure; jit or pmap it)."""
  with nn.intercept_methods(_batch_statistics_only):
    _, updates = model.apply({'params': params, 'batch_stats': batch_stats}, images, train=True,
                             mutable=['batch_stats'], rngs={'dropout': jax.random.PRNGKey(0)})
  return updates['batch_stats']


def _accumulate(totals, params, images, *, model, mean, std):
  """`totals` + this batch's statistics (images are uint8, normalised here as the train step does)."""
  stats = batch_statistics(model, params, totals, augment.normalize(images, mean, std))
  return jax.tree.map(lambda total, batch: total + batch.astype(total.dtype), totals, stats)


def recompute(task, placement, params: Any, batch_stats: Any, batches: Iterable) -> Any:
  """BatchNorm statistics of the weights `params` over `batches` (train `pipeline.Batch`es or
  (images, labels) pairs of this process; their number is N), laid out as `batch_stats`.

  `task` and `placement` are the run's (`steps.Task`, `placing.Placement`): images are normalised as
  its train step normalises them, without the on-device augmentation or mixing. A model without
  BatchNorm (`batch_stats` == {}) returns {} at once. The result has the layout of `batch_stats`
  (global arrays under jit, one copy per device under pmap).
  """
  if not jax.tree.leaves(batch_stats):
    return batch_stats
  step = functools.partial(_accumulate, model=task.model, mean=task.mean, std=task.std)
  zeros = jax.tree.map(jnp.zeros_like, batch_stats)
  if placement.parallelism == 'pmap':
    accumulate = jax.pmap(step, axis_name=parallel.PMAP_AXIS)
  else:
    accumulate = jax.jit(step, donate_argnums=0)
  totals, count, one_in_flight = zeros, 0, parallel.one_step_in_flight()
  for batch in batches:
    images = placement.put_train_batch(tuple(batch)[:2])[0]
    totals = accumulate(totals, params, images)
    if one_in_flight:  # XLA:CPU's virtual devices deadlock with two collective programs in flight
      jax.block_until_ready(totals)
    count += 1
  if not count:
    raise ValueError('recompute needs at least one train batch')
  logging.info('BatchNorm statistics recomputed over %d train batches', count)
  return jax.block_until_ready(jax.tree.map(lambda total: total / count, totals))


def train_batches(config, dataset, count: int, seed_offset: int = 0) -> Iterable:
  """The first `count` train batches of the run's sampler (its seed's steps 0..count-1): a
  deterministic choice, the same at every evaluation and after a resume."""
  from flaxtpu.data import loaders  # pylint: disable=g-import-not-at-top
  return loaders.train_batches(dataset, seed=config.seed + seed_offset, batch_size=config.batch_size,
                               first_step=0, last_step=count, process_index=jax.process_index(),
                               process_count=jax.process_count())


def for_schedule_free(config, task, placement, dataset, state) -> Any:
  """Schedule-free: `state` with BatchNorm statistics recomputed at x (`state.params`, the weights every
  evaluation scores) over `swa.bn_batches` train batches, as Defazio et al. do; the running ones come from
  the forward passes at y, where the gradients are taken. Other optimizers, and models without
  BatchNorm: `state` itself."""
  from flaxtpu.optimizers import optim_contrib  # pylint: disable=g-import-not-at-top
  if config.optimizer.name not in optim_contrib.SCHEDULE_FREE or not jax.tree.leaves(state.batch_stats):
    return state
  batches = train_batches(config, dataset, config.swa.bn_batches)
  return state.replace(batch_stats=recompute(task, placement, state.params, state.batch_stats, batches))
