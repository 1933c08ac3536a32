"""The input pipeline: batches as a pure function of (seed, step), decoded in worker processes.

A dataset is a train and an eval split (from whichever source `sources.get`
picks) and the `preprocess.Transform` that turns an image into the
model's input. Its examples are either

- streamed: each batch is read and decoded from disk when it is needed, in
  `input.workers` grain worker processes, `input.prefetch` batches ahead; or
- cached: decoded once into host memory (`dataset.cache`: `auto` does this
  when the decoded splits fit a small share of RAM, as for CIFAR or MNIST).

A label is a class index (a split's labels are int32 [N]) or, under
`task=multilabel`, a multi-hot row (uint8 [N, C], all zeros for an image
without tags). Caching, streaming, eval padding and skip_corrupt carry
either form unchanged, so a `Batch` holds int32 [B] or uint8 [B, C] labels.

Which examples make up step `s`'s global batch is the sampler's choice
(`dataset.sampling`, `Sampler`):

- shuffle: positions `[s mod epoch]` of the seeded permutation of epoch
  `s // steps_per_epoch`;
- balanced: each epoch draws as many examples as shuffle would use, with
  replacement, every class equally likely (`balanced_probabilities`);
- shards: process p of P streams its own tar shards (k % P == p) in a
  seeded order, shuffled within windows of SHUFFLE_WINDOW examples, as
  WebDataset's shuffle buffer would but reproducibly.

Example `p` of the global batch is augmented with a generator seeded by
(seed, s, p). So a resumed run or another worker count sees exactly the
same batches, and each process reads and decodes only its own rows. Under
shuffle and balanced another process count sees the same batches too;
under shards it does not: each process owns different shards, so the
batches depend on the process count. Evaluation covers the split once, the
last batch padded and masked.

`dataset.class_weights` becomes `Dataset.class_weights` (`class_weights`):
a loss weight per class, from the train split's counts or from a file.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import io
import json
import logging
import math
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
# sampling=shards: examples shuffled together, a few shards' worth (WebDataset's usual buffer).
SHUFFLE_WINDOW = 1_000

# Spawn keys of the seed sequences drawn from `seed`, one per stream, so no two ever coincide
# (the shuffle permutations use the plain sequence [seed, epoch]).
_FLIPS_STREAM, _BALANCED_STREAM, _SHARD_ORDER_STREAM, _SHARD_WINDOW_STREAM = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Examples:
  """One split: streamed from `source`, or cached as `images` (uint8 [N, H, W, C] or a list)
  with `labels` (int32 [N] or uint8 [N, C]) and, for tar shards, `shards` (int32 [N])."""
  source: Optional[sources.Split] = None
  images: Optional[object] = None
  labels: Optional[np.ndarray] = None
  shards: Optional[np.ndarray] = None

  def __len__(self) -> int:
    return len(self.labels) if self.images is not None else len(self.source)

  @property
  def cached(self) -> bool:
    return self.images is not None

  @property
  def listed_labels(self) -> Optional[np.ndarray]:
    """Every example's label without reading an image; None where a streamed split has them only
    in its records (TFDS)."""
    return self.labels if self.cached else self.source.labels

  @property
  def shard_indices(self) -> Optional[np.ndarray]:
    """Each example's tar shard (int32 [N]); None for other sources."""
    return self.shards if self.cached else self.source.shards


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
  # Streamed batches built by `workers` threads of this process instead of processes: no
  # shared-memory hand-over (see workers.run). Off by default; benchmarks/input_pipeline.py
  # measures both.
  worker_threads: bool = False
  skip_corrupt: bool = False
  multilabel: bool = False  # task=multilabel: labels are uint8 multi-hot rows
  class_weights: Optional[np.ndarray] = None  # float32 [num_classes] loss weights; None = unweighted
  sampling: str = 'shuffle'  # dataset.sampling: which `Sampler` orders the training examples

  @property
  def num_classes(self) -> int:
    return len(self.class_names)


