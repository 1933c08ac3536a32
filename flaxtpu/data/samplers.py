"""Samplers: which examples make up each step's global batch, picked by name (`dataset.sampling`).

- shuffle: positions `[s mod epoch]` of the seeded permutation of epoch
  `s // steps_per_epoch`;
- balanced: each epoch draws as many examples as shuffle would use, with
  replacement, every class equally likely (`balanced_probabilities`);
- shards: registered by the tar shards (`sources/shards.py`): process p of P
  streams its own shards.

A new sampler is a `Sampler` subclass and a factory registered under its name
(`register`). Every sampler is a pure function of (seed, step), so a resumed
run or another worker count sees exactly the same batches.

`sampling.py` picks the sampler a dataset names; this module holds the samplers and their registry,
below the source kinds that add their own.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np

from flaxtpu.data.sources.base import DataError

# Spawn keys of the seed sequences drawn from `seed`, one per stream, so no two ever coincide
# (the shuffle permutations use the plain sequence [seed, epoch]).
FLIPS_STREAM, BALANCED_STREAM, SHARD_ORDER_STREAM, SHARD_WINDOW_STREAM, CROPS_STREAM = 1, 2, 3, 4, 5

# name -> factory(train Examples, seed, batch_size, process_index=, process_count=) -> Sampler
SAMPLERS: dict[str, Callable] = {}


def register(name: str) -> Callable:
  """A decorator that registers a sampler factory under `name` (dataset.sampling)."""
  def add(factory: Callable) -> Callable:
    SAMPLERS[name] = factory
    return factory
  return add


def process_slice(global_batch_size: int, process_index: int, process_count: int) -> slice:
  """This process's rows of a global batch (contiguous, as the batch sharding lays them out).

  `placing.place` has checked that the batch divides over the devices, hence the processes.
  """
  per_process = global_batch_size // process_count
  return slice(process_index * per_process, (process_index + 1) * per_process)


def generator(seed: int, stream: int, *key: int) -> np.random.Generator:
  """A generator for one stream of randomness (`*_STREAM`): its own seed sequence (a spawn key),
  apart from every other stream and from the epochs' permutations."""
  return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream, *key)))


class Sampler:
  """Which examples fill this process's rows of each step's global batch.

  A pure function of (seed, step) -- and, for shards, of the process layout --
  so a resumed run continues exactly where it stopped. A subclass orders one
  epoch (`_epoch_order`); the base class cuts it into batches and keeps the
  latest epoch's order, which consecutive steps share. It is pickled into the
  input workers, each of which then orders an epoch once.
  """

  def __init__(self, seed: int, num_examples: int, batch_size: int, process_index: int = 0,
               process_count: int = 1):
    self.seed, self.num_examples, self.batch_size = seed, num_examples, batch_size
    self.rows = process_slice(batch_size, process_index, process_count)
    self.steps_per_epoch = num_examples // batch_size
    if not self.steps_per_epoch:
      raise DataError(f'config.batch_size={batch_size} is larger than the train split ({num_examples} '
                      'examples); lower the batch size')
    self._latest: tuple[int, Optional[np.ndarray]] = (-1, None)

  @property
  def local_batch_size(self) -> int:
    return self.rows.stop - self.rows.start

  def indices(self, step: int) -> np.ndarray:
    """The examples of this process's rows of `step`'s global batch."""
    epoch, position = divmod(step, self.steps_per_epoch)
    if self._latest[0] != epoch:
      self._latest = (epoch, self._epoch_order(epoch))
    return self._batch(self._latest[1], position)

  def mirrored(self, step: int, indices: np.ndarray) -> np.ndarray:
    """`augment.alternate_flip`: whether each of `indices` (this step's) is mirrored: a seeded half
    of the examples in even epochs, the other half in odd ones (`alternate_flips`). An example
    drawn in two consecutive epochs is shown both ways, whichever the sampler."""
    odd_epoch = step // self.steps_per_epoch % 2 == 1
    return _first_epoch_flips(self.seed, self.num_examples)[indices] ^ odd_epoch

  def _epoch_order(self, epoch: int) -> np.ndarray:
    """The global batches of `epoch` one after the other (example indices)."""
    raise NotImplementedError

  def _batch(self, order: np.ndarray, position: int) -> np.ndarray:
    return order[position * self.batch_size:(position + 1) * self.batch_size][self.rows]


