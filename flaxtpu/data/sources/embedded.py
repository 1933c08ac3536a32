"""Embedded datasets: small ones shipped with flaxtpu (flaxtpu/datasets/), read into memory, no download."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from flaxtpu.data.sources.base import DataError, Source, Split, parse_spec, slice_bounds

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # flaxtpu/
EMBEDDED = {'digits': 'digits.npz'}  # flaxtpu/datasets/: see its README for source and licence


def embedded_arrays(name: str, spec: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
  """A split of an embedded dataset as uint8 images, int32 labels and its class names."""
  path = os.path.join(_PACKAGE, 'datasets', EMBEDDED[name])
  images, labels = [], []
  with np.load(path) as arrays:
    splits = sorted(key[:-len('_images')] for key in arrays if key.endswith('_images'))
    for split_name, start, stop in parse_spec(spec):
      if split_name not in splits:
        raise DataError(f'dataset {name!r} has no split {split_name!r}; it has: {", ".join(splits)}')
      first, last = slice_bounds(start, stop, len(arrays[f'{split_name}_labels']))
      images.append(arrays[f'{split_name}_images'][first:last])
      labels.append(arrays[f'{split_name}_labels'][first:last])
    class_names = tuple(str(class_name) for class_name in arrays['class_names'])
  if not sum(map(len, labels)):
    raise DataError(f'split {spec!r} of {name!r} holds no examples; widen the slice')
  return np.concatenate(images), np.concatenate(labels), class_names



@dataclasses.dataclass(frozen=True)
class ArrayRecords:
  """Decoded images in memory: uint8 [N, H, W, C]."""
  images: np.ndarray
  split: str  # its spec, for messages

  def __len__(self) -> int:
    return len(self.images)

  def load(self, index: int) -> tuple[object, None]:
    return self.images[index], None

  def describe(self, index: int) -> str:
    return f'image {index} of split {self.split!r}'

  def subset(self, keep: np.ndarray) -> 'ArrayRecords':
    return dataclasses.replace(self, images=self.images[keep])


class EmbeddedSource(Source):
  """A small dataset shipped with flaxtpu (`EMBEDDED`), read into memory."""
  in_memory = True
  kind, fallback, title = 'embedded', True, 'embedded dataset'

  @classmethod
  def selects(cls, dataset) -> bool:
    return dataset.name in EMBEDDED

  @classmethod
  def create(cls, dataset, task: str) -> 'EmbeddedSource':
    del task
    return cls(dataset.name)

  def __init__(self, name: str):
    self.name = name

  def splits(self, train_spec, eval_spec, class_names):
    del class_names  # the file's own, the same in every split
    listed = {}
    for spec in [eval_spec] + ([train_spec] if train_spec is not None else []):
      images, labels, names = embedded_arrays(self.name, spec)
      listed[spec] = Split(name=spec, records=ArrayRecords(images, spec), labels=labels)
    self.channels = images.shape[-1]
    return listed.get(train_spec), listed[eval_spec], names

  def native_sizes(self, splits):
    return {split.records.images.shape[1:3] for split in splits}

  def arrays(self, split, fits_in_memory):
    return split.records.images, split.labels
