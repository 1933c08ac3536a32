"""The optax optimizer and learning-rate schedule that a config describes."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from flaxtpu import models
from flaxtpu.optimizers import loss_scale, optim_contrib, step_inputs
from flaxtpu.optimizers.optim_wrappers import (  # noqa: F401  (re-exported: optim is where callers look)
  FreezeAfterState,
  LookaheadState,
  freeze_after,
  lookahead,
  path_name,
  updated,
)
from flaxtpu.optimizers.param_patterns import parse_freeze_after, parse_lr_multipliers
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import RunLength

FROZEN = 'frozen'  # the label of parameters that get no update and no optimizer state
DEFAULT = repr(1.0)  # the label of parameters at the peak learning rate


def learning_rate_schedule(config: ml_collections.ConfigDict, length: RunLength,
                           numbers: Optional[Mapping[str, Any]] = None) -> optax.Schedule:
  """The learning rate as a function of the optimizer update: `schedule.name` after a linear warmup from 0
  (onecycle: its own rise).

  constant | cosine | linear (to final_lr_fraction x the peak) | onecycle |
  step (x factor at each milestone epoch) | exponential (x decay_rate per
  epoch, floored at final_lr_fraction; or to final_lr_fraction at the end) |
  rsqrt (big_vision's: peak / sqrt(1 + updates after warmup / timescale),
  with an optional linear cooldown to 0 over the last cooldown_epochs) |
  plateau (constant here; the optimizer's updates are scaled by `Plateau`'s
  scale, which the loop sets after each evaluation).
  With gradient accumulation an update takes `accumulate_steps` batches; the
  schedule's argument is the update count (what optax's inner state counts).
  The peak, the final fraction, the run's length and the warmup come from
  `numbers` (step_inputs.py: floats, or the train step's traced inputs; the
  config's and `length`'s when None), so one compiled step serves them all.
  """
  numbers = numbers or step_inputs.of(config, length)
  peak, total = numbers['optimizer.learning_rate'], numbers['total_updates']
  concrete_warmup = step_inputs.warmup_updates(length)  # whether there is one shapes the program
  warmup, has_warmup = numbers['warmup_updates'], concrete_warmup > 0
  final = peak * numbers['schedule.final_lr_fraction']
  name = config.schedule.name
  if name == 'onecycle':  # its phases are Python numbers in optax: the run's length stays a constant
    # Warm up for warmup_epochs (30% of the run when 0), then anneal to ~0.
    pct_start = concrete_warmup / length.total_updates if concrete_warmup else 0.3
    shape = optax.cosine_onecycle_schedule(length.total_updates, 1.0, pct_start=pct_start)
    return lambda update: peak * shape(update)
  if name in ('step', 'exponential', 'rsqrt'):
    decay = _decay(config.schedule, length, warmup, total, numbers['schedule.final_lr_fraction'])
    ramp = (lambda update: jnp.minimum(1.0, update / warmup)) if has_warmup else (lambda update: 1.0)
    return lambda update: peak * ramp(update) * decay(update)

  if name in ('constant', 'plateau') and not has_warmup:
    return lambda update: peak  # (on the host a Python float, as the config gives it)

  def after_warmup(updates):  # updates since the warmup ended
    if name == 'cosine':  # optax.warmup_cosine_decay_schedule's, to `final`
      progress = jnp.minimum(updates, total - warmup) / (total - warmup)
      return final + (peak - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    if name == 'linear':
      span = jnp.maximum(total - warmup, 1.0)
      return peak + (final - peak) * jnp.minimum(updates, span) / span
    return peak * jnp.ones_like(updates)  # constant, plateau

  def schedule(update):
    update = jnp.asarray(update, jnp.float32)
    if not has_warmup:
      return after_warmup(update)
    return jnp.where(update < warmup, peak * update / warmup, after_warmup(jnp.maximum(update - warmup, 0.0)))
  return schedule


def _decay(schedule: ml_collections.ConfigDict, length: RunLength, warmup, total,
           final) -> Callable[[jax.Array], jax.Array]:
  """step | exponential | rsqrt: the peak's factor at an update (1 until the warmup ends). `warmup`,
  `total` (updates) and `final` (the final fraction) may be traced; epochs count `length`'s updates."""
  updates_per_epoch = length.steps_per_epoch / length.accumulate_steps
  after_warmup = lambda update: jnp.maximum(update - warmup, 0)
  if schedule.name == 'step':
    milestones = jnp.array([round(epochs * updates_per_epoch) for epochs in schedule.milestones])
    return lambda update: schedule.factor ** jnp.sum(update >= milestones)
  if schedule.name == 'exponential':
    if not schedule.decay_rate:  # the rate per update that reaches `final` at the end
      return lambda update: final ** (after_warmup(update) / jnp.maximum(total - warmup, 1))
    per_epoch = schedule.decay_rate
    return lambda update: jnp.maximum(per_epoch ** (after_warmup(update) / updates_per_epoch), final)
  cooldown = round(schedule.cooldown_epochs * updates_per_epoch)
  cool = (lambda update: jnp.minimum(1.0, (total - update) / cooldown)) if cooldown else (lambda update: 1.0)
  return lambda update: cool(update) / jnp.sqrt(1.0 + after_warmup(update) / schedule.timescale)


