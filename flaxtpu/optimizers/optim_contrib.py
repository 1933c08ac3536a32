"""The optax.contrib optimizers: Muon and the schedule-free ones, and schedule-free's two weight sequences.

Muon (`optax.contrib.muon`) orthogonalises the momentum of each kernel by
Newton-Schulz iterations. Its kernels are the model's kernels of 2 or more
dimensions below the head, each read as a (fan-in, fan-out) matrix: a conv
kernel (H, W, I, O) reduces over H, W and I (Keller Jordan's CIFAR-10 Muon).
Everything else (biases, normalisation scales, the classifier head, as in
Keller Jordan's recipes) goes to the AdamW that optax's muon carries inside,
at `optimizer.muon_adam_lr` (0 = the same rate) and `bias_weight_decay`.

Schedule-free (`optax.contrib.schedule_free`, Defazio et al. 2024) keeps two
sequences: z (the base optimizer's iterate, in its state) and x (their
weighted average); the gradient is taken at y = b1 x + (1 - b1) z and x is
what must be evaluated. flaxtpu keeps x in `TrainState.params`, so every reader
of parameters (in-training evaluation, the best checkpoint, eval, predict,
export, fine-tuning, distillation) gets the averaged weights with no change;
the train step forms y from x and z (`gradient_point`) and turns optax's new y
back into x (`averaged`, optax's `schedule_free_eval_params`). BatchNorm
running statistics come from the forward passes at y, so before each
evaluation they are recomputed at x over `swa.bn_batches` train batches
(`bn_recompute.for_schedule_free`), and the checkpoint of an evaluated step
holds those.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax
from optax.contrib import MuonDimensionNumbers, ScheduleFreeState, schedule_free_eval_params

from flaxtpu import models
from flaxtpu.optimizers.optim_wrappers import updated

SCHEDULE_FREE = ('schedule_free_adamw', 'schedule_free_sgd')
CONTRIB = ('muon', *SCHEDULE_FREE)


def muon_dimensions(model_name: str):
  """params -> a tree of MuonDimensionNumbers (a kernel below the head, reduced over all axes but the last)
  or None (AdamW): the `muon_weight_dimension_numbers` of `optax.contrib.muon`."""
  depths, head = models.layer_depths(model_name)

  def dimensions(path, leaf) -> Optional[MuonDimensionNumbers]:
    module = str(getattr(path[0], 'key', path[0]))
    if leaf.ndim < 2 or depths.get(module, -1) == head:
      return None
    return MuonDimensionNumbers(reduction_axis=tuple(range(leaf.ndim - 1)), output_axis=leaf.ndim - 1)

  return lambda params: jax.tree_util.tree_map_with_path(dimensions, params)


def contrib_optimizer(opt: ml_collections.ConfigDict, schedule: optax.Schedule, model_name: str,
                      kernel_mask, b2: float) -> optax.GradientTransformation:
  """`optimizer.name` in CONTRIB as optax.contrib composes it (weight decay on kernels only)."""
  if opt.name == 'muon':
    adam_lr = schedule if not opt.muon_adam_lr else (
        lambda count: schedule(count) * (opt.muon_adam_lr / opt.learning_rate))
    return optax.contrib.muon(
        schedule, beta=opt.momentum, nesterov=opt.nesterov, weight_decay=opt.weight_decay,
        weight_decay_mask=kernel_mask, adam_b1=opt.b1, adam_b2=b2, eps=opt.eps,
        adam_weight_decay=opt.bias_weight_decay, adam_learning_rate=adam_lr,
        muon_weight_dimension_numbers=muon_dimensions(model_name))
  decay = [optax.add_decayed_weights(opt.weight_decay, mask=kernel_mask)] if opt.weight_decay else []
  if opt.name == 'schedule_free_adamw':  # optax.contrib.schedule_free_adamw's base, its decay masked
    base = optax.chain(optax.scale_by_rms(decay=b2, eps=opt.eps, eps_in_sqrt=False, bias_correction=True),
                       *decay, optax.scale_by_learning_rate(schedule))
  else:  # schedule_free_sgd: plain SGD on z (b1's interpolation is its momentum)
    base = optax.chain(*decay, optax.sgd(schedule))
  return optax.contrib.schedule_free(base, learning_rate=schedule, b1=opt.b1)


def schedule_free_state(opt_state) -> Optional[ScheduleFreeState]:
  """The ScheduleFreeState inside an optimizer state (chained, accumulated, loss-scaled), or None."""
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleFreeState)):
    if isinstance(node, ScheduleFreeState):
      return node
  return None


def gradient_point(opt_state, params):
  """Where the gradient is taken: y = b1 x + (1 - b1) z under schedule-free (params = x), else params."""
  state = schedule_free_state(opt_state)
  if state is None:
    return params
  return jax.tree.map(lambda x, z: state.b1 * x + (1.0 - state.b1) * z, params, state.z)


def averaged(opt_state, point, params_before):
  """The parameters to keep after an update that moved the gradient point to `point`: schedule-free's x
  (unchanged, bit for bit, on an accumulating step), else `point` itself."""
  state = schedule_free_state(opt_state)
  if state is None:
    return point
  x = schedule_free_eval_params(state, point)
  return jax.tree.map(lambda new, old: jnp.where(updated(opt_state), new, old), x, params_before)
