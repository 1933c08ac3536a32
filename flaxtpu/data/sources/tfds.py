"""TFDS datasets: prepared as ArrayRecord (records read by index, streamed) or, small ones
prepared as TFRecord, read whole into memory. An unprepared dataset is downloaded, after a quick
check that this machine is online (TFDS would otherwise retry for minutes)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from flaxtpu.data.sources.base import DataError, IndexedRecords, Source, Split, parse_spec
from flaxtpu.io import network

DOWNLOAD_HOST = ('storage.googleapis.com', 443)  # where TFDS looks first for prepared datasets


@dataclasses.dataclass(frozen=True)
class TfdsInfo:
  class_names: tuple[str, ...]
  image_shape: tuple  # (H, W, C) with None for sizes that vary
  array_record: bool  # prepared as ArrayRecord (random access), else TFRecord


def tfds_builder(name: str, data_dir: str):
  """The TFDS builder, prepared (downloaded) if needed, as ArrayRecord so it can stream."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except (tfds.core.registered.DatasetNotFoundError, ValueError) as e:  # ValueError: not even a name
    folder = ' (nor a folder: it does not exist)' if os.sep in name else ''
    raise DataError(f'config.dataset.name={name!r} is not a TFDS dataset{folder}; use a name from '
                    'tfds.list_builders() (e.g. cifar10, mnist, imagenet2012) or set '
                    'config.dataset.folder') from e
  if not builder.is_prepared():
    # TFDS would retry for minutes before failing.
    if (offline := network.network_problem(DOWNLOAD_HOST)) is not None:
      raise DataError(
          f'TFDS dataset {name!r} is not in {builder.data_dir} and this machine cannot download it '
          f'({offline}); prepare it on a machine that is online and pass --config.dataset.data_dir, or '
          'train on an image folder with --config.dataset.folder=PATH')
    try:
      builder.download_and_prepare(file_format='array_record')
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(
          f'could not download or prepare TFDS dataset {name!r} ({type(e).__name__}); on an offline '
          'machine prepare it elsewhere and pass --config.dataset.data_dir, or use '
          '--config.dataset.folder') from e
  return builder


def tfds_info(builder) -> TfdsInfo:
  image_key, label_key = builder.info.supervised_keys
  features = builder.info.features
  return TfdsInfo(class_names=tuple(features[label_key].names),
                  image_shape=tuple(features[image_key].shape),
                  array_record=str(builder.info.file_format).lower().endswith('array_record'))


def tfds_split(builder, spec: str) -> Split:
  """A split of a TFDS dataset prepared as ArrayRecord: records read on demand, images undecoded."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  _check_tfds_spec(builder, spec)
  image_key, label_key = builder.info.supervised_keys
  if not tfds_info(builder).array_record:
    raise DataError(
        f'TFDS dataset {builder.name!r} in {builder.data_dir} is prepared as TFRecord, which cannot be '
        'read by index; prepare it as ArrayRecord once: python -c "import tensorflow_datasets as tfds; '
        f"tfds.builder('{builder.name}', data_dir='DIR', file_format='array_record')"
        '.download_and_prepare()" (or set config.dataset.cache=memory for a small dataset)')
  records = builder.as_data_source(split=spec, decoders={image_key: tfds.decode.SkipDecoding()})
  return Split(name=spec, records=IndexedRecords(_Records(records, image_key, label_key, spec),
                                                 np.arange(len(records))))


def tfds_arrays(builder, spec: str) -> tuple[np.ndarray, np.ndarray]:
  """A whole split decoded into memory (small TFRecord datasets: MNIST, CIFAR)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  _check_tfds_spec(builder, spec)
  images, labels = tfds.as_numpy(builder.as_dataset(split=spec, batch_size=-1, as_supervised=True))
  return images.astype(np.uint8), labels.astype(np.int32)


def _check_tfds_spec(builder, spec: str) -> None:
  for split_name, _, _ in parse_spec(spec):
    if split_name not in builder.info.splits:
      raise DataError(f'TFDS dataset {builder.name!r} has no split {split_name!r}; it has: '
                      f'{", ".join(sorted(builder.info.splits))}')


class _Records:
  """A TFDS data source seen as {'image': encoded bytes, 'label': int} records."""

  def __init__(self, source, image_key: str, label_key: str, split: str):
    self._source, self._image_key, self._label_key, self._split = source, image_key, label_key, split

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> tuple[object, int]:
    record = self._source[index]
    return record[self._image_key], int(record[self._label_key])

  def describe(self, index: int) -> str:
    return f'record {index} of TFDS split {self._split!r}'


class TfdsSource(Source):
  """A TFDS dataset prepared as ArrayRecord: records read by index, images decoded when used."""
  kind, key, fallback, title = 'tfds', 'name', True, 'TFDS dataset'

  @classmethod
  def selects(cls, dataset) -> bool:
    return True  # the last kind asked: any other name is a TFDS catalog name

  @classmethod
  def create(cls, dataset, task: str) -> 'TfdsSource':
    del task
    builder = tfds_builder(dataset.name, dataset.data_dir)
    return TfdsSource(builder) if tfds_info(builder).array_record else TfdsMemorySource(builder)

  def __init__(self, builder):
    self.builder, self.info = builder, tfds_info(builder)
    self.channels = self.info.image_shape[-1]

  def splits(self, train_spec, eval_spec, class_names):
    del class_names  # the builder's label names, the same in every split
    train = tfds_split(self.builder, train_spec) if train_spec is not None else None
    return train, tfds_split(self.builder, eval_spec), self.info.class_names

  def native_sizes(self, splits):
    return {self.info.image_shape[:2]} if None not in self.info.image_shape[:2] else {None}

  def checked(self, split, num_workers, skip_corrupt):
    return split, self.native_sizes([split])  # a record that cannot be decoded fails when it is read


class TfdsMemorySource(TfdsSource):
  """A TFDS dataset prepared as TFRecord, which reads only in sequence: a small one (MNIST, CIFAR)
  is read whole into memory; a larger one must be prepared as ArrayRecord."""
  in_memory = True

  def splits(self, train_spec, eval_spec, class_names):
    del class_names
    listed = {}
    for spec in [eval_spec] + ([train_spec] if train_spec is not None else []):
      _check_tfds_spec(self.builder, spec)
      listed[spec] = Split(name=spec, records=_Unread(self.builder.info.splits[spec].num_examples))
    return listed.get(train_spec), listed[eval_spec], self.info.class_names

  def arrays(self, split, fits_in_memory):
    if not fits_in_memory:
      tfds_split(self.builder, split.name)  # raises, explaining how to prepare ArrayRecord
    return tfds_arrays(self.builder, split.name)



@dataclasses.dataclass(frozen=True)
class _Unread:
  """A TFRecord split's examples before `TfdsMemorySource.arrays` reads them all: only their count."""
  count: int

  def __len__(self) -> int:
    return self.count

  def load(self, index: int):
    raise NotImplementedError('a TFRecord split is read whole, by TfdsMemorySource.arrays')

  def describe(self, index: int) -> str:
    return f'example {index}'

  def subset(self, keep: np.ndarray) -> '_Unread':
    return _Unread(len(keep))