def decay_mask(params):
  """`optimizer.weight_decay` applies to kernels only (ndim > 1)."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def bias_decay_mask(params):
  """`optimizer.bias_weight_decay` applies to biases and normalisation scales (ndim <= 1)."""
  return jax.tree.map(lambda p: p.ndim <= 1, params)


def named_leaves(tree) -> dict[str, Any]:
  """{'/'-joined path: leaf} of a parameter (or BatchNorm statistics) tree."""
  return {path_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def model_layers(model_name: str) -> list[tuple[str, ...]]:
  """The top-level modules of each layer of a model below its head (layer len(result)), from the input
  up: its family's layer-depth map (`Family.layers`), counted as timm's `group_matcher`s count layers."""
  return models.get_family(model_name).layers(models.get_spec(model_name))[:-1]


def layer_depth(model_name: str, name: str) -> int:
  """The layer of parameter `name` ('stage1_block1/Conv_0/kernel') for `optimizer.layer_decay`; a
  parameter that its family's layer-depth map does not place is a UserError naming it."""
  depths, _ = models.layer_depths(model_name)
  module = name.partition('/')[0]
  if module not in depths:
    family = models.get_spec(model_name).family
    raise UserError(f'optimizer.layer_decay: parameter {name!r} of {model_name} is in no layer of the '
                    f'{family!r} family\'s layer-depth map (its top-level module {module!r} is listed '
                    'nowhere); add it to the family\'s `layers`, or set optimizer.layer_decay=0')
  return depths[module]


def layer_decay_multipliers(model_name: str, params, layer_decay: float) -> dict[str, float]:
  """{parameter name: layer_decay ** (head layer - its layer)}: the learning-rate factor of each
  parameter under `optimizer.layer_decay` (before `lr_multipliers`)."""
  groups = ParamGroups(layer_decay=layer_decay, model=model_name)
  return {name: groups.layer_scale(name) for name in named_leaves(params)}


