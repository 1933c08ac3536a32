"""The optax optimizer and learning-rate schedule that a config describes."""

from __future__ import annotations

import jax
import ml_collections
import optax

from flaxtpu.config import RunLength


def learning_rate_schedule(config: ml_collections.ConfigDict, length: RunLength) -> optax.Schedule:
  """constant | cosine | linear (each after a linear warmup from 0) | onecycle."""
  peak = config.optimizer.learning_rate
  warmup = min(length.warmup_steps, length.total_steps - 1)
  final = peak * config.schedule.final_lr_fraction
  name = config.schedule.name
  if name == 'onecycle':
    # Warm up for warmup_epochs (30% of the run when 0), then anneal to ~0.
    pct_start = warmup / length.total_steps if warmup else 0.3
    return optax.cosine_onecycle_schedule(length.total_steps, peak, pct_start=pct_start)
  if name == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, length.total_steps, final)
  decay_steps = max(1, length.total_steps - warmup)
  after_warmup = (optax.constant_schedule(peak) if name == 'constant'
                  else optax.linear_schedule(peak, final, decay_steps))
  if not warmup:
    return after_warmup
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after_warmup], [warmup])


def decay_mask(params):
  """Weight decay applies to kernels only, never to biases or normalisation scales (ndim 1)."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def create_optimizer(config: ml_collections.ConfigDict,
                     length: RunLength) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax chain: [clip] -> [L2 / decoupled decay] -> sgd|adam|adamw with the schedule.

  sgd and adam add `weight_decay * w` to the gradient (classic L2, as in
  PyTorch's SGD); adamw decays the weights after the Adam update (decoupled).
  """
  opt = config.optimizer
  schedule = learning_rate_schedule(config, length)
  chain = []
  if opt.grad_clip_norm:
    chain.append(optax.clip_by_global_norm(opt.grad_clip_norm))
  if opt.name == 'adamw':
    chain.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                             weight_decay=opt.weight_decay, mask=decay_mask))
  else:
    if opt.weight_decay:
      chain.append(optax.add_decayed_weights(opt.weight_decay, mask=decay_mask))
    if opt.name == 'sgd':
      chain.append(optax.sgd(schedule, momentum=opt.momentum or None, nesterov=opt.nesterov))
    else:
      chain.append(optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps))
  return optax.chain(*chain), schedule
