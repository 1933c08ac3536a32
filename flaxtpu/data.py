"""The input pipeline: batches as a pure function of (seed, step), decoded in worker processes.

A dataset is a train and an eval split (from whichever source `sources.get`
picks) and the `preprocess.Transform` that turns an image into the
model's input. Its examples are either

- streamed: each batch is read and decoded from disk when it is needed, in
  `input.workers` grain worker processes, `input.prefetch` batches ahead; or
- cached: decoded once into host memory (`dataset.cache`: `auto` does this
  when the decoded splits fit a small share of RAM, as for CIFAR or MNIST).

Either way the global batch of step `s` holds the examples at positions
`[s mod epoch]` of the seeded permutation of epoch `s // steps_per_epoch`,
and example `p` of it is augmented with a generator seeded by
(seed, s, p). So a resumed run, another worker count or another process
count sees exactly the same batches, and each process reads and decodes only
its own rows. Evaluation covers the split once, the last batch padded and
masked.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import sys
from typing import Iterator, NamedTuple, Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu import preprocess, sources, workers
from flaxtpu.errors import UserError
from flaxtpu.preprocess import IMAGE_EXTENSIONS, Transform
from flaxtpu.sources import DataError
from flaxtpu.sources import printable as printable  # evaluate.py names files with data.printable

# The decoded splits may take this share of host memory before `dataset.cache=auto` streams.
CACHE_MEMORY_FRACTION = 1 / 8
CACHE_MAX_BYTES = 4 * 2**30
CACHE_CHUNK = 500  # images per cache-decoding task: a hand-over to a worker costs several small decodes
DEFAULT_CROP_FRACTION = 0.875  # dataset.crop_fraction=0 without an init_from that says otherwise
STATISTICS_SAMPLE = 2_000  # images that estimate the per-channel mean/std of a streamed split
MAX_SUBSTITUTIONS = 100  # skip_corrupt: how far to look for a readable example to stand in


@dataclasses.dataclass(frozen=True)
class Examples:
  """One split: streamed from `source`, or cached as `images` (uint8 [N, H, W, C] or a list)."""
  source: Optional[sources.Split] = None
  images: Optional[object] = None
  labels: Optional[np.ndarray] = None

  def __len__(self) -> int:
    return len(self.labels) if self.images is not None else len(self.source)

  @property
  def cached(self) -> bool:
    return self.images is not None


@dataclasses.dataclass(frozen=True)
class Dataset:
  train: Optional[Examples]  # None when only evaluating
  eval: Examples
  class_names: tuple[str, ...]
  image_shape: tuple[int, int, int]  # what the model sees
  mean: np.ndarray  # float32 [C] of the train split in [0, 1] (`standardize`); 0 otherwise
  std: np.ndarray
  transform: Transform
  workers: int = 0
  prefetch: int = 2
  skip_corrupt: bool = False

  @property
  def num_classes(self) -> int:
    return len(self.class_names)


class Batch(NamedTuple):
  images: np.ndarray  # uint8 [B, H, W, C]
  labels: np.ndarray  # int32 [B]
  mask: np.ndarray  # bool [B]; False on padding rows of the last eval batch


# --- loading ------------------------------------------------------------------------------


def load(config: ml_collections.ConfigDict, *, need_train: bool = True,
         class_names: Optional[Sequence[str]] = None) -> Dataset:
  """The splits named by `config.dataset`, listed (and, when cached, decoded) and checked.

  Whatever the source (`sources.get`), the classes are the training split's,
  or `class_names` (a checkpoint's, or the training split's when loading
  another eval split); a folder's eval split is matched to them by name.
  """
  settings = config.dataset
  num_workers = input_workers(config)
  source = sources.get(settings)
  train_split, eval_split, class_names = source.splits(settings.train_split if need_train else None,
                                                       settings.eval_split, class_names)
  transform = image_transform(config, source.channels)
  examples, image_shape = _read(source, [split for split in (train_split, eval_split) if split is not None],
                                settings, transform, num_workers)
  dataset = Dataset(train=examples[0] if need_train else None, eval=examples[-1], class_names=tuple(class_names),
                    image_shape=image_shape, mean=np.zeros(source.channels, np.float32),
                    std=np.ones(source.channels, np.float32), transform=transform, workers=num_workers,
                    prefetch=config.input.prefetch, skip_corrupt=settings.skip_corrupt)
  return _normalized(dataset, settings)


def _read(source: sources.Source, splits: list[sources.Split], settings: ml_collections.ConfigDict,
          transform: Transform, num_workers: int) -> tuple[list[Examples], tuple[int, int, int]]:
  """Each split decoded into memory or ready to stream (`dataset.cache`), and the shape the model sees."""
  channels = source.channels
  native = source.native_sizes(splits)
  if source.in_memory:
    fits = None not in native and _use_cache(settings.cache, _count(*splits), (*next(iter(native)), channels),
                                             transform)
    examples = [Examples(None, *source.arrays(split, fits)) for split in splits]
    return examples, _image_shape(native, transform, channels)
  cache = _use_cache(settings.cache, _count(*splits), _image_shape(native, transform, channels), transform)
  if not cache:  # streamed: every header now, so sizes and unreadable files show before step 1
    checked = [source.checked(split, num_workers, settings.skip_corrupt) for split in splits]
    splits, native = [split for split, _ in checked], set().union(*(sizes for _, sizes in checked))
  image_shape = _image_shape(native, transform, channels)
  return [_examples(split, cache=cache, transform=transform, num_workers=num_workers,
                    skip_corrupt=settings.skip_corrupt) for split in splits], image_shape


def _normalized(dataset: Dataset, settings: ml_collections.ConfigDict) -> Dataset:
  """The dataset with its standardisation numbers: the train split's (`standardize`) or the config's
  (`fixed`; an RGB model's three numbers averaged for 1-channel images, in the config too)."""
  if settings.normalize == 'standardize' and dataset.train is not None:
    mean, std = _statistics(dataset)
    return dataclasses.replace(dataset, mean=mean, std=std)
  if settings.normalize == 'fixed':
    if dataset.image_shape[-1] == 1 and len(settings.mean) == 3:  # an RGB model's numbers on grayscale images
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
      raise UserError(f'config.dataset.eval_splits entry {split!r} has classes {list(other.class_names)[:5]} '
                      f'of {other.image_shape} images, unlike the eval split ({list(dataset.class_names)[:5]}, '
                      f'{dataset.image_shape}); list splits of the same dataset')
    logging.info('eval split %r: %d examples', split, len(other.eval))
    loaded.append((split, other))
  return loaded


def _count(*splits: Optional[sources.Split]) -> int:
  return sum(len(split) for split in splits if split is not None)


def _image_shape(native: set, transform: Transform, channels: int) -> tuple[int, int, int]:
  """What the model sees: image_size square, or the one native size (mixed sizes are an error)."""
  if transform.size:
    return transform.size, transform.size, channels
  if len(native) > 1 or None in native:
    shown = 'vary in size' if None in native else (
        'have ' + ', '.join(f'{w}x{h}' for h, w in sorted(native)[:3]) + (' and more' if len(native) > 3 else ''))
    raise DataError(f'the images {shown}; set --config.dataset.image_size=N to train at NxN '
                    '(random-resized crops for training, resize + centre crop for evaluation)')
  return (*next(iter(native)), channels)


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


def _use_cache(cache: str, count: int, image_shape: tuple[int, int, int], transform: Transform) -> bool:
  if cache != 'auto':
    return cache == 'memory'
  side = _cache_side(transform) or max(image_shape[:2])
  budget = min(_host_memory_bytes() * CACHE_MEMORY_FRACTION, CACHE_MAX_BYTES)
  return count * side * side * image_shape[2] <= budget


def _host_memory_bytes() -> int:
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return 8 * 2**30


def _cache_side(transform: Transform) -> int:
  """Cached images keep their shorter side at the eval resize: enough pixels for every crop."""
  return int(np.ceil(transform.size / transform.crop_fraction)) if transform.size else 0


def _examples(split: sources.Split, *, cache: bool, transform: Transform, num_workers: int,
              skip_corrupt: bool) -> Examples:
  """The split to stream, or decoded into memory (where every file is checked as it decodes)."""
  if not cache:
    return Examples(source=split)
  logging.info('decoding %d images of %r into memory (dataset.cache)', len(split), split.name)
  chunks = range(-(-len(split) // CACHE_CHUNK))
  chunk_results = workers.run(_CacheDecoder(split, transform), chunks, num_workers, buffer=8,
                              min_items_per_worker=2)
  chunk_results = workers.with_progress(chunk_results, len(split), f'decoding {split.name!r}')
  decoded = [example for chunk in chunk_results for example in chunk]
  _, keep = sources.without_unreadable(
      split, [image if isinstance(image, str) else None for image, _ in decoded], skip_corrupt)
  images = [decoded[i][0] for i in keep]
  labels = np.asarray([decoded[i][1] for i in keep], np.int32)
  if not transform.size:  # native size: the sampled headers may have missed an odd one
    _image_shape({image.shape[:2] for image in images}, transform, transform.channels)
    images = np.stack(images)
  return Examples(images=images, labels=labels)


def _statistics(dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean/std in [0, 1] of the train split: all of a cached uniform split, else a sample."""
  train = dataset.train
  if train.cached and isinstance(train.images, np.ndarray):
    pixels = train.images.reshape(-1, train.images.shape[-1])
    pixels = pixels[:: max(1, len(pixels) // 2_000_000)].astype(np.float32) / 255.0
  else:
    images = train_sample(dataset, STATISTICS_SAMPLE)
    pixels = np.concatenate([i.reshape(-1, i.shape[-1]) for i in images]).astype(np.float32) / 255.0
  return pixels.mean(axis=0), pixels.std(axis=0) + 1e-6


def train_sample(dataset: Dataset, count: int) -> list[np.ndarray]:
  """`count` train images spread evenly over the split, as evaluation shows them (uint8 [H, W, C] each).

  The same on every host and in every run: the images at fixed positions, no randomness.
  """
  train = dataset.train
  positions = np.linspace(0, len(train) - 1, min(len(train), count)).astype(int)
  loader = _EvalLoader(train, dataset.transform, dataset.skip_corrupt)
  images = [image for image, _ in workers.run(loader.example, positions, dataset.workers, buffer=64,
                                              min_items_per_worker=500)]
  if failures := [image for image in images if isinstance(image, _Failure)]:
    raise DataError(failures[0].message)
  return images


# --- batches ------------------------------------------------------------------------------


def train_indices(seed: int, step: int, num_examples: int, batch_size: int) -> np.ndarray:
  """Indices of the global batch for `step`: epoch `step // steps_per_epoch` of a seeded shuffle."""
  epoch, position = divmod(step, num_examples // batch_size)
  permutation = _epoch_permutation(seed, epoch, num_examples)
  return permutation[position * batch_size:(position + 1) * batch_size]


@functools.lru_cache(maxsize=2)
def _epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def alternate_flips(seed: int, step: int, num_examples: int, batch_size: int) -> np.ndarray:
  """Which images of `step`'s global batch are mirrored under `augment.alternate_flip` (bool per row).

  A seeded half of the split in even epochs and the other half in odd ones:
  every image is seen both ways in any two consecutive epochs, where a coin
  per view repeats a side for half of them (airbench's alternating flip).
  """
  odd_epoch = step // (num_examples // batch_size) % 2 == 1
  return _first_epoch_flips(seed, num_examples)[train_indices(seed, step, num_examples, batch_size)] ^ odd_epoch


@functools.lru_cache(maxsize=2)
def _first_epoch_flips(seed: int, num_examples: int) -> np.ndarray:
  # Its own seed sequence (a spawn key), apart from the epochs' permutations.
  return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,))).random(num_examples) < 0.5


def process_slice(global_batch_size: int, process_index: int, process_count: int) -> slice:
  """This process's rows of a global batch (contiguous, as the batch sharding lays them out).

  `steps.place` has checked that the batch divides over the devices, hence the processes.
  """
  per_process = global_batch_size // process_count
  return slice(process_index * per_process, (process_index + 1) * per_process)


def train_batches(dataset: Dataset, *, seed: int, batch_size: int, first_step: int, last_step: int,
                  process_index: int = 0, process_count: int = 1, alternate_flip: bool = False) -> Iterator[Batch]:
  """This process's part of the global batches for steps [first_step, last_step).

  With `alternate_flip` the images come mirrored as `alternate_flips` says
  (the device's random flip is then off: `augment.augment_image`).
  """
  rows = process_slice(batch_size, process_index, process_count)
  train = dataset.train
  if _sliceable(dataset, train):  # CIFAR-size: slicing is all there is
    mask = np.ones(rows.stop - rows.start, bool)
    for step in range(first_step, last_step):
      indices = train_indices(seed, step, len(train), batch_size)[rows]
      images = train.images[indices]
      if alternate_flip:
        mirror = alternate_flips(seed, step, len(train), batch_size)[rows]
        images[mirror] = images[mirror][:, :, ::-1]
      yield Batch(images, train.labels[indices], mask)
    return
  loader = _TrainLoader(train, dataset.transform, seed, batch_size, rows, dataset.skip_corrupt, alternate_flip)
  yield from _checked(workers.run(loader, range(first_step, last_step),
                                  0 if train.cached else dataset.workers, dataset.prefetch))


def eval_batches(dataset: Dataset, *, batch_size: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[Batch]:
  """Every eval example once, in order; the last global batch is padded and masked, never dropped."""
  rows = process_slice(batch_size, process_index, process_count)
  examples = dataset.eval
  starts = range(0, len(examples), batch_size)
  if _sliceable(dataset, examples):
    for start in starts:
      indices, mask = _eval_rows(start, batch_size, rows, len(examples))
      yield Batch(examples.images[indices], examples.labels[indices], mask)
    return
  loader = _EvalLoader(examples, dataset.transform, dataset.skip_corrupt, batch_size, rows)
  yield from _checked(workers.run(loader, starts, 0 if examples.cached else dataset.workers,
                                  dataset.prefetch))


def eval_image(dataset: Dataset, index: int) -> np.ndarray:
  """Eval example `index` as the model sees it (uint8 HxWxC), e.g. to picture a mistake."""
  if _sliceable(dataset, dataset.eval):
    return dataset.eval.images[index]
  image, _ = _EvalLoader(dataset.eval, dataset.transform, skip_corrupt=True).example(index)
  return np.zeros(dataset.image_shape, np.uint8) if isinstance(image, _Failure) else image


def _sliceable(dataset: Dataset, examples: Examples) -> bool:
  """Cached at the size the model sees: a batch is a slice of the array, nothing to decode."""
  return examples.cached and isinstance(examples.images, np.ndarray) and not dataset.transform.size


def _eval_rows(start: int, batch_size: int, rows: slice, size: int) -> tuple[np.ndarray, np.ndarray]:
  indices = np.arange(start, start + batch_size)[rows]
  mask = indices < size
  return np.where(mask, indices, 0), mask


def _checked(batches: Iterator) -> Iterator[Batch]:
  try:
    for batch in batches:
      if isinstance(batch, _Failure):
        raise DataError(batch.message)
      yield batch
  finally:
    batches.close()  # stops the thread or the worker processes, also after an early stop


# --- the work the input workers do ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Failure:
  """A worker's data error, returned (not raised) so the trainer reports it as one line."""
  message: str


class _ExampleReader:
  """Reads example `index` of a split, cached or from disk; with skip_corrupt, a broken one is
  replaced by the next readable example (deterministically, so batches stay reproducible)."""

  def __init__(self, examples: Examples, transform: Transform, skip_corrupt: bool):
    self.examples, self.transform, self.skip_corrupt = examples, transform, skip_corrupt

  def read(self, index: int, make_image) -> tuple[object, int]:
    examples = self.examples
    for attempt in range(MAX_SUBSTITUTIONS if self.skip_corrupt else 1):
      position = (index + attempt) % len(examples)
      try:
        if examples.cached:
          item, label = examples.images[position], int(examples.labels[position])
        else:
          item, label = examples.source.load(position)
        return make_image(preprocess.open_image(item)), label
      except Exception as e:  # pylint: disable=broad-except
        where = examples.source.describe(position) if examples.source else f'cached image {position}'
        reason = sources.unreadable(where, e)
        if not self.skip_corrupt:
          return _Failure(f'{reason}, or set --config.dataset.skip_corrupt=true to skip such files'), 0
        print(f'warning: {reason}; skipped (dataset.skip_corrupt)', file=sys.stderr, flush=True)
    return _Failure(f'no readable image among {MAX_SUBSTITUTIONS} examples from {index} on'), 0


class _TrainLoader(_ExampleReader):
  """Step -> this process's rows of the global batch, random-resized-cropped per (seed, step, row)."""

  def __init__(self, examples, transform, seed, batch_size, rows, skip_corrupt, alternate_flip=False):
    super().__init__(examples, transform, skip_corrupt)
    self.seed, self.batch_size, self.rows, self.alternate_flip = seed, batch_size, rows, alternate_flip

  def __call__(self, step: int):
    indices = train_indices(self.seed, step, len(self.examples), self.batch_size)
    mirror = (alternate_flips(self.seed, step, len(self.examples), self.batch_size) if self.alternate_flip
              else np.zeros(len(indices), bool))
    images, labels = [], []
    for position in range(self.rows.start, self.rows.stop):
      rng = np.random.default_rng([self.seed, step, position])
      image, label = self.read(int(indices[position]),
                               functools.partial(preprocess.train_image, transform=self.transform, rng=rng))
      if isinstance(image, _Failure):
        return image
      images.append(image[:, ::-1] if mirror[position] else image)
      labels.append(label)
    return Batch(_stack(images), np.asarray(labels, np.int32),
                 np.ones(len(labels), bool))


class _EvalLoader(_ExampleReader):
  """Batch start -> this process's rows of the eval batch, resized and centre-cropped."""

  def __init__(self, examples, transform, skip_corrupt, batch_size=0, rows=slice(0)):
    super().__init__(examples, transform, skip_corrupt)
    self.batch_size, self.rows = batch_size, rows

  def example(self, index: int):
    return self.read(int(index), functools.partial(preprocess.eval_image, transform=self.transform))

  def __call__(self, start: int):
    indices, mask = _eval_rows(start, self.batch_size, self.rows, len(self.examples))
    images, labels = [], []
    for index in indices:
      image, label = self.example(index)
      if isinstance(image, _Failure):
        return image
      images.append(image)
      labels.append(label)
    return Batch(_stack(images), np.asarray(labels, np.int32), mask)


class _CacheDecoder:
  """A chunk of indices -> (image as the cache keeps it, or what is wrong with its file; label).

  The cache keeps the native size, or the shorter side at the eval resize.
  """

  def __init__(self, split: sources.Split, transform: Transform):
    self.split, self.transform = split, transform

  def __call__(self, chunk: int) -> list:
    examples = []
    for index in range(chunk * CACHE_CHUNK, min((chunk + 1) * CACHE_CHUNK, len(self.split))):
      item, label = self.split.load(index)
      try:
        examples.append((self._cacheable(preprocess.open_image(item)), label))
      except Exception as e:  # pylint: disable=broad-except
        examples.append((sources.unreadable(self.split.describe(index), e), label))
    return examples

  def _cacheable(self, image):
    from PIL import Image  # pylint: disable=g-import-not-at-top
    channels, side = self.transform.channels, _cache_side(self.transform)
    if not side:
      return preprocess.to_array(preprocess.decode(image, channels), channels)
    width, height = preprocess.upright_size(image)
    scale = side / min(width, height)
    target = (max(1, round(width * scale)), max(1, round(height * scale)))
    decoded = preprocess.decode(image, channels, target if scale < 1 else None)
    if scale < 1:
      decoded = decoded.resize(target, Image.BILINEAR, reducing_gap=None)
    return preprocess.to_array(decoded, channels)


def _stack(images: list[np.ndarray]) -> np.ndarray:
  shapes = {image.shape for image in images}
  if len(shapes) > 1:  # only possible with image_size=0 on a source whose sizes were not scanned
    raise DataError(f'images of sizes {sorted(shapes)[:3]} in one batch; set '
                    '--config.dataset.image_size=N')
  return np.stack(images)


# --- prediction inputs -----------------------------------------------------------------------


def read_images(path: str, image_shape: tuple[int, int, int], transform: Transform,
                skip_corrupt: bool = False) -> tuple[list[str], np.ndarray]:
  """An image file, or every image under a folder (sorted), preprocessed as for evaluation.

  A file that cannot be read is a DataError naming it, or with `skip_corrupt`
  a warning naming it, and it is left out of the paths returned.
  """
  if os.path.isdir(path):
    paths = sorted(sources.image_files(path))
    if not paths:
      raise DataError(f'config.predict.input={path!r} holds no images ({", ".join(IMAGE_EXTENSIONS)})')
  elif os.path.isfile(path):
    paths = [path]
  else:
    raise DataError(f'config.predict.input={path!r} does not exist; give an image file or a folder')
  height, width, channels = image_shape
  kept, images = [], []
  for image_path in paths:
    try:
      image = preprocess.open_image(image_path)
      if transform.size:
        array = preprocess.eval_image(image, dataclasses.replace(transform, channels=channels))
      else:  # a model trained at native size: resize to it, as Keras' predict pipelines do
        decoded = preprocess.decode(image, channels)
        array = preprocess.to_array(decoded.resize((width, height)) if decoded.size != (width, height)
                                    else decoded, channels)
    except Exception as e:  # pylint: disable=broad-except
      reason = sources.unreadable(image_path, e)
      if not skip_corrupt:
        raise DataError(f'{reason}, or set --config.dataset.skip_corrupt=true to skip such files') from e
      print(f'warning: {reason}; skipped (dataset.skip_corrupt)', file=sys.stderr, flush=True)
      continue
    kept.append(image_path)
    images.append(array)
  if not images:
    raise DataError(f'none of the {len(paths)} images in config.predict.input={path!r} can be read; '
                    'give readable images')
  return kept, np.stack(images)


def csv_path(path: str) -> str:
  """A file path as a CSV cell: valid UTF-8 (bytes that are not UTF-8 written as \\xNN) and never
  read as a spreadsheet formula (a relative path starting with =, +, - or @ gets './', the same file)."""
  text = os.fsencode(path).decode('utf-8', 'backslashreplace')
  return f'.{os.sep}{text}' if text.startswith(('=', '+', '-', '@')) else text