class Batch(NamedTuple):
  images: np.ndarray  # uint8 [B, H, W, C]
  labels: np.ndarray  # int32 [B] class indices, or uint8 [B, C] multi-hot rows (task=multilabel)
  mask: np.ndarray  # bool [B]; False on padding rows of the last eval batch


# --- loading ------------------------------------------------------------------------------


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
      class_weights=None if train is None else class_weights(settings.class_weights, train, class_names),
      sampling=settings.sampling)
  return _normalized(dataset, settings)


def _read(source: sources.Source, splits: list[sources.Split], settings: ml_collections.ConfigDict,
          transform: Transform, num_workers: int) -> tuple[list[Examples], tuple[int, int, int]]:
  """Each split decoded into memory or ready to stream (`dataset.cache`), and the shape the model
  sees."""
  channels = source.channels
  native = source.native_sizes(splits)
  if source.in_memory:
    fits = None not in native and _use_cache(settings.cache, _count(*splits),
                                             (*next(iter(native)), channels), transform)
    examples = [Examples(None, *source.arrays(split, fits), shards=split.shards) for split in splits]
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


def _count(*splits: Optional[sources.Split]) -> int:
  return sum(len(split) for split in splits if split is not None)


def _image_shape(native: set, transform: Transform, channels: int) -> tuple[int, int, int]:
  """What the model sees: image_size square, or the one native size (mixed sizes are an error)."""
  if transform.size:
    return transform.size, transform.size, channels
  if len(native) > 1 or None in native:
    shown = 'vary in size' if None in native else (
        'have ' + ', '.join(f'{w}x{h}' for h, w in sorted(native)[:3])
        + (' and more' if len(native) > 3 else ''))
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
  # A split that lists its labels keeps their array (and dtype); TFDS records said them as they decoded.
  labels = split.labels[keep] if split.labels is not None else _label_batch([decoded[i][1] for i in keep])
  if not transform.size:  # native size: the sampled headers may have missed an odd one
    _image_shape({image.shape[:2] for image in images}, transform, transform.channels)
    images = np.stack(images)
  return Examples(images=images, labels=labels,
                  shards=None if split.shards is None else split.shards[keep])


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
  """`count` train images spread evenly over the split, as evaluation shows them (uint8 [H, W, C]
  each).

  The same on every host and in every run: the images at fixed positions, no randomness.
  """
  train = dataset.train
  return split_images(dataset, train, np.linspace(0, len(train) - 1, min(len(train), count)).astype(int))


def split_images(dataset: Dataset, examples: Examples, positions: np.ndarray) -> list[np.ndarray]:
  """The examples of a split at `positions`, as evaluation shows them (uint8 [H, W, C] each)."""
  if _sliceable(dataset, examples):
    return list(examples.images[positions])
  loader = _EvalLoader(examples, dataset.transform, dataset.skip_corrupt)
  images = [image for image, _ in workers.run(loader.example, positions, dataset.workers, buffer=64,
                                              min_items_per_worker=500)]
  if failures := [image for image in images if isinstance(image, _Failure)]:
    raise DataError(failures[0].message)
  return images


# --- labels and class weights ---------------------------------------------------------------


def _label(value) -> object:
  """One example's label as a loader returns it: an int, or a uint8 [C] multi-hot row."""
  return int(value) if np.ndim(value) == 0 else np.asarray(value, np.uint8)


def _label_batch(labels: list) -> np.ndarray:
  """Labels read one at a time, as a batch: int32 [B] indices, or uint8 [B, C] multi-hot rows."""
  if labels and np.ndim(labels[0]) == 1:
    return np.stack(labels).astype(np.uint8)
  return np.asarray(labels, np.int32)


def class_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """Examples per class (int64 [C]): of each index, or of each tag's positives in multi-hot rows."""
  if labels.ndim == 2:
    return labels.sum(axis=0, dtype=np.int64)
  return np.bincount(labels, minlength=num_classes).astype(np.int64)


def _listed_train_labels(train: Examples, needed_by: str) -> np.ndarray:
  """The train split's labels, which `needed_by` counts before the first step."""
  labels = train.listed_labels
  if labels is None:
    raise DataError(f'config.dataset.{needed_by} counts the train split\'s labels before training, '
                    'which a streamed TFDS split does not list; set --config.dataset.cache=memory '
                    '(or prepare the data as an image folder, label file, shards or parquet)')
  return labels


