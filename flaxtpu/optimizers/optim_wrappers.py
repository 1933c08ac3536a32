"""Wrappers around a whole optax chain: `freeze_after` (a parameter stops changing after n updates) and
Lookahead. Moved out of optim.py, which composes them; they only need the update count (`updated`)."""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


def path_name(path) -> str:
  """A key path of a parameter tree as the '/'-joined name patterns match: 'stage1_block1/Conv_0/kernel'."""
  return '/'.join(str(getattr(key, 'key', getattr(key, 'name', getattr(key, 'idx', key)))) for key in path)


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
