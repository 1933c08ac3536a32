"""Datasets in memory: decode once, keep uint8 arrays, draw batches by (seed, step).

A source is a TFDS catalog name (`cifar10`, `mnist`, ...) or an image folder
(`root/split/class/image`, read by `tfds.ImageFolder`). Both become a
`Dataset` of uint8 arrays, small enough for host memory at CIFAR/MNIST size.

Training batches are a pure function of (seed, step): the permutation of an
epoch comes from (seed, epoch), so a resumed run sees exactly the batches it
would have seen, and every process cuts its own slice of the same global
batch. Evaluation batches cover the split once, the last one padded and
masked.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
from typing import Iterator, NamedTuple

import ml_collections
import numpy as np

from flaxtpu.errors import UserError

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')  # what tfds.ImageFolder reads


class DataError(UserError):
  """A dataset that cannot be read; the message names the file or folder."""


@dataclasses.dataclass(frozen=True)
class Split:
  images: np.ndarray  # uint8 [N, H, W, C]
  labels: np.ndarray  # int32 [N]

  def __len__(self) -> int:
    return len(self.labels)


@dataclasses.dataclass(frozen=True)
class Dataset:
  train: Split
  eval: Split
  class_names: tuple[str, ...]
  mean: np.ndarray  # float32 [C], of the train split in [0, 1]; for `standardize`
  std: np.ndarray

  @property
  def num_classes(self) -> int:
    return len(self.class_names)

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return tuple(self.train.images.shape[1:])


def _tensorflow():
  """TensorFlow, hidden from GPUs/TPUs so that it never takes accelerator memory from JAX."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], 'GPU')
  tf.config.set_visible_devices([], 'TPU')
  return tf


def load(config: ml_collections.ConfigDict, *, need_train: bool = True) -> Dataset:
  """Loads the train and eval splits named by `config.dataset` into memory."""
  source = config.dataset
  read = (functools.partial(_read_folder, source.folder) if source.folder
          else functools.partial(_read_tfds, source.name, source.data_dir))
  eval_split, class_names = read(source.eval_split)
  train_split = read(source.train_split)[0] if need_train else eval_split
  if need_train and train_split.images.shape[1:] != eval_split.images.shape[1:]:
    raise DataError(f'train images are {train_split.images.shape[1:]} but eval images are '
                    f'{eval_split.images.shape[1:]}; both splits need one image size')
  pixels = train_split.images.reshape(-1, train_split.images.shape[-1])
  # Subsample for the statistics: exact enough, and cheap on large splits.
  pixels = pixels[:: max(1, len(pixels) // 2_000_000)].astype(np.float32) / 255.0
  return Dataset(train=train_split, eval=eval_split, class_names=class_names,
                 mean=pixels.mean(axis=0), std=pixels.std(axis=0) + 1e-6)


def _read_tfds(name: str, data_dir: str, split: str) -> tuple[Split, tuple[str, ...]]:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  _tensorflow()
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise DataError(f'config.dataset.name={name!r} is not a TFDS dataset; use a name from '
                    'tfds.list_builders() (e.g. cifar10, mnist) or set config.dataset.folder') from e
  try:
    builder.download_and_prepare()
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(
        f'could not download or prepare TFDS dataset {name!r} ({type(e).__name__}); on an offline '
        'machine prepare it elsewhere and pass --config.dataset.data_dir, or use '
        '--config.dataset.folder') from e
  if split not in builder.info.splits:
    raise DataError(f'TFDS dataset {name!r} has no split {split!r}; it has: '
                    f'{", ".join(sorted(builder.info.splits))}')
  images, labels = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, as_supervised=True))
  names = builder.info.features['label'].names
  return Split(images.astype(np.uint8), labels.astype(np.int32)), tuple(names)


def _read_folder(root: str, split: str) -> tuple[Split, tuple[str, ...]]:
  _check_folder(root, split)
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  tf = _tensorflow()
  builder = tfds.ImageFolder(root)
  dataset = builder.as_dataset(split=split, shuffle_files=False)
  images, labels, filenames = [], [], []
  try:
    for example in tfds.as_numpy(dataset.batch(1024)):
      images.append(example['image'])
      labels.append(example['label'])
      filenames.append(example['image/filename'])
  except (tf.errors.InvalidArgumentError, tf.errors.UnknownError) as e:
    raise _find_bad_image(os.path.join(root, split)) from e
  images = np.concatenate(images)
  filenames = np.concatenate(filenames)
  # tfds.ImageFolder lists files in no promised order; sort so that every
  # process and every run sees the same example at the same index.
  order = np.argsort(filenames, kind='stable')
  return (Split(images[order].astype(np.uint8), np.concatenate(labels)[order].astype(np.int32)),
          tuple(builder.info.features['label'].names))