def class_weights(setting: str, train: Examples, class_names: Sequence[str]) -> Optional[np.ndarray]:
  """`dataset.class_weights` as float32 [C] loss weights: None for `none`, the train split's
  `balanced_class_weights`, or a file's (`read_class_weights`); logged once."""
  if setting == 'none':
    return None
  if setting == 'balanced':
    counts = class_counts(_listed_train_labels(train, 'class_weights=balanced'), len(class_names))
    weights = balanced_class_weights(counts, len(train))
    if absent := [printable(name) for name, count in zip(class_names, counts) if not count]:
      logging.info('dataset.class_weights=balanced: %d classes have no train example and weigh 1.0: %s',
                   len(absent), ', '.join(absent[:10]) + (', ...' if len(absent) > 10 else ''))
  else:
    weights = read_class_weights(setting, class_names)
  logging.info('dataset.class_weights=%s: weights from %.4g (%s) to %.4g (%s)', setting,
               weights.min(), printable(class_names[int(weights.argmin())]),
               weights.max(), printable(class_names[int(weights.argmax())]))
  return weights


def balanced_class_weights(counts: np.ndarray, num_examples: int) -> np.ndarray:
  """Keras' and sklearn's 'balanced' weights, n / (C x n_c): every class then weighs as much in the
  loss as a class of the average size, and the mean example weight stays 1 (C counts the classes
  present). Multi-hot: n_c is class c's positives among the n rows. An absent class weighs 1.0."""
  present = counts > 0
  weights = np.ones(len(counts), np.float32)
  weights[present] = num_examples / (present.sum() * counts[present])
  return weights


def read_class_weights(path: str, class_names: Sequence[str]) -> np.ndarray:
  """Weights from a CSV of class,weight rows (a header row is optional) or a JSON object
  {class: weight}; classes it does not list weigh 1.0. Each mistake is one DataError line."""
  where = f'config.dataset.class_weights={path!r}'
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
    raise DataError(f'{where} cannot be read ({reason}); give a CSV of class,weight or a JSON object '
                    '{class: weight}, or choose none or balanced') from e
  is_json = path.lower().endswith('.json') or text.lstrip().startswith('{')
  entries = _json_weights(text, where) if is_json else _csv_weights(text, where, class_names)
  index = {name: i for i, name in enumerate(class_names)}
  weights = np.ones(len(class_names), np.float32)
  seen = set()
  for place, name, value in entries:
    if name not in index:
      known = ', '.join(printable(n) for n in class_names[:10]) + (', ...' if len(class_names) > 10 else '')
      raise DataError(f'{where}, {place}: class {printable(name)!r} is not one of the dataset\'s '
                      f'{len(class_names)} classes ({known}); correct the name or remove it')
    if name in seen:
      raise DataError(f'{where}, {place}: class {printable(name)!r} is weighted twice; keep one weight')
    weight = _weight(value)
    if weight is None:
      raise DataError(f'{where}, {place}: the weight of class {printable(name)!r} is {value!r}, not a '
                      'finite number >= 0; give a number such as 2.5')
    weights[index[name]] = weight
    seen.add(name)
  return weights


def _weight(value) -> Optional[float]:
  """A class weight as a float, or None when it is not a finite number >= 0."""
  if isinstance(value, bool):
    return None
  try:
    weight = float(value)
  except (TypeError, ValueError):
    return None
  return weight if math.isfinite(weight) and weight >= 0 else None


def _json_weights(text: str, where: str) -> list[tuple[str, str, object]]:
  """(place, class, weight) of a JSON object {class: weight}."""
  try:
    weights = json.loads(text)
  except ValueError as e:
    raise DataError(f'{where} is not valid JSON ({e}); write an object {{"class": weight, ...}}') from e
  if not isinstance(weights, dict):
    raise DataError(f'{where} holds a JSON {type(weights).__name__}, not an object; write '
                    '{"class": weight, ...}')
  return [(f'key {name!r}', name, value) for name, value in weights.items()]


