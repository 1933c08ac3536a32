"""The train metrics since the last log line, merged on the devices as each step ends.

A window holds one running clu collection and, beside it on the devices, the
offset of its first step with a NaN/Inf loss: adding a step is one small
dispatch, and reading the window (at a log line, or before a checkpoint) is one
transfer, however many steps it spans. A list of every step's metrics made
each save cost one transfer per step since the last log line, and a run with
rare log lines slow down quadratically.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _count_step(first_non_finite, count, step_metrics):
  """(the window's first NaN/Inf offset, its step count) after one more step's metrics."""
  finite = jnp.all(jnp.isfinite(step_metrics.loss.compute()))
  return jnp.where((first_non_finite < 0) & ~finite, count, first_non_finite), count + 1


@jax.jit
def _add_step(merged, first_non_finite, count, step_metrics):
  return (merged.merge(step_metrics), *_count_step(first_non_finite, count, step_metrics))


class TrainWindow:
  """The merged train metrics of the steps since the last log line (and a resumed checkpoint's own
  window, which was checked before it was saved)."""

  def __init__(self, to_host_metrics, first_step: int, restored: Any = None):
    self._to_host_metrics = to_host_metrics  # Placement.to_host_metrics
    self._start(first_step, restored)

  def _start(self, first_step: int, restored: Any = None) -> None:
    self._merged = restored
    self._first_step = first_step  # the step that the device-side offsets count from
    # Host scalars until the first step: making device ones would compile a program before the first step.
    self._first_non_finite, self._count = np.int32(-1), np.int32(0)
    self.steps_added = 0  # on the host: whether there is anything new to check

  def __bool__(self) -> bool:
    return self._merged is not None

  def add(self, step_metrics) -> None:
    if self._merged is None:
      self._merged = step_metrics
      self._first_non_finite, self._count = _count_step(self._first_non_finite, self._count, step_metrics)
    else:
      self._merged, self._first_non_finite, self._count = _add_step(
          self._merged, self._first_non_finite, self._count, step_metrics)
    self.steps_added += 1

  def merged(self):
    """The window as one host-side clu collection (None when empty)."""
    return None if self._merged is None else self._to_host_metrics(self._merged)

  def first_non_finite_step(self) -> Optional[int]:
    """The step of the first NaN/Inf loss added to the window (one transfer), or None."""
    if not self.steps_added:
      return None
    offset = int(self._first_non_finite)
    return None if offset < 0 else self._first_step + offset

  def clear(self, next_step: int) -> None:
    """Empties the window after a log line; `next_step` is the step the next one starts with."""
    self._start(next_step)