@dataclasses.dataclass(frozen=True)
class ParamGroups:
  """Which parameters train at which learning rate: `optimizer.freeze`, `optimizer.lr_multipliers` and
  `optimizer.layer_decay`.

  Patterns are regexes searched (`re.search`) in '/'-joined parameter paths.
  Freezing wins over multipliers; among multipliers the first matching one
  wins. A multiplier of 0 is a freeze (no update, no optimizer state, BatchNorm
  statistics kept), so both give the same parameters bit for bit. Layer decay
  multiplies the rate of every parameter by its layer's factor, on top of its
  multiplier.
  """
  freeze: tuple[str, ...] = ()
  multipliers: tuple[tuple[str, float], ...] = ()
  freeze_after: tuple[tuple[str, float], ...] = ()  # (pattern, epochs): trained that long, then frozen
  layer_decay: float = 0.0  # 0 = off
  model: str = ''  # the model whose layers layer_decay counts

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> 'ParamGroups':
    return cls(freeze=tuple(config.optimizer.freeze),
               multipliers=tuple(parse_lr_multipliers(config.optimizer.lr_multipliers)),
               freeze_after=tuple(parse_freeze_after(config.optimizer.freeze_after)),
               layer_decay=config.optimizer.layer_decay, model=config.model.name)

  def __bool__(self) -> bool:
    return bool(self.freeze or self.multipliers or self.freeze_after or self.layer_decay)

  def layer_scale(self, name: str) -> float:
    """layer_decay ** (the head's layer - the layer of parameter `name`); 1 without layer decay."""
    if not self.layer_decay:
      return 1.0
    _, head = models.layer_depths(self.model)
    return self.layer_decay ** (head - layer_depth(self.model, name))

  def rates(self) -> set[str]:
    """The label of every learning-rate factor a trainable parameter can get (DEFAULT among them)."""
    factors = {1.0} | {factor for _, factor in self.multipliers if factor}
    scales = {1.0}
    if self.layer_decay:
      _, head = models.layer_depths(self.model)
      scales = {self.layer_decay ** (head - depth) for depth in range(head + 1)}
    return {repr(float(factor * scale)) for factor in factors for scale in scales} | {DEFAULT}

  def label(self, name: str) -> str:
    """FROZEN, or the learning-rate factor as a string ('0.1'; DEFAULT = '1.0')."""
    if any(re.search(pattern, name) for pattern in self.freeze):
      return FROZEN
    factor = next((factor for pattern, factor in self.multipliers if re.search(pattern, name)), 1.0)
    return FROZEN if factor == 0 else repr(float(factor * self.layer_scale(name)))

  def labels(self, params):
    """The label of every leaf of `params` (a tree of the same structure; masked leaves stay masked)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: self.label(path_name(path)), params)

  def keep_frozen(self, old_params, new_params, old_stats, new_stats):
    """(params, BatchNorm statistics) after a step, with the frozen ones taken from before it.

    The frozen parameters' update is zero, but `p + 0` turns a -0.0 into +0.0:
    keeping the old arrays makes "frozen" exact. A BatchNorm module whose
    parameters are all frozen keeps its running mean and variance too, or a
    frozen backbone would still drift at inference time.
    """
    frozen_modules: dict[str, bool] = {}
    for name in named_leaves(old_params):
      module = name.rpartition('/')[0]
      frozen_modules[module] = frozen_modules.get(module, True) and self.label(name) == FROZEN
    keep = lambda frozen, old, new: old if frozen else new
    params = jax.tree.map(keep, jax.tree.map(lambda label: label == FROZEN, self.labels(old_params)),
                          old_params, new_params)
    stats_frozen = jax.tree_util.tree_map_with_path(
        lambda path, _: frozen_modules.get(path_name(path).rpartition('/')[0], False), old_stats)
    return params, jax.tree.map(keep, stats_frozen, old_stats, new_stats)

  def check(self, params) -> dict[str, list[str]]:
    """{label: parameter names}; a pattern that matches no parameter is a UserError naming it."""
    names = list(named_leaves(params))
    for key, patterns in (('freeze', self.freeze), ('lr_multipliers', [p for p, _ in self.multipliers]),
                          ('freeze_after', [p for p, _ in self.freeze_after])):
      for pattern in patterns:
        if not any(re.search(pattern, name) for name in names):
          modules = sorted({name.partition('/')[0] for name in names})
          raise UserError(f'config.optimizer.{key} pattern {pattern!r} matches no parameter; the '
                          f'top-level modules are: {", ".join(modules)} (paths look like {names[0]!r})')
    groups: dict[str, list[str]] = {}
    for name in names:
      groups.setdefault(self.label(name), []).append(name)
    return groups


def describe_groups(groups: dict[str, list[str]]) -> str:
  """One log line: how many arrays train at each learning-rate multiplier, and which are frozen."""
  parts = [f'{len(names)} arrays at lr x{float(label):.4g}'
           for label, names in groups.items() if label != FROZEN]
  if FROZEN in groups:
    frozen = groups[FROZEN]
    parts.append(f'{len(frozen)} frozen ({", ".join(frozen[:6])}{", ..." if len(frozen) > 6 else ""})')
  return '; '.join(parts)


def create_optimizer(config: ml_collections.ConfigDict, length: RunLength,
                     schedule: Optional[optax.Schedule] = None, numbers: Optional[Mapping[str, Any]] = None
                     ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax chain, one composition for every optimizer: a gradient goes

      frozen arrays out -> [accumulate] -> [clip] -> [L2 decay] -> the optimizer (with its
      decoupled decay, at the scheduled rate) -> x each array's rate factor (lr_multipliers x
      layer_decay) -> [freeze_after] -> [lookahead]

  sgd, adam, rmsprop and lars add `weight_decay * w` to the gradient (L2, as
  PyTorch's SGD); adamw, lamb and lion decay the weights beside their update
  (decoupled, times the learning rate), adafactor after it (per update). Only
  kernels decay, and biases and norm scales at `bias_weight_decay` (0 by
  default). With `optimizer.accumulate_steps` > 1 the chain sees the mean
  gradient of that many batches (`optax.MultiSteps`; clipping applies to the
  mean). With `optimizer.freeze` / `lr_multipliers` / `layer_decay`, see
  `with_param_groups`. Returns the optimizer and the learning rate as a
  function of the train step. `schedule` replaces the config's (the LR finder's
  sweep). With dtype=float16 the whole chain carries a dynamic loss scale
  (loss_scale.py) in its state. `numbers` (step_inputs.py; the config's when
  None) give the learning rate, decay, momentum and the others that the train
  step takes as inputs: the chain's structure comes from the config alone, so
  its state is the same for any numbers.
  """
  numbers = numbers or step_inputs.of(config, length)
  chain, schedule = _base_chain(config, length, schedule, numbers)
  accumulate = length.accumulate_steps
  if accumulate > 1:
    chain = optax.MultiSteps(chain, every_k_schedule=accumulate).gradient_transformation()
  lr_at_step = schedule if accumulate == 1 else lambda step: schedule(step // accumulate)
  groups = ParamGroups.from_config(config)
  chain = with_param_groups(chain, groups)
  if groups.freeze_after:
    chain = freeze_after(chain, [(pattern, round(epochs * length.steps_per_epoch / accumulate))
                                 for pattern, epochs in groups.freeze_after])
  opt = config.optimizer
  if opt.lookahead_every:
    total = length.total_updates
    decay = lambda update: opt.lookahead_decay * (update / total) ** opt.lookahead_decay_power
    chain = lookahead(chain, every=opt.lookahead_every, decay=decay, total_updates=total)
  if config.dtype == 'float16':
    chain = loss_scale.wrap(chain)
  return chain, lr_at_step


def with_param_groups(inner: optax.GradientTransformation,
                      groups: ParamGroups) -> optax.GradientTransformation:
  """`inner` for the trainable parameters only, its updates scaled per multiplier; frozen ones get zeros.

  The frozen parameters are masked out before `inner` sees them: gradient
  clipping measures the trainable gradients only, and no optimizer state
  (momentum, Adam moments) is kept for frozen arrays. Scaling the final
  update by a factor is scaling that parameter's learning rate, decoupled
  weight decay included. Without groups `inner` is returned unchanged, so the
  optimizer state (and existing checkpoints) keep their structure.
  """
  if not groups:
    return inner
  rates = groups.rates()
  if rates != {DEFAULT}:
    # The labels are recomputed from the (masked) tree the inner chain receives. In sorted order: the
    # set's order changes with each process's string hashing, and so would the train step's program
    # (a persistent-cache miss in every other run).
    inner = optax.chain(inner, optax.multi_transform(
        {label: optax.scale(float(label)) for label in sorted(rates)}, groups.labels))
  trainable = lambda params: jax.tree.map(lambda label: FROZEN if label == FROZEN else 'trainable',
                                          groups.labels(params))
  return optax.multi_transform({'trainable': inner, FROZEN: optax.set_to_zero()}, trainable)


# Optimizers whose weight decay is L2: added to the gradient before the optimizer sees it (as
# PyTorch's SGD, Adam and RMSprop, and LARS). The others decay the weights beside their own update.
L2_DECAY = ('sgd', 'adam', 'rmsprop', 'lars')
DEFAULT_B2 = {'lion': 0.99}  # optimizer.b2 = -1: the optimizer's own; 0.999 where not listed


def _base_chain(config: ml_collections.ConfigDict, length: RunLength, schedule: Optional[optax.Schedule],
                numbers: Mapping[str, Any]) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """[clip] -> [L2 decay] -> the optimizer (with its decoupled decay), and the schedule."""
  opt = config.optimizer
  schedule = schedule or learning_rate_schedule(config, length, numbers)
  clip = [optax.clip_by_global_norm(numbers['optimizer.grad_clip_norm'])] if opt.grad_clip_norm else []
  plateau = [plateau_scale()] if config.schedule.name == 'plateau' else []
  if opt.name in optim_contrib.CONTRIB:  # muon, schedule-free: their own decay (kernels only)
    b2 = opt.b2 if opt.b2 >= 0 else 0.999
    contrib = optim_contrib.contrib_optimizer(opt, schedule, config.model.name, decay_mask, b2)
    return optax.chain(*clip, contrib, *plateau), schedule
  if opt.name in L2_DECAY:
    return optax.chain(*clip, *_weight_decay(opt, numbers), _optimizer(opt, schedule, [], numbers),
                       *plateau), schedule
  # adamw's chain keeps its kernel decay at 0 too: the state of optax.adamw (and older checkpoints).
  return optax.chain(*clip, _optimizer(opt, schedule, _weight_decay(opt, numbers, always=True), numbers),
                     *plateau), schedule


class PlateauScaleState(NamedTuple):
  plateau_scale: jax.Array  # float32 []: the learning rate's factor, set by the loop (`set_plateau_scale`)


def plateau_scale() -> optax.GradientTransformation:
  """Multiplies the optimizer's updates (the learning rate, decoupled decay included) by a scale kept in
  its state, which the host sets after each evaluation: schedule.name=plateau."""

  def init(params):
    del params
    return PlateauScaleState(jnp.ones([], jnp.float32))

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u: u * state.plateau_scale.astype(u.dtype), updates), state

  return optax.GradientTransformation(init, update)