def _csv_weights(text: str, where: str, class_names: Sequence[str]) -> list[tuple[str, str, str]]:
  """(place, class, weight) of each class,weight row; the first row is a header when it names no
  class and holds no number (class,weight)."""
  rows = [(number, [cell.strip() for cell in row]) for number, row in
          enumerate(csv.reader(io.StringIO(text)), start=1) if any(cell.strip() for cell in row)]
  if rows and rows[0][1][0] not in class_names and _weight(rows[0][1][-1]) is None:
    rows = rows[1:]
  entries = []
  for number, row in rows:
    if len(row) != 2:
      raise DataError(f'{where}, line {number}: {len(row)} cells ({printable(",".join(row))[:60]}); '
                      'write one class,weight pair a line')
    entries.append((f'line {number}', row[0], row[1]))
  return entries


# --- samplers: which examples make up each step's batch -------------------------------------


def process_slice(global_batch_size: int, process_index: int, process_count: int) -> slice:
  """This process's rows of a global batch (contiguous, as the batch sharding lays them out).

  `steps.place` has checked that the batch divides over the devices, hence the processes.
  """
  per_process = global_batch_size // process_count
  return slice(process_index * per_process, (process_index + 1) * per_process)


def _generator(seed: int, stream: int, *key: int) -> np.random.Generator:
  """A generator for one stream of randomness (`_*_STREAM`): its own seed sequence (a spawn key),
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
  return _generator(seed, _FLIPS_STREAM).random(num_examples) < 0.5


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
    generator = _generator(self.seed, _BALANCED_STREAM, epoch)
    uniforms = np.sort(generator.random(self.steps_per_epoch * self.batch_size)) * self.cumulative[-1]
    drawn = np.minimum(np.searchsorted(self.cumulative, uniforms, side='right'), self.num_examples - 1)
    return generator.permutation(drawn)


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


class ShardSampler(Sampler):
  """WebDataset-style streaming: process p of P reads only the shards k with k % P == p.

  k is a shard's place among the split's shards (its index when every shard
  holds examples). Each epoch takes this process's shards in a seeded order,
  each shard's examples in tar order, then shuffles every window of
  SHUFFLE_WINDOW consecutive examples (WebDataset's shuffle buffer, made
  deterministic), so reads stay within a few shards at a time. Every process
  takes the same number of steps an epoch: the smallest process's examples
  // its rows of a batch, so none waits on a batch another cannot fill; the
  rest of each process's epoch is left out (another part each epoch).
  """

  def __init__(self, seed, shards, batch_size, process_index=0, process_count=1):
    shard_ids, place = np.unique(shards, return_inverse=True)
    if len(shard_ids) < process_count:
      raise DataError(f'config.dataset.sampling=shards gives each process its own shards, but the train '
                      f'split has {len(shard_ids)} shards for {process_count} processes; write the data '
                      f'as at least {process_count} shards, or set --config.dataset.sampling=shuffle')
    super().__init__(seed, len(shards), batch_size, process_index, process_count)
    self.num_shards, self.process_index = len(shard_ids), process_index
    self.shard_of = place.astype(np.int32)  # each example's shard place k
    self.mine = np.flatnonzero(self.shard_of % process_count == process_index)  # in split (tar) order
    per_process = np.bincount(self.shard_of % process_count, minlength=process_count)
    self.steps_per_epoch = int(per_process.min()) // self.local_batch_size
    if not self.steps_per_epoch:
      smallest = int(per_process.argmin())
      raise DataError(f'config.dataset.sampling=shards: process {smallest} of {process_count} gets '
                      f'{per_process[smallest]} examples from its shards, fewer than its '
                      f'{self.local_batch_size} rows of a batch; lower config.batch_size or use fewer '
                      'processes')

  def _epoch_order(self, epoch):
    """This process's rows of the epoch's batches, one after the other."""
    shard_order = _generator(self.seed, _SHARD_ORDER_STREAM, epoch).permutation(self.num_shards)
    turn = np.argsort(shard_order)  # when each shard comes this epoch
    stream = self.mine[np.argsort(turn[self.shard_of[self.mine]], kind='stable')]  # tar order within
    windows = _generator(self.seed, _SHARD_WINDOW_STREAM, epoch, self.process_index)
    for start in range(0, len(stream), SHUFFLE_WINDOW):
      stream[start:start + SHUFFLE_WINDOW] = windows.permutation(stream[start:start + SHUFFLE_WINDOW])
    return stream[:self.steps_per_epoch * self.local_batch_size]

  def _batch(self, order, position):
    return order[position * self.local_batch_size:(position + 1) * self.local_batch_size]


def sampler(dataset: Dataset, *, seed: int, batch_size: int, process_index: int = 0,
            process_count: int = 1) -> Sampler:
  """The `Sampler` that `dataset.sampling` names, over the train split."""
  train, layout = dataset.train, dict(process_index=process_index, process_count=process_count)
  if dataset.sampling == 'balanced':
    return BalancedSampler(seed, _listed_train_labels(train, 'sampling=balanced'), batch_size, **layout)
  if dataset.sampling == 'shards':
    if train.shard_indices is None:
      raise DataError('config.dataset.sampling=shards streams tar shards per process, and the train '
                      'split is not read from shards; set config.dataset.shards, or '
                      '--config.dataset.sampling=shuffle')
    return ShardSampler(seed, train.shard_indices, batch_size, **layout)
  return ShuffleSampler(seed, len(train), batch_size, **layout)


def examples_per_epoch(dataset: Dataset, batch_size: int, process_count: int = 1) -> int:
  """The train examples an epoch uses, in whole global batches: what the run length counts. Under
  shards the smallest process's share sets it; it raises the sampler's errors (too few shards)
  before anything compiles."""
  chosen = sampler(dataset, seed=0, batch_size=batch_size, process_count=process_count)
  return chosen.steps_per_epoch * batch_size


# --- batches ------------------------------------------------------------------------------


def train_batches(dataset: Dataset, *, seed: int, batch_size: int, first_step: int, last_step: int,
                  process_index: int = 0, process_count: int = 1,
                  alternate_flip: bool = False) -> Iterator[Batch]:
  """This process's part of the global batches for steps [first_step, last_step), in the order
  `dataset.sampling` gives (its errors raise here, before the first batch is asked for).

  With `alternate_flip` the images come mirrored as `Sampler.mirrored` says
  (the device's random flip is then off: `augment.augment_image`).
  """
  chosen = sampler(dataset, seed=seed, batch_size=batch_size, process_index=process_index,
                   process_count=process_count)
  steps = range(first_step, last_step)
  train = dataset.train
  if _sliceable(dataset, train):  # CIFAR-size: slicing is all there is
    return _sliced_train_batches(train, chosen, steps, alternate_flip)
  loader = _TrainLoader(train, dataset.transform, chosen, dataset.skip_corrupt, alternate_flip)
  return _loaded_train_batches(loader, steps, 0 if train.cached else dataset.workers, dataset.prefetch,
                               dataset.worker_threads)


def _loaded_train_batches(loader: _TrainLoader, steps: range, num_workers: int,
                          prefetch: int, threads: bool = False) -> Iterator[Batch]:
  # A generator, so the workers start with the first batch asked for and stop with the last.
  yield from _checked(workers.run(loader, steps, num_workers, prefetch, threads=threads))


def _sliced_train_batches(train: Examples, chosen: Sampler, steps: range,
                          alternate_flip: bool) -> Iterator[Batch]:
  mask = np.ones(chosen.local_batch_size, bool)
  for step in steps:
    indices = chosen.indices(step)
    images = train.images[indices]
    if alternate_flip:
      mirror = chosen.mirrored(step, indices)
      images[mirror] = images[mirror][:, :, ::-1]
    yield Batch(images, train.labels[indices], mask)


def eval_batches(dataset: Dataset, *, batch_size: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[Batch]:
  """Every eval example once, in order; the last global batch is padded and masked, never dropped
  (padding rows repeat example 0, its label included, whichever form the labels take)."""
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
                                  dataset.prefetch, threads=dataset.worker_threads))


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

  def read(self, index: int, make_image) -> tuple[object, object]:
    """(image, label: an int or a uint8 [C] row), or (_Failure, 0)."""
    examples = self.examples
    for attempt in range(MAX_SUBSTITUTIONS if self.skip_corrupt else 1):
      position = (index + attempt) % len(examples)
      try:
        if examples.cached:
          item, label = examples.images[position], examples.labels[position]
        else:
          item, label = examples.source.load(position)
        return make_image(item), _label(label)
      except Exception as e:  # pylint: disable=broad-except
        where = examples.source.describe(position) if examples.source else f'cached image {position}'
        reason = sources.unreadable(where, e)
        if not self.skip_corrupt:
          return _Failure(f'{reason}, or set --config.dataset.skip_corrupt=true to skip such files'), 0
        print(f'warning: {reason}; skipped (dataset.skip_corrupt)', file=sys.stderr, flush=True)
    return _Failure(f'no readable image among {MAX_SUBSTITUTIONS} examples from {index} on'), 0


class _TrainLoader(_ExampleReader):
  """Step -> this process's rows of the global batch (the sampler's examples), random-resized-cropped
  per (seed, step, row of the global batch)."""

  def __init__(self, examples: Examples, transform: Transform, chosen: Sampler, skip_corrupt: bool,
               alternate_flip: bool = False):
    super().__init__(examples, transform, skip_corrupt)
    self.sampler, self.alternate_flip = chosen, alternate_flip

  def __call__(self, step: int):
    indices = self.sampler.indices(step)
    mirror = self.sampler.mirrored(step, indices) if self.alternate_flip else np.zeros(len(indices), bool)
    images, labels = _batch_images(len(indices), self.transform), []
    for row, (position, index) in enumerate(zip(range(self.sampler.rows.start, self.sampler.rows.stop),
                                                indices)):
      rng = np.random.default_rng([self.sampler.seed, step, position])
      out = images[row] if isinstance(images, np.ndarray) else None
      image, label = self.read(int(index), functools.partial(preprocess.train_image, transform=self.transform,
                                                             rng=rng, out=out))
      if isinstance(image, _Failure):
        return image
      if out is None:
        images.append(image[:, ::-1] if mirror[row] else image)
      elif mirror[row]:
        out[:] = out[:, ::-1]  # numpy copies overlapping operands first
      labels.append(label)
    return Batch(_stack(images), _label_batch(labels), np.ones(len(labels), bool))


def _batch_images(count: int, transform: Transform) -> np.ndarray | list:
  """Where a batch's images go: at a fixed image size, one array each image is resized straight
  into (no copy when the batch is stacked); at native sizes, a list to stack."""
  return np.empty((count, transform.size, transform.size, transform.channels), np.uint8) if transform.size \
      else []


class _EvalLoader(_ExampleReader):
  """Batch start -> this process's rows of the eval batch, resized and centre-cropped."""

  def __init__(self, examples, transform, skip_corrupt, batch_size=0, rows=slice(0)):
    super().__init__(examples, transform, skip_corrupt)
    self.batch_size, self.rows = batch_size, rows

  def example(self, index: int, out: Optional[np.ndarray] = None):
    return self.read(int(index), functools.partial(preprocess.eval_image, transform=self.transform, out=out))

  def __call__(self, start: int):
    indices, mask = _eval_rows(start, self.batch_size, self.rows, len(self.examples))
    images, labels = _batch_images(len(indices), self.transform), []
    for row, index in enumerate(indices):
      out = images[row] if isinstance(images, np.ndarray) else None
      image, label = self.example(index, out)
      if isinstance(image, _Failure):
        return image
      if out is None:
        images.append(image)
      labels.append(label)
    return Batch(_stack(images), _label_batch(labels), mask)


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


def _stack(images: np.ndarray | list[np.ndarray]) -> np.ndarray:
  if isinstance(images, np.ndarray):
    return images
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
