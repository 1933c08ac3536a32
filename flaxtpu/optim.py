"""The optax optimizer and learning-rate schedule that a config describes."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from flaxtpu.config import RunLength, parse_freeze_after, parse_lr_multipliers
from flaxtpu.errors import UserError

FROZEN = 'frozen'  # the label of parameters that get no update and no optimizer state
DEFAULT = repr(1.0)  # the label of parameters at the peak learning rate


def learning_rate_schedule(config: ml_collections.ConfigDict, length: RunLength) -> optax.Schedule:
  """constant | cosine | linear (each after a linear warmup from 0) | onecycle, over optimizer updates.

  With gradient accumulation an update takes `accumulate_steps` batches; the
  schedule's argument is the update count (what optax's inner state counts).
  """
  peak = config.optimizer.learning_rate
  total = length.total_updates
  warmup = length.warmup_steps // length.accumulate_steps
  warmup = min(max(warmup, 1) if length.warmup_steps else 0, total - 1)  # a warmup asked for is never lost
  final = peak * config.schedule.final_lr_fraction
  name = config.schedule.name
  if name == 'onecycle':
    # Warm up for warmup_epochs (30% of the run when 0), then anneal to ~0.
    pct_start = warmup / total if warmup else 0.3
    return optax.cosine_onecycle_schedule(total, peak, pct_start=pct_start)
  if name == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total, final)
  decay_steps = max(1, total - warmup)
  after_warmup = (optax.constant_schedule(peak) if name == 'constant'
                  else optax.linear_schedule(peak, final, decay_steps))
  if not warmup:
    return after_warmup
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after_warmup], [warmup])


def decay_mask(params):
  """`optimizer.weight_decay` applies to kernels only (ndim > 1)."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def bias_decay_mask(params):
  """`optimizer.bias_weight_decay` applies to biases and normalisation scales (ndim <= 1)."""
  return jax.tree.map(lambda p: p.ndim <= 1, params)


def path_name(path) -> str:
  """A key path of a parameter tree as the '/'-joined name patterns match: 'stage1_block1/Conv_0/kernel'."""
  return '/'.join(str(getattr(key, 'key', getattr(key, 'name', getattr(key, 'idx', key)))) for key in path)


