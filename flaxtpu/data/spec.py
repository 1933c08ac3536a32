"""The dataset spec: what the input side reads from a config, resolved once and frozen.

`DatasetSpec.of(config)` takes `config.dataset` (every key, a plug-in kind's
included), `task` and the `input` and crop settings the pipeline needs. The
pipeline reads the spec and never writes into the config; a second dataset
(an extra eval split, a few-shot set) is `spec.replace(...)` of the run's, so
nothing else of the config comes along. No JAX, no numpy, no pipeline here:
the memory estimate and config checks read it before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

MAX_INPUT_WORKERS = 32  # input.workers=-1: one per core but one (the training loop's), at most this


def input_workers(workers: int) -> int:
  """`input.workers`, where -1 means one per core but one (the training loop's), at most 32."""
  if workers >= 0:
    return workers
  return min(max((os.cpu_count() or 1) - 1, 1), MAX_INPUT_WORKERS)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """One dataset as the pipeline reads it.

  `settings` is config.dataset frozen (attribute access as on the config: the source kinds read
  their own keys from it). `workers` is `input.workers` resolved (-1 -> per core).
  """
  settings: ml_collections.FrozenConfigDict
  task: str = 'multiclass'
  workers: int = 0
  prefetch: int = 2
  threads: bool = False
  crop_area: tuple = (0.08, 1.0)
  crop_aspect: tuple = (0.75, 4 / 3)
  repeats: int = 1  # augment.repeats
  eval_image_size: int = 0  # eval.image_size: the eval split read at this size (0 = image_size's)
  eval_crop_fraction: float = 0.0  # eval.crop_fraction

  @classmethod
  def of(cls, config: ml_collections.ConfigDict | DatasetSpec) -> DatasetSpec:
    """The spec of a whole config (a spec is returned as it is)."""
    if isinstance(config, DatasetSpec):
      return config
    return cls(settings=ml_collections.FrozenConfigDict(config.dataset), task=config.task,
               workers=input_workers(config.input.workers), prefetch=config.input.prefetch,
               threads=config.input.threads, crop_area=tuple(config.augment.crop_area),
               crop_aspect=tuple(config.augment.crop_aspect), repeats=config.augment.get('repeats', 1),
               eval_image_size=config.eval.image_size, eval_crop_fraction=config.eval.crop_fraction)

  def __getattr__(self, key: str) -> Any:
    # spec.train_split, spec.cache, ...: the dataset keys read as on config.dataset.
    if key.startswith('__') or key == 'settings':
      raise AttributeError(key)
    try:
      return self.settings[key]
    except KeyError:
      raise AttributeError(f'the dataset spec has no key {key!r}') from None

  def replace(self, **changes: Any) -> DatasetSpec:
    """This spec with dataset keys (e.g. eval_split) or spec fields (task, workers, ...) changed."""
    fields = {field.name for field in dataclasses.fields(self)} - {'settings'}
    settings = {key: value for key, value in changes.items() if key not in fields}
    unknown = [key for key in settings if key not in self.settings]
    if unknown:
      raise KeyError(f'the dataset spec has no key {unknown[0]!r}')
    merged = ml_collections.FrozenConfigDict({**self.settings.as_configdict().to_dict(), **settings})
    return dataclasses.replace(self, settings=merged,
                               **{key: value for key, value in changes.items() if key in fields})

  def with_source(self, **keys: Any) -> DatasetSpec:
    """Another dataset: every key that selects a source kind cleared, then `keys` set (e.g.
    folder=PATH, or name=NAME), so nothing of the run's own source carries over."""
    from flaxtpu.data import sources  # pylint: disable=g-import-not-at-top  # the kinds' keys
    cleared = {key: '' for key in ('folder', 'name', *(kind.key for kind in sources.keyed()))
               if key in self.settings}
    return self.replace(**{**cleared, **keys})


def fixed_normalization(settings, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """normalize=fixed: (mean, std) as given, or an RGB model's three numbers averaged for
  1-channel images."""
  mean, std = tuple(settings.mean), tuple(settings.std)
  if channels == 1 and len(mean) == 3:
    mean, std = ((sum(float(v) for v in values) / 3,) for values in (mean, std))
  return mean, std


def saved_config(config: ml_collections.ConfigDict, channels: int) -> dict:
  """The config as a run saves it (config.json, the checkpoint record, HParams): the
  normalisation numbers the data was read with (`fixed_normalization`) in dataset.mean/std."""
  saved = config.to_dict()
  if config.dataset.normalize == 'fixed':
    mean, std = fixed_normalization(config.dataset, channels)
    if (mean, std) != (tuple(config.dataset.mean), tuple(config.dataset.std)):
      saved['dataset'] = {**saved['dataset'], 'mean': mean, 'std': std}
  return saved
