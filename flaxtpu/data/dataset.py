"""The shapes the data package hands around: `Examples` (one split, streamed or cached), `Dataset`
(what `pipeline.load` gives the trainer) and `Batch`; label helpers shared by the cache and the
loaders."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np

from flaxtpu.data.preprocess import Transform
from flaxtpu.data.sources.base import DataError, Split


@dataclasses.dataclass(frozen=True)
class Examples:
  """One split: streamed from `source`, or cached as `images` (uint8 [N, H, W, C] or a list)
  with `labels` (int32 [N] or uint8 [N, C]) and, where the source reads examples in groups (tar
  shards), `groups` (int32 [N])."""
  source: Optional[Split] = None
  images: Optional[object] = None
  labels: Optional[np.ndarray] = None
  groups: Optional[np.ndarray] = None

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
  def example_groups(self) -> Optional[np.ndarray]:
    """Each example's group (its tar shard, int32 [N]); None for sources without groups."""
    return self.groups if self.cached else self.source.groups


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
  # shared-memory hand-over (see workers.run). Off by default; benchmarks/input/input_pipeline.py
  # measures both.
  worker_threads: bool = False
  skip_corrupt: bool = False
  multilabel: bool = False  # task=multilabel: labels are uint8 multi-hot rows
  class_weights: Optional[np.ndarray] = None  # float32 [num_classes] loss weights; None = unweighted
  sampling: str = 'shuffle'  # dataset.sampling: which `Sampler` orders the training examples
  repeats: int = 1  # augment.repeats: copies of each example in a batch (data/repeated.py)
  eval_transform: Optional[Transform] = None  # the eval split's at eval.image_size (None = `transform`)

  @property
  def eval_preprocessing(self) -> Transform:
    """How the eval split's images are made: at eval.image_size, else as `transform` makes them."""
    return self.eval_transform or self.transform

  @property
  def eval_image_shape(self) -> tuple[int, int, int]:
    """What the model sees in evaluation (eval.image_size; else `image_shape`)."""
    size = self.eval_preprocessing.size
    return (size, size, self.image_shape[-1]) if self.eval_transform and size else self.image_shape

  @property
  def num_classes(self) -> int:
    return len(self.class_names)


class Batch(NamedTuple):
  images: np.ndarray  # uint8 [B, H, W, C]
  labels: np.ndarray  # int32 [B] class indices, or uint8 [B, C] multi-hot rows (task=multilabel)
  mask: np.ndarray  # bool [B]; False on padding rows of the last eval batch


def image_shape(native: set, transform: Transform, channels: int) -> tuple[int, int, int]:
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


def label_of(value) -> object:
  """One example's label as a loader returns it: an int, or a uint8 [C] multi-hot row."""
  return int(value) if np.ndim(value) == 0 else np.asarray(value, np.uint8)


def label_batch(labels: list) -> np.ndarray:
  """Labels read one at a time, as a batch: int32 [B] indices, or uint8 [B, C] multi-hot rows."""
  if labels and np.ndim(labels[0]) == 1:
    return np.stack(labels).astype(np.uint8)
  return np.asarray(labels, np.int32)


def listed_train_labels(train: Examples, needed_by: str) -> np.ndarray:
  """The train split's labels, which `needed_by` counts before the first step."""
  from flaxtpu.data import sources  # pylint: disable=g-import-not-at-top  # the kinds, for the message
  labels = train.listed_labels
  if labels is None:
    raise DataError(f'config.dataset.{needed_by} counts the train split\'s labels before training, '
                    'which a streamed TFDS split does not list; set --config.dataset.cache=memory '
                    f'(or prepare the data as {sources.listing_titles_text()})')
  return labels

