"""Loading: the splits a `DatasetSpec` (`spec.py`, resolved once from the config) names, from
whichever source kind the registry picks
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

import dataclasses
import logging
from typing import Callable, Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu.augmentation import image_sizes
from flaxtpu.data import cache, class_weights, loaders, sources
from flaxtpu.data.dataset import Dataset, Examples, image_shape
from flaxtpu.data.preprocess import Transform
from flaxtpu.data.sources.base import DataError as DataError  # tests and callers catch it from here
from flaxtpu.data.sources.base import Source, Split
from flaxtpu.data.spec import DatasetSpec, fixed_normalization
from flaxtpu.settings.errors import UserError

DEFAULT_CROP_FRACTION = 0.875  # dataset.crop_fraction=0 without an init_from that says otherwise
STATISTICS_SAMPLE = 2_000  # images that estimate the per-channel mean/std of a streamed split


def load(config: ml_collections.ConfigDict | DatasetSpec, *, need_train: bool = True,
         class_names: Optional[Sequence[str]] = None,
         on_listed: Optional[Callable[[Dataset], None]] = None) -> Dataset:
  """The splits a config (or a `DatasetSpec`) names, listed (and, when cached, decoded) and checked.

  Whatever the source (`sources.get`), the classes are the training split's,
  or `class_names` (a checkpoint's, or the training split's when loading
  another eval split); a folder's eval split is matched to them by name.
  The class weights come from the train split, so only when training. The
  config is only read: the numbers the data is normalised with are the
  returned Dataset's `mean`/`std`.

  `on_listed` is called with the Dataset as listed, before any image is decoded into memory: its
  splits streamed (`Examples(source)`), everything else as returned later. Not where numbers come
  from the pixels or the labels (`normalize=standardize`, `class_weights`).
  """
  spec = DatasetSpec.of(config)
  source = sources.get(spec)
  train_split, eval_split, class_names = source.splits(spec.train_split if need_train else None,
                                                       spec.eval_split, class_names)
  transform = image_transform(spec, source.channels)
  eval_transform = image_sizes.eval_transform(transform, spec.eval_image_size, spec.eval_crop_fraction)

  def dataset_of(train: Optional[Examples], eval_examples: Examples, shape: tuple[int, int, int]) -> Dataset:
    return _normalized(Dataset(
        train=train, eval=eval_examples, class_names=tuple(class_names), image_shape=shape,
        mean=np.zeros(source.channels, np.float32), std=np.ones(source.channels, np.float32),
        transform=transform, workers=spec.workers, prefetch=spec.prefetch, worker_threads=spec.threads,
        skip_corrupt=spec.skip_corrupt, multilabel=spec.task == 'multilabel',
        class_weights=None if train is None else class_weights.class_weights(spec.class_weights, train,
                                                                               class_names),
        sampling=spec.sampling, repeats=spec.repeats,
        eval_transform=None if eval_transform is transform else eval_transform), spec)

  def listed(shape: tuple[int, int, int]) -> None:
    if on_listed is not None and spec.normalize != 'standardize' and spec.class_weights == 'none':
      train = None if train_split is None else Examples(train_split)
      on_listed(dataset_of(train, Examples(eval_split), shape))
  examples, shape = _read(source, [split for split in (train_split, eval_split) if split is not None],
                          spec, transform, eval_transform, listed)
  return dataset_of(examples[0] if need_train else None, examples[-1], shape)


def _read(source: Source, splits: list[Split], spec: DatasetSpec, transform: Transform,
          eval_transform: Transform,
          listed: Callable[[tuple[int, int, int]], None]) -> tuple[list[Examples], tuple[int, int, int]]:
  """Each split decoded into memory or ready to stream (`dataset.cache`; the eval split, the last,
  cached for `eval_transform`), and the shape the model sees in training; `listed(shape)` once the
  shape is known, before any decoding."""
  channels = source.channels
  native = source.native_sizes(splits)
  if source.in_memory:
    fits = None not in native and cache.use_cache(spec.cache, _count(*splits),
                                                  (*next(iter(native)), channels), transform)
    shape = image_shape(native, transform, channels)
    listed(shape)
    examples = [Examples(None, *source.arrays(split, fits), groups=split.groups) for split in splits]
    return examples, shape
  use = cache.use_cache(spec.cache, _count(*splits), image_shape(native, transform, channels), transform)
  if not use:  # streamed: every header now, so sizes and unreadable files show before step 1
    checked = [source.checked(split, spec.workers, spec.skip_corrupt) for split in splits]
    splits, native = [split for split, _ in checked], set().union(*(sizes for _, sizes in checked))
  shape = image_shape(native, transform, channels)
  if use:
    listed(shape)
  transforms = [transform] * (len(splits) - 1) + [eval_transform if transform.size else transform]
  store = spec.settings.get('decoded_cache_dir', '')  # absent from the configs of older runs
  return [cache.examples(split, cache=use, transform=each, num_workers=spec.workers,
                         skip_corrupt=spec.skip_corrupt, threads=spec.threads, store=store)
          for split, each in zip(splits, transforms)], shape


def _normalized(dataset: Dataset, spec: DatasetSpec) -> Dataset:
  """The dataset with its standardisation numbers: the train split's (`standardize`) or the spec's
  (`fixed`; an RGB model's three numbers averaged for 1-channel images)."""
  if spec.normalize == 'standardize' and dataset.train is not None:
    mean, std = _statistics(dataset)
    return dataclasses.replace(dataset, mean=mean, std=std)
  if spec.normalize == 'fixed':
    mean, std = fixed_normalization(spec, dataset.image_shape[-1])
    if len(mean) != len(spec.mean):  # an RGB model's numbers, grayscale images
      logging.info('dataset.mean/std: the colour channels\' averages for 1-channel images, %.3f/%.3f',
                   mean[0], std[0])
    return dataclasses.replace(dataset, mean=np.asarray(mean, np.float32), std=np.asarray(std, np.float32))
  return dataset


def load_eval_splits(config: ml_collections.ConfigDict | DatasetSpec,
                     dataset: Dataset) -> list[tuple[str, Dataset]]:
  """(split, Dataset) for each of `dataset.eval_splits`, the splits evaluated besides `eval_split`.

  Each is read like the eval split (same transform, cache rule and checks: the run's spec with
  another eval_split) and must hold the classes of `dataset`.
  """
  spec = DatasetSpec.of(config)
  loaded = []
  for split in spec.eval_splits:
    other = load(spec.replace(eval_split=split), need_train=False, class_names=dataset.class_names)
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


def image_transform(config: ml_collections.ConfigDict | DatasetSpec, channels: int) -> Transform:
  """How an image becomes the model's input: the spec's size, crops and crop fraction."""
  spec = DatasetSpec.of(config)
  return Transform(size=spec.image_size, channels=channels, crop_area=spec.crop_area,
                   crop_aspect=spec.crop_aspect, crop_fraction=spec.crop_fraction or DEFAULT_CROP_FRACTION)


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