def _check_folder(root: str, split: str) -> None:
  """Names the folder when the layout is not root/split/class/image."""
  if not os.path.isdir(root):
    raise DataError(f'config.dataset.folder={root!r} is not a directory; point it at a folder '
                    'laid out as split/class/image')
  split_dir = os.path.join(root, split)
  if not os.path.isdir(split_dir):
    found = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    raise DataError(f'{split_dir} does not exist; splits found in {root}: '
                    f'{", ".join(found) or "none"} (set config.dataset.train_split/eval_split)')
  classes = sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
  if not classes:
    raise DataError(f'{split_dir} has no class folders; expected {split_dir}/<class>/<image>')
  for name in classes:
    class_dir = os.path.join(split_dir, name)
    if not any(f.lower().endswith(IMAGE_EXTENSIONS) for f in os.listdir(class_dir)):
      raise DataError(f'class folder {class_dir} has no images ({", ".join(IMAGE_EXTENSIONS)}); '
                      'add images or remove the folder')


def _find_bad_image(split_dir: str) -> DataError:
  """Decoding failed somewhere in the split: find the file, or the size that differs."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  first_size, first_path = None, None
  for class_name in sorted(os.listdir(split_dir)):
    class_dir = os.path.join(split_dir, class_name)
    for filename in sorted(os.listdir(class_dir)):
      if not filename.lower().endswith(IMAGE_EXTENSIONS):
        continue
      path = os.path.join(class_dir, filename)
      try:
        with Image.open(path) as image:
          image.load()
          size = image.size
      except Exception:  # pylint: disable=broad-except
        return DataError(f'cannot decode image {path}; remove or replace the file')
      if first_size is None:
        first_size, first_path = size, path
      elif size != first_size:
        return DataError(f'image {path} is {size[0]}x{size[1]} but {first_path} is '
                         f'{first_size[0]}x{first_size[1]}; all images need one size (resize them)')
  return DataError(f'cannot read the images in {split_dir}')


# --- training batches: a pure function of (seed, step) -------------------


def train_indices(seed: int, step: int, num_examples: int, batch_size: int) -> np.ndarray:
  """Indices of the global batch for `step`: epoch `step // steps_per_epoch` of a seeded shuffle."""
  steps_per_epoch = num_examples // batch_size
  epoch, position = divmod(step, steps_per_epoch)
  permutation = _epoch_permutation(seed, epoch, num_examples)
  return permutation[position * batch_size:(position + 1) * batch_size]


@functools.lru_cache(maxsize=2)
def _epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def process_slice(global_batch_size: int, process_index: int, process_count: int) -> slice:
  """This process's rows of a global batch (contiguous, as the batch sharding lays them out).

  `steps.place` has checked that the batch divides over the devices, hence the processes.
  """
  per_process = global_batch_size // process_count
  return slice(process_index * per_process, (process_index + 1) * per_process)


class Batch(NamedTuple):
  images: np.ndarray  # uint8 [B, H, W, C]
  labels: np.ndarray  # int32 [B]
  mask: np.ndarray  # bool [B]; False on padding rows of the last eval batch


def train_batches(split: Split, *, seed: int, batch_size: int, first_step: int, last_step: int,
                  process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
  """This process's part of the global batches for steps [first_step, last_step)."""
  rows = process_slice(batch_size, process_index, process_count)
  mask = np.ones(rows.stop - rows.start, bool)
  for step in range(first_step, last_step):
    indices = train_indices(seed, step, len(split), batch_size)[rows]
    yield Batch(split.images[indices], split.labels[indices], mask)


def eval_batches(split: Split, *, batch_size: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[Batch]:
  """Every example once, in order; the last global batch is padded and masked, never dropped."""
  rows = process_slice(batch_size, process_index, process_count)
  for start in range(0, len(split), batch_size):
    indices = np.arange(start, start + batch_size)[rows]
    mask = indices < len(split)
    indices = np.where(mask, indices, 0)
    yield Batch(split.images[indices], split.labels[indices], mask)


def prefetch(iterator: Iterator, size: int = 2) -> Iterator:
  """Runs `iterator` in a background thread, `size` items ahead of the consumer."""
  buffer: queue.Queue = queue.Queue(maxsize=size)
  done = object()

  def produce():
    try:
      for item in iterator:
        buffer.put(item)
      buffer.put(done)
    except BaseException as e:  # pylint: disable=broad-except
      buffer.put(e)

  threading.Thread(target=produce, daemon=True).start()
  while (item := buffer.get()) is not done:
    if isinstance(item, BaseException):
      raise item
    yield item


# --- prediction inputs -----------------------------------------------------


def read_images(path: str, image_shape: tuple[int, int, int]) -> tuple[list[str], np.ndarray]:
  """An image file, or every image under a folder (sorted), as uint8 [N, H, W, C]."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  if os.path.isdir(path):
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files
                   if f.lower().endswith(IMAGE_EXTENSIONS))
    if not paths:
      raise DataError(f'config.predict.input={path!r} holds no images ({", ".join(IMAGE_EXTENSIONS)})')
  elif os.path.isfile(path):
    paths = [path]
  else:
    raise DataError(f'config.predict.input={path!r} does not exist; give an image file or a folder')
  height, width, channels = image_shape
  images = []
  for image_path in paths:
    try:
      with Image.open(image_path) as image:
        image = image.convert('L' if channels == 1 else 'RGB')
        if image.size != (width, height):
          image = image.resize((width, height), Image.BILINEAR)
        array = np.asarray(image, np.uint8)
    except OSError as e:
      raise DataError(f'cannot decode image {image_path}; remove or replace the file') from e
    images.append(array.reshape(height, width, channels))
  return paths, np.stack(images)