def set_plateau_scale(opt_state, scale: float):
  """`opt_state` with its plateau scale set to `scale`, placed (sharded) as the one it replaces."""
  old = optax.tree_utils.tree_get(opt_state, 'plateau_scale')
  full = np.full(old.shape, scale, old.dtype)
  new = jax.make_array_from_callback(old.shape, old.sharding, lambda index: full[index])
  return optax.tree_utils.tree_set(opt_state, plateau_scale=new)


def _weight_decay(opt: ml_collections.ConfigDict, numbers: Mapping[str, Any],
                  always: bool = False) -> list[optax.GradientTransformation]:
  """Kernels decay at `weight_decay` (when it is > 0, or `always`), biases and norm scales at
  `bias_weight_decay` (when it is > 0): whether is the config's, at what rate `numbers`'."""
  kernels = ([optax.add_decayed_weights(numbers['optimizer.weight_decay'], mask=decay_mask)]
             if opt.weight_decay or always else [])
  biases = ([optax.add_decayed_weights(numbers['optimizer.bias_weight_decay'], mask=bias_decay_mask)]
            if opt.bias_weight_decay else [])
  return kernels + biases


def _optimizer(opt: ml_collections.ConfigDict, schedule: optax.Schedule,
               decay: list[optax.GradientTransformation], numbers: Mapping[str, Any]
               ) -> optax.GradientTransformation:
  """`optimizer.name` as optax composes it, with `decay` (decoupled weight decay) where it puts it.

  lamb and lars scale kernels by their trust ratio and leave biases and norm
  scales unadapted, as Google's LAMB/LARS and SimCLR exclude them (optax.lamb
  adapts every array); with that, lars is optax.lars.
  """
  learning_rate = optax.scale_by_learning_rate(schedule)
  kernels_only = lambda transformation: optax.masked(transformation, decay_mask)
  # 0: no momentum (optax's None), plain SGD; otherwise the rate is an input of the step.
  momentum = numbers['optimizer.momentum'] if opt.momentum else None
  b1, eps = numbers['optimizer.b1'], numbers['optimizer.eps']
  b2 = opt.b2 if opt.b2 >= 0 else DEFAULT_B2.get(opt.name, 0.999)
  if opt.name == 'sgd':
    return optax.sgd(schedule, momentum=momentum, nesterov=opt.nesterov)
  if opt.name == 'adam':
    return optax.adam(schedule, b1=b1, b2=b2, eps=eps)
  if opt.name == 'rmsprop':
    return optax.rmsprop(schedule, decay=opt.decay, eps=eps, centered=opt.centered, momentum=momentum,
                         nesterov=opt.nesterov)
  if opt.name == 'lars':
    return optax.chain(kernels_only(optax.scale_by_trust_ratio(trust_coefficient=opt.trust_coefficient)),
                       learning_rate, optax.trace(decay=numbers['optimizer.momentum'], nesterov=opt.nesterov))
  if opt.name == 'adamw':
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), *decay, learning_rate)
  if opt.name == 'lamb':
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), *decay,
                       kernels_only(optax.scale_by_trust_ratio()), learning_rate)
  if opt.name == 'lion':
    return optax.chain(optax.scale_by_lion(b1=b1, b2=b2), *decay, learning_rate)
  if opt.name == 'adafactor':  # optax.adafactor's chain; its decay is not scaled by the learning rate
    return optax.chain(
        optax.scale_by_factored_rms(opt.factored, opt.decay_rate,
                                    min_dim_size_to_factor=opt.min_dim_size_to_factor),
        *([optax.clip_by_block_rms(opt.clipping_threshold)] if opt.clipping_threshold else []),
        optax.scale_by_learning_rate(schedule, flip_sign=False),
        *([optax.scale_by_param_block_rms()] if opt.multiply_by_parameter_scale else []),
        *decay, optax.scale(-1))
  raise ValueError(f'unknown optimizer {opt.name!r}')