def named_leaves(tree) -> dict[str, Any]:
  """{'/'-joined path: leaf} of a parameter (or BatchNorm statistics) tree."""
  return {path_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@dataclasses.dataclass(frozen=True)
class ParamGroups:
  """Which parameters train at which learning rate: `optimizer.freeze` and `optimizer.lr_multipliers`.

  Patterns are regexes searched (`re.search`) in '/'-joined parameter paths.
  Freezing wins over multipliers; among multipliers the first matching one
  wins. A multiplier of 0 is a freeze (no update, no optimizer state, BatchNorm
  statistics kept), so both give the same parameters bit for bit.
  """
  freeze: tuple[str, ...] = ()
  multipliers: tuple[tuple[str, float], ...] = ()
  freeze_after: tuple[tuple[str, float], ...] = ()  # (pattern, epochs): trained that long, then frozen

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> 'ParamGroups':
    return cls(freeze=tuple(config.optimizer.freeze),
               multipliers=tuple(parse_lr_multipliers(config.optimizer.lr_multipliers)),
               freeze_after=tuple(parse_freeze_after(config.optimizer.freeze_after)))

  def __bool__(self) -> bool:
    return bool(self.freeze or self.multipliers or self.freeze_after)

  def label(self, name: str) -> str:
    """FROZEN, or the learning-rate multiplier as a string ('0.1'; DEFAULT = '1.0')."""
    if any(re.search(pattern, name) for pattern in self.freeze):
      return FROZEN
    for pattern, factor in self.multipliers:
      if re.search(pattern, name):
        return FROZEN if factor == 0 else repr(float(factor))
    return DEFAULT

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
  parts = [f'{len(names)} arrays at lr x{label}' for label, names in groups.items() if label != FROZEN]
  if FROZEN in groups:
    frozen = groups[FROZEN]
    parts.append(f'{len(frozen)} frozen ({", ".join(frozen[:6])}{", ..." if len(frozen) > 6 else ""})')
  return '; '.join(parts)


def create_optimizer(config: ml_collections.ConfigDict,
                     length: RunLength) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax chain: [clip] -> [L2 / decoupled decay] -> sgd|adam|adamw with the schedule [-> lookahead].

  sgd and adam add `weight_decay * w` to the gradient (classic L2, as in
  PyTorch's SGD); adamw decays the weights after the Adam update (decoupled).
  Biases and norm scales decay at `bias_weight_decay` (0 by default).
  With `optimizer.accumulate_steps` > 1 the chain sees the mean gradient of
  that many batches (`optax.MultiSteps`; clipping applies to the mean). With
  `optimizer.freeze` / `optimizer.lr_multipliers`, see `with_param_groups`.
  Returns the optimizer and the learning rate as a function of the train step.
  """
  chain, schedule = _base_chain(config, length)
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
  return chain, lr_at_step


def updated(optimizer_state) -> jax.Array:
  """Whether the step that produced `optimizer_state` changed the parameters (False while accumulating)."""
  for node in jax.tree.leaves(optimizer_state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState)):
    if isinstance(node, optax.MultiStepsState):
      return node.mini_step == 0
  return jax.numpy.bool_(True)


class FreezeAfterState(NamedTuple):
  inner: Any  # the wrapped optimizer's state
  updates: jax.Array  # optimizer updates so far (accumulating batches do not count)


def freeze_after(inner: optax.GradientTransformation,
                 stops: list[tuple[str, int]]) -> optax.GradientTransformation:
  """`inner`, but a parameter matching a (pattern, n) of `stops` (the first that matches) keeps its
  first n updates and then stops changing (airbench trains its whitening bias for 3 epochs only).

  Its optimizer state keeps running, unused: the parameter only stops moving.
  Under Lookahead (which wraps this) the first sync after the stop still
  moves it once, to its slow weight, as in airbench.
  """
  def limit(path) -> int | None:
    name = path_name(path)
    return next((updates for pattern, updates in stops if re.search(pattern, name)), None)

  def init(params):
    return FreezeAfterState(inner.init(params), jnp.zeros((), jnp.int32))

  def update(grads, state, params=None):
    updates, inner_state = inner.update(grads, state.inner, params)
    count = state.updates + updated(inner_state).astype(jnp.int32)  # this update's number, from 1

    def stop(path, update):
      last = limit(path)
      return update if last is None else jnp.where(count <= last, update, jnp.zeros_like(update))

    return jax.tree_util.tree_map_with_path(stop, updates), FreezeAfterState(inner_state, count)

  return optax.GradientTransformation(init, update)


class LookaheadState(NamedTuple):
  inner: Any  # the wrapped optimizer's state
  slow: Any  # the slow weights (taken from the parameters at the first update)
  updates: jax.Array  # optimizer updates so far (accumulating batches do not count)


def lookahead(inner: optax.GradientTransformation, *, every: int, decay: Callable[[jax.Array], jax.Array],
              total_updates: int) -> optax.GradientTransformation:
  """Lookahead around `inner`: every `every` updates, and at the last, slow += (1 - decay(n)) (fast - slow)
  and the parameters become the slow weights; between syncs `inner`'s updates pass unchanged.

  It wraps the whole optimizer (learning-rate multipliers and freezing
  included), so the sync sees the weights each update produced. The slow
  weights start from the parameters at the first update, not at `init`: a
  fine-tuning run loads its weights after the optimizer state is built.
  """
  def init(params):
    return LookaheadState(inner.init(params), jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))

  def update(grads, state, params):
    updates, inner_state = inner.update(grads, state.inner, params)
    did_update = updated(inner_state)
    count = state.updates + did_update.astype(jnp.int32)
    slow = jax.tree.map(lambda s, p: jnp.where(state.updates == 0, p, s), state.slow, params)
    sync = did_update & ((count % every == 0) | (count == total_updates))
    keep = decay(count)
    fast = optax.apply_updates(params, updates)
    synced = jax.tree.map(lambda s, f: s + (1.0 - keep) * (f - s), slow, fast)
    updates = jax.tree.map(lambda u, new, p: jnp.where(sync, new - p, u), updates, synced, params)
    slow = jax.tree.map(lambda new, s: jnp.where(sync, new, s), synced, slow)
    return updates, LookaheadState(inner_state, slow, count)

  return optax.GradientTransformation(init, update)


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
  factors = {repr(float(factor)) for _, factor in groups.multipliers if factor} | {DEFAULT}
  if factors != {DEFAULT}:
    # The labels are recomputed from the (masked) tree the inner chain receives.
    inner = optax.chain(inner, optax.multi_transform(
        {label: optax.scale(float(label)) for label in factors}, groups.labels))
  trainable = lambda params: jax.tree.map(lambda label: FROZEN if label == FROZEN else 'trainable',
                                          groups.labels(params))
  return optax.multi_transform({'trainable': inner, FROZEN: optax.set_to_zero()}, trainable)


def _base_chain(config: ml_collections.ConfigDict,
                length: RunLength) -> tuple[optax.GradientTransformation, optax.Schedule]:
  opt = config.optimizer
  schedule = learning_rate_schedule(config, length)
  chain = []
  if opt.grad_clip_norm:
    chain.append(optax.clip_by_global_norm(opt.grad_clip_norm))
  kernel_decay = optax.add_decayed_weights(opt.weight_decay, mask=decay_mask)
  bias_decay = ([optax.add_decayed_weights(opt.bias_weight_decay, mask=bias_decay_mask)]
                if opt.bias_weight_decay else [])
  if opt.name == 'adamw':  # optax.adamw's own chain (same state), with the bias decay beside the kernels'
    chain.append(optax.chain(optax.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps), kernel_decay,
                             *bias_decay, optax.scale_by_learning_rate(schedule)))
  else:
    chain += ([kernel_decay] if opt.weight_decay else []) + bias_decay
    if opt.name == 'sgd':
      chain.append(optax.sgd(schedule, momentum=opt.momentum or None, nesterov=opt.nesterov))
    else:
      chain.append(optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps))
  return optax.chain(*chain), schedule