class ShuffleSampler(Sampler):
  """Every example once an epoch, in the seeded permutation of (seed, epoch)."""

  def _epoch_order(self, epoch):
    return _epoch_permutation(self.seed, epoch, self.num_examples)


@functools.lru_cache(maxsize=2)
def _epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def train_indices(seed: int, step: int, num_examples: int, batch_size: int) -> np.ndarray:
  """Indices of the global batch for `step` under shuffle: epoch `step // steps_per_epoch` of a
  seeded shuffle."""
  return ShuffleSampler(seed, num_examples, batch_size).indices(step)


def alternate_flips(seed: int, step: int, num_examples: int, batch_size: int) -> np.ndarray:
  """Which images of `step`'s global batch under shuffle are mirrored by `augment.alternate_flip`
  (bool per row; `Sampler.mirrored`).

  A seeded half of the split in even epochs and the other half in odd ones:
  every image is seen both ways in any two consecutive epochs, where a coin
  per view repeats a side for half of them (airbench's alternating flip).
  """
  shuffle = ShuffleSampler(seed, num_examples, batch_size)
  return shuffle.mirrored(step, shuffle.indices(step))


@functools.lru_cache(maxsize=2)
def _first_epoch_flips(seed: int, num_examples: int) -> np.ndarray:
  return generator(seed, FLIPS_STREAM).random(num_examples) < 0.5


class BalancedSampler(Sampler):
  """An epoch draws the examples of `steps_per_epoch` batches with replacement, each with
  `balanced_probabilities`: the classes come up equally often, a rare class's examples repeatedly."""

  def __init__(self, seed, labels, batch_size, process_index=0, process_count=1):
    super().__init__(seed, len(labels), batch_size, process_index, process_count)
    self.cumulative = np.cumsum(balanced_probabilities(labels))

  def _epoch_order(self, epoch):
    # Inverse-CDF draws from sorted uniforms, then put in a random order (i.i.d. draws stay i.i.d.):
    # the look-ups then walk the table in order, several times faster on a million examples than
    # Generator.choice's random ones.
    draws = generator(self.seed, BALANCED_STREAM, epoch)
    uniforms = np.sort(draws.random(self.steps_per_epoch * self.batch_size)) * self.cumulative[-1]
    drawn = np.minimum(np.searchsorted(self.cumulative, uniforms, side='right'), self.num_examples - 1)
    return draws.permutation(drawn)


def balanced_probabilities(labels: np.ndarray) -> np.ndarray:
  """Each example's chance per draw such that every class present comes up equally often.

  Class indices: 1 / (its class's count), so each class's examples together
  weigh the same and a class absent from the split simply never comes up.
  Multi-hot rows: 1 / (the count of the row's rarest tag), the largest of its
  tags' rates, as LVIS's repeat-factor sampling takes the max: a row that
  carries a rare tag is drawn as often as that tag needs, where a mean would
  dilute it by the common tags beside it (every rare "unicycle" photo also
  shows a "person"). Common tags then come up somewhat more than rare ones,
  riding along; exactly equally when every row has one tag. Rows without a
  tag are a group of their own, drawn as often as one class.
  """
  if labels.ndim == 1:
    weights = 1.0 / np.bincount(labels)[labels]
  else:
    counts = labels.sum(axis=0, dtype=np.int64)
    rows, tags = np.nonzero(labels)  # row-major: each row's tags are consecutive
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if len(rows) else np.zeros(0, int)
    rarest = np.zeros(len(labels), np.int64)
    if len(rows):
      rarest[rows[starts]] = np.minimum.reduceat(counts[tags], starts)
    untagged = rarest == 0
    rarest[untagged] = untagged.sum()
    weights = 1.0 / rarest
  return weights / weights.sum()


@register('shuffle')
def _shuffle(train, seed: int, batch_size: int, **layout) -> Sampler:
  return ShuffleSampler(seed, len(train), batch_size, **layout)
