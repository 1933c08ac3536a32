"""The sampler a dataset names (`dataset.sampling`), wrapped for `augment.repeats`, and the names of
all samplers (the source kinds' own included, loaded on the way).

The samplers themselves are in `samplers.py`, which the source kinds import to add their
own (`register`): this module sits above the kinds and below nothing they need. Every
name of `samplers.py` is also offered here, as `flaxtpu.data.sampling` always offered it.
"""

from __future__ import annotations

from flaxtpu.data import samplers
from flaxtpu.data.dataset import Dataset, listed_train_labels
from flaxtpu.data.samplers import BALANCED_STREAM as BALANCED_STREAM
from flaxtpu.data.samplers import FLIPS_STREAM as FLIPS_STREAM
from flaxtpu.data.samplers import SAMPLERS as SAMPLERS
from flaxtpu.data.samplers import SHARD_ORDER_STREAM as SHARD_ORDER_STREAM
from flaxtpu.data.samplers import SHARD_WINDOW_STREAM as SHARD_WINDOW_STREAM
from flaxtpu.data.samplers import BalancedSampler as BalancedSampler
from flaxtpu.data.samplers import Sampler as Sampler
from flaxtpu.data.samplers import ShuffleSampler as ShuffleSampler
from flaxtpu.data.samplers import alternate_flips as alternate_flips
from flaxtpu.data.samplers import balanced_probabilities as balanced_probabilities
from flaxtpu.data.samplers import generator as generator
from flaxtpu.data.samplers import process_slice as process_slice
from flaxtpu.data.samplers import register as register
from flaxtpu.data.samplers import train_indices as train_indices


def names() -> tuple[str, ...]:
  """The registered sampler names, the kinds' own included."""
  from flaxtpu.data import sources  # pylint: disable=g-import-not-at-top
  sources.ordered()  # loads the kinds, which register their own samplers
  return tuple(SAMPLERS)


@register('balanced')
def _balanced(train, seed: int, batch_size: int, **layout) -> Sampler:
  return BalancedSampler(seed, listed_train_labels(train, 'sampling=balanced'), batch_size, **layout)


def sampler(dataset: Dataset, *, seed: int, batch_size: int, process_index: int = 0,
            process_count: int = 1) -> Sampler:
  """The `Sampler` that `dataset.sampling` names, over the train split."""
  from flaxtpu.data import repeated  # pylint: disable=g-import-not-at-top  # it subclasses Sampler
  chosen = SAMPLERS[dataset.sampling if dataset.sampling in names() else 'shuffle'](
      dataset.train, seed, batch_size, process_index=process_index, process_count=process_count)
  return repeated.repeated(chosen, dataset.repeats)  # augment.repeats


def examples_per_epoch(dataset: Dataset, batch_size: int, process_count: int = 1) -> int:
  """The train examples an epoch uses, in whole global batches: what the run length counts. Under
  shards the smallest process's share sets it; it raises the sampler's errors (too few shards)
  before anything compiles."""
  chosen = sampler(dataset, seed=0, batch_size=batch_size, process_count=process_count)
  return chosen.steps_per_epoch * batch_size


def __getattr__(name: str):
  """The samplers' other names (private ones too), as this module offered them before."""
  try:
    return getattr(samplers, name)
  except AttributeError:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}') from None
