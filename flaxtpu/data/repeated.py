"""Repeated augmentation (`augment.repeats`; Hoffer et al. 2019, DeiT; timm's RASampler): each step's
global batch holds `batch_size / repeats` distinct examples, each `repeats` times.

Copy k of the batch's distinct examples fills rows [k * U, (k + 1) * U) (U =
batch_size / repeats): the copies sit far apart, so the mixup/CutMix partner
of a row (its neighbour) is never its own copy, and with `repeats` processes
each holds one copy of every example, as timm's sampler spreads them over its
replicas. Each copy is augmented on its own: the host's random-resized crop
and the device's draws are keyed by the row's position in the global batch.

The epoch keeps its number of steps (timm's choice): it uses the first
`steps_per_epoch * U` examples of the wrapped sampler's epoch order, so an
epoch shows 1 / repeats of the split, each example `repeats` times. Like every
sampler it is a pure function of (seed, step), and another process count sees
the same global batches.
"""

from __future__ import annotations

import numpy as np

from flaxtpu.data.samplers import Sampler


class RepeatedSampler(Sampler):
  """`inner`'s epoch order, cut into batches of `batch_size / repeats` examples, each tiled `repeats`
  times."""

  def __init__(self, inner: Sampler, repeats: int):
    super().__init__(inner.seed, inner.num_examples, inner.batch_size)
    self.rows, self.inner, self.repeats = inner.rows, inner, repeats
    if inner.batch_size % repeats or inner.batch_size // repeats < 2:
      raise ValueError(f'batch size {inner.batch_size} must be a multiple of {repeats} repeats, with >= 2 '
                       'distinct examples')

  @property
  def distinct(self) -> int:
    """Distinct examples per global batch."""
    return self.batch_size // self.repeats

  def _epoch_order(self, epoch: int) -> np.ndarray:
    return self.inner._epoch_order(epoch)  # pylint: disable=protected-access

  def _batch(self, order: np.ndarray, position: int) -> np.ndarray:
    unique = order[position * self.distinct:(position + 1) * self.distinct]
    return np.tile(unique, self.repeats)[self.rows]


def repeated(chosen: Sampler, repeats: int) -> Sampler:
  """`chosen` itself at repeats <= 1, else wrapped in a `RepeatedSampler`."""
  return chosen if repeats <= 1 else RepeatedSampler(chosen, repeats)
