"""Loading: the splits `config.dataset` names, from whichever source kind the registry picks
(`sources.get`), listed and checked, cached or ready to stream (`cache.py`), with the
`preprocess.Transform` that turns an image into the model's input -> a `Dataset`.

Its examples are either

- streamed: each batch is read and decoded from disk when it is needed, in
  `input.workers` grain worker processes, `input.prefetch` batches ahead; or
- cached: decoded once into host memory (`dataset.cache`: `auto` does this
  when the decoded splits fit a small share of RAM, as for CIFAR or MNIST).

A label is a class index (a split's labels are int32 [N]) or, under
`task=multilabel`, a multi-hot row (uint8 [N, C], all zeros for an image
without tags). Caching, streaming, eval padding and skip_corrupt carry
either form unchanged, so a `Batch` holds int32 [B] or uint8 [B, C] labels.
Which examples make up a step's batch is the sampler's choice
(`sampling.py`); the batches are `loaders.py`'s.

`dataset.class_weights` becomes `Dataset.class_weights` (`class_weights.py`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu.data import cache, class_weights, loaders, sources
from flaxtpu.data.dataset import Dataset, Examples, image_shape
from flaxtpu.data.preprocess import Transform
from flaxtpu.data.sources.base import DataError as DataError  # tests and callers catch it from here
from flaxtpu.data.sources.base import Source, Split
from flaxtpu.errors import UserError

DEFAULT_CROP_FRACTION = 0.875  # dataset.crop_fraction=0 without an init_from that says otherwise
STATISTICS_SAMPLE = 2_000  # images that estimate the per-channel mean/std of a streamed split


def load(config: ml_collections.ConfigDict, *, need_train: bool = True,
         class_names: Optional[Sequence[str]] = None) -> Dataset:
  """The splits named by `config.dataset`, listed (and, when cached, decoded) and checked.

  Whatever the source (`sources.get`), the classes are the training split's,
  or `class_names` (a checkpoint's, or the training split's when loading
  another eval split); a folder's eval split is matched to them by name.
  The class weights come from the train split, so only when training.
  """
  settings = config.dataset
  num_workers = input_workers(config)
  source = sources.get(settings, task=config.task)
  train_split, eval_split, class_names = source.splits(settings.train_split if need_train else None,
                                                       settings.eval_split, class_names)
  transform = image_transform(config, source.channels)
  examples, image_shape = _read(source, [split for split in (train_split, eval_split) if split is not None],
                                settings, transform, num_workers)
  train = examples[0] if need_train else None
  dataset = Dataset(
      train=train, eval=examples[-1], class_names=tuple(class_names), image_shape=image_shape,
      mean=np.zeros(source.channels, np.float32), std=np.ones(source.channels, np.float32),
      transform=transform, workers=num_workers, prefetch=config.input.prefetch,
      worker_threads=config.input.threads,
      skip_corrupt=settings.skip_corrupt, multilabel=config.task == 'multilabel',
      class_weights=None if train is None else class_weights.class_weights(settings.class_weights, train,
                                                                             class_names),
      sampling=settings.sampling)
  return _normalized(dataset, settings)


def _read(source: Source, splits: list[Split], settings: ml_collections.ConfigDict,
          transform: Transform, num_workers: int) -> tuple[list[Examples], tuple[int, int, int]]:
  """Each split decoded into memory or ready to stream (`dataset.cache`), and the shape the model
  sees."""
  channels = source.channels
  native = source.native_sizes(splits)
  if source.in_memory:
    fits = None not in native and cache.use_cache(settings.cache, _count(*splits),
                                             (*next(iter(native)), channels), transform)
    examples = [Examples(None, *source.arrays(split, fits), groups=split.groups) for split in splits]
    return examples, image_shape(native, transform, channels)
  use = cache.use_cache(settings.cache, _count(*splits), image_shape(native, transform, channels), transform)
  if not use:  # streamed: every header now, so sizes and unreadable files show before step 1
    checked = [source.checked(split, num_workers, settings.skip_corrupt) for split in splits]
    splits, native = [split for split, _ in checked], set().union(*(sizes for _, sizes in checked))
  shape = image_shape(native, transform, channels)
  return [cache.examples(split, cache=use, transform=transform, num_workers=num_workers,
                    skip_corrupt=settings.skip_corrupt) for split in splits], shape


def _normalized(dataset: Dataset, settings: ml_collections.ConfigDict) -> Dataset:
  """The dataset with its standardisation numbers: the train split's (`standardize`) or the config's
  (`fixed`; an RGB model's three numbers averaged for 1-channel images, in the config too)."""
  if settings.normalize == 'standardize' and dataset.train is not None:
    mean, std = _statistics(dataset)
    return dataclasses.replace(dataset, mean=mean, std=std)
  if settings.normalize == 'fixed':
    if dataset.image_shape[-1] == 1 and len(settings.mean) == 3:  # an RGB model's numbers, grayscale images
      settings.mean, settings.std = ((float(np.mean(settings[key])),) for key in ('mean', 'std'))
      logging.info('dataset.mean/std: the colour channels\' averages for 1-channel images, %.3f/%.3f',
                   settings.mean[0], settings.std[0])
    return dataclasses.replace(dataset, mean=np.asarray(settings.mean, np.float32),
                               std=np.asarray(settings.std, np.float32))
  return dataset


def load_eval_splits(config: ml_collections.ConfigDict, dataset: Dataset) -> list[tuple[str, Dataset]]:
  """(split, Dataset) for each of `dataset.eval_splits`, the splits evaluated besides `eval_split`.

  Each is read like the eval split (same transform, cache rule and checks)
  and must hold the classes of `dataset`.
  """
  loaded = []
  for split in config.dataset.eval_splits:
    split_config = copy.deepcopy(config)
    split_config.dataset.eval_split = split
    other = load(split_config, need_train=False, class_names=dataset.class_names)
    if other.class_names != dataset.class_names or other.image_shape != dataset.image_shape:
      raise UserError(f'config.dataset.eval_splits entry {split!r} has classes '
                      f'{list(other.class_names)[:5]} of {other.image_shape} images, unlike the eval split '
                      f'({list(dataset.class_names)[:5]}, {dataset.image_shape}); list splits of the same '
                      'dataset')
    logging.info('eval split %r: %d examples', split, len(other.eval))
    loaded.append((split, other))
  return loaded


def _count(*splits: Optional[Split]) -> int:
  return sum(len(split) for split in splits if split is not None)


def image_transform(config: ml_collections.ConfigDict, channels: int) -> Transform:
  return Transform(size=config.dataset.image_size, channels=channels,
                   crop_area=tuple(config.augment.crop_area),
                   crop_aspect=tuple(config.augment.crop_aspect),
                   crop_fraction=config.dataset.crop_fraction or DEFAULT_CROP_FRACTION)


def input_workers(config: ml_collections.ConfigDict) -> int:
  """`input.workers`, where -1 means one per core but one (the training loop's), at most 32."""
  if config.input.workers >= 0:
    return config.input.workers
  return min(max((os.cpu_count() or 1) - 1, 1), 32)


def _statistics(dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean/std in [0, 1] of the train split: all of a cached uniform split, else a sample."""
  train = dataset.train
  if train.cached and isinstance(train.images, np.ndarray):
    pixels = train.images.reshape(-1, train.images.shape[-1])
    pixels = pixels[:: max(1, len(pixels) // 2_000_000)].astype(np.float32) / 255.0
  else:
    images = loaders.train_sample(dataset, STATISTICS_SAMPLE)
    pixels = np.concatenate([i.reshape(-1, i.shape[-1]) for i in images]).astype(np.float32) / 255.0
  return pixels.mean(axis=0), pixels.std(axis=0) + 1e-6
