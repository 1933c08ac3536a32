"""What every source kind shares: `Split`, `Source`, `DataError`, split specs, header scans.

A split is a random-access list of (undecoded image, label). Its `records`
are the kind's own (files, tar members, parquet rows, TFDS records, arrays)
behind one small interface (`Records`): nothing is decoded here, so a split
of a million images costs its file list, not its pixels, and every kind
pickles cheaply into the input workers. Labels are class indices, or
multi-hot rows under task=multilabel; `groups` says, where a kind has them,
which group (a tar shard) each example is read from.

Slices are taken along a fixed stratified order (the same on every machine
and run): each class's examples are shuffled with a fixed seed, then the
classes are interleaved evenly. So a slice such as `train[:90%]` takes 90%
of every class (to within one example) and `train[90%:]` holds out the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Optional, Protocol, Sequence

import numpy as np

from flaxtpu.data import preprocess, workers
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.errors import printable as printable  # the sources name files and classes with it

ALL = 'all'  # the split name for a folder laid out as root/class/image, without split folders
FOLDER_ORDER_SEED = 0  # the fixed shuffle within each class; changing it reshuffles every slice
UNKNOWN_CLASSES = ('error', 'drop')  # dataset.unknown_classes: a class folder training never saw


class DataError(UserError):
  """A dataset that cannot be read; the message names the file, folder or key."""


class Records(Protocol):
  """A kind's examples of one split, by position: what `Split` reads through."""

  def __len__(self) -> int:
    ...

  def load(self, index: int) -> tuple[object, object]:
    """(what `preprocess.open_image` opens, the label when the record holds it, else None)."""

  def describe(self, index: int) -> str:
    """The example as a user finds it: its file, or its record or position in the split."""

  def subset(self, keep: np.ndarray) -> 'Records':
    """The records at positions `keep`."""


@dataclasses.dataclass(frozen=True)
class IndexedRecords:
  """Records picked by index from a kind's random-access `store` (TFDS records, tar members,
  parquet rows): `store[i]` is what `load` gives, `store.describe(i)` names it."""
  store: object
  indices: np.ndarray  # the store index of each example

  def __len__(self) -> int:
    return len(self.indices)

  def load(self, index: int) -> tuple[object, object]:
    return self.store[int(self.indices[index])]

  def describe(self, index: int) -> str:
    return self.store.describe(int(self.indices[index]))

  def subset(self, keep: np.ndarray) -> 'IndexedRecords':
    return dataclasses.replace(self, indices=self.indices[keep])


@dataclasses.dataclass(frozen=True)
class Split:
  """One (possibly sliced) split; `load(i)` gives what `preprocess.open_image` opens, and the label.

  Labels are int32 [N] class indices, or uint8 [N, C] multi-hot rows (task=multilabel; a row may
  be all zeros); `load` gives an int, or that uint8 [C] row. `labels` is None where only the
  records hold them (TFDS); `groups` (int32 [N]) is each example's group where the kind reads
  examples in groups (tar shards), else None.
  """
  name: str  # the spec, e.g. 'train[:90%]'
  records: Records
  labels: Optional[np.ndarray] = None
  groups: Optional[np.ndarray] = None

  def __len__(self) -> int:
    return len(self.records)

  def load(self, index: int) -> tuple[object, int | np.ndarray]:
    item, label = self.records.load(index)
    return item, (label if self.labels is None else self.label(index))

  def label(self, index: int) -> int | np.ndarray:
    label = self.labels[index]
    return int(label) if self.labels.ndim == 1 else label

  def describe(self, index: int) -> str:
    """The example as a user finds it: its file, or its record or position in the split."""
    return self.records.describe(index)

  def subset(self, keep: np.ndarray) -> 'Split':
    """The examples at positions `keep` (e.g. without the files that cannot be read)."""
    return dataclasses.replace(self, records=self.records.subset(keep),
                               labels=None if self.labels is None else self.labels[keep],
                               groups=None if self.groups is None else self.groups[keep])


# --- split specs: 'train', 'train[:90%]', 'train[1000:]', 'train[:10%]+test' ---------------

_SLICE = re.compile(r'^(?P<split>[\w-]+)(\[(?P<start>-?\d*%?):(?P<stop>-?\d*%?)\])?$')


def parse_spec(spec: str) -> list[tuple[str, str, str]]:
  """'train[:90%]+test' -> [('train', '', '90%'), ('test', '', '')]; a bad spec is a DataError."""
  parts = []
  for part in spec.replace(' ', '').split('+'):
    match = _SLICE.match(part)
    if not match:
      raise DataError(f'split {spec!r} is not valid; write NAME, NAME[START:STOP] with example counts '
                      'or percentages (train[:90%], train[90%:], train[:1000]), or join them with +')
    parts.append((match['split'], match['start'] or '', match['stop'] or ''))
  return parts


def slice_bounds(start: str, stop: str, size: int) -> tuple[int, int]:
  """TFDS's slice arithmetic: percentages round to the closest example; negatives count from the end."""

  def position(text: str, default: int) -> int:
    if not text:
      return default
    value = float(text[:-1]) * size / 100 if text.endswith('%') else int(text)
    value = int(round(value))
    return min(max(value + size if value < 0 else value, 0), size)

  return position(start, 0), position(stop, size)


def stratified_order(labels: np.ndarray) -> np.ndarray:
  """A fixed order in which every prefix holds each class in proportion to its size."""
  rng = np.random.default_rng(FOLDER_ORDER_SEED)
  keys = np.empty(len(labels))
  for label in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == label))
    keys[members] = (np.arange(len(members)) + 0.5) / len(members)  # evenly spread over [0, 1)
  return np.lexsort((labels, keys))


def listed(class_names: Sequence[str], count: int = 10) -> str:
  """The first `count` class names for a message."""
  return ', '.join(printable(name) for name in class_names[:count]) + (
      ', ...' if len(class_names) > count else '')


def missing_classes(labels: np.ndarray, class_names: Sequence[str]) -> list[str]:
  """The classes of which a split holds no example (labels: indices, or multi-hot rows)."""
  present = (labels.any(axis=0) if labels.ndim == 2 else
             np.bincount(labels, minlength=len(class_names)) > 0)
  return [name for name, found in zip(class_names, present) if not found]


def warn_missing_classes(split: Split, class_names: Sequence[str]) -> None:
  """An eval split without some classes is fine, but worth a line: their rows will show support 0."""
  if missing := missing_classes(split.labels, class_names):
    logging.warning('eval split %r has no examples of %d of the %d classes: %s; their per-class rows show '
                    'support 0', split.name, len(missing), len(class_names), listed(missing, 20))


# --- scanning a folder: sizes, and files that are not images --------------------------------


SCAN_CHUNK = 512  # files per scan task: large enough that a task outweighs handing it to a worker


def unreadable(where: str, error: Exception) -> str:
  """What is wrong with a file that cannot be opened or decoded, and what to do about it."""
  where = printable(where)
  if isinstance(error, PermissionError):
    return f'cannot read {where} (permission denied); fix its permissions or remove it'
  reason = ' '.join(str(error).split())  # one line, whatever the library wrote
  return (f'cannot decode image {where} ({type(error).__name__}{": " if reason else ""}{reason}); '
          'remove or replace it')


def _header_size(split: Split, index: int) -> tuple[int, int] | str:
  """(height, width) from the file's header (its pixels stay unread), or what is wrong with it.

  A record that gives no image at all (a null parquet cell, an empty tar member) is wrong the same way,
  named as the user finds it (`describe`).
  """
  try:
    path, _ = split.load(index)
    with preprocess.open_image(path) as image:
      width, height = preprocess.upright_size(image)
      return height, width
  except Exception as e:  # pylint: disable=broad-except
    return unreadable(split.describe(index), e)


def _header_sizes(split: Split) -> list:
  """The header sizes of a chunk of a split's files (a `Split` of them)."""
  return [_header_size(split, index) for index in range(len(split))]


def scan(split: Split, num_workers: int, skip_corrupt: bool) -> tuple[Split, set]:
  """Reads every file's header (not its pixels), `num_workers` processes at a time.

  Returns the split without unreadable files (with `skip_corrupt`; else the
  first is named in a DataError) and the set of (height, width) sizes.
  """
  chunks = [split.subset(np.arange(start, min(start + SCAN_CHUNK, len(split))))
            for start in range(0, len(split), SCAN_CHUNK)]
  # Processes only for 4+ chunks each: starting one costs more than a few small chunks.
  scanned = workers.pool_map(_header_sizes, chunks, min(num_workers, len(chunks) // 4))
  scanned = workers.with_progress(scanned, len(split), f'reading the headers of {split.name!r}')
  results = [result for chunk in scanned for result in chunk]
  split, keep = without_unreadable(split, [r if isinstance(r, str) else None for r in results],
                                   skip_corrupt)
  return split, {results[i] for i in keep}


def sample_sizes(split: Split, count: int = 32) -> set:
  """The sizes of `count` evenly spaced files: enough to size a cache without reading every header.

  Files that cannot be read are left out here; decoding or the scan names them. Where none of them
  can, the split is not images (or not ones this reads): a DataError naming the first.
  """
  positions = np.linspace(0, len(split) - 1, min(count, len(split))).astype(int)
  sizes = [_header_size(split, i) for i in positions]
  readable = {size for size in sizes if not isinstance(size, str)}
  if sizes and not readable:
    first = sizes[0].rpartition('; ')[0] or sizes[0]  # what is wrong, less its fix for one file
    which = (f'none of the {len(sizes)} files sampled across {split.name!r} can' if len(sizes) > 1
             else f'the one file of {split.name!r} cannot')
    raise DataError(f'{which} be read as an image, e.g. {first}; point the dataset at images, or remove '
                    'what is not one')
  return readable


def without_unreadable(split: Split, problems: list, skip_corrupt: bool) -> tuple[Split, np.ndarray]:
  """The split less the files whose `problems` entry is set, and the positions kept.

  Without `skip_corrupt` the first problem is a DataError; with it they are logged and dropped.
  """
  bad = [i for i, problem in enumerate(problems) if problem]
  if bad and not skip_corrupt:
    more = f' ({len(bad) - 1} more files cannot be read either)' if len(bad) > 1 else ''
    raise DataError(f'{problems[bad[0]]}, or set --config.dataset.skip_corrupt=true to skip such '
                    f'files{more}')
  keep = np.setdiff1d(np.arange(len(split)), bad)
  if bad:
    logging.warning('skipping %d of %d files of %r that cannot be read (dataset.skip_corrupt), '
                    'e.g. %s', len(bad), len(split), split.name, split.describe(bad[0]))
    split = split.subset(keep)
  return split, keep

# --- the sources: one class per kind, the same methods ------------------------------------


class Source:
  """A kind of dataset: what `pipeline.load` asks of it, and what the registry (`sources`) asks.

  The registry side (class attributes and classmethods): `key`, the
  config.dataset key whose value selects the kind (each kind owns it, its
  checks in `check` and the defaults in `keys`); `selects(dataset)`; and
  `create(dataset, task)`. A `fallback` kind (folder, embedded, TFDS) is
  asked only after every kind with a key of its own.

  The pipeline side: `splits` lists the train (when asked) and eval split,
  undecoded, with the class names their labels index. `native_sizes` says the
  (height, width) of their images ({None} when they vary) without decoding
  them. A source that is `in_memory` hands each split over decoded
  (`arrays`); any other split is cached or streamed by the pipeline, and
  before streaming `checked` drops what cannot be read. The defaults suit
  splits of files (paths and labels).
  """
  kind = ''  # the registry's name for it
  key = ''  # the config.dataset key that selects it ('' = none of its own)
  keys: dict = {}  # config.dataset keys this kind adds to the config, with their defaults
  fallback = False  # asked after the kinds selected by a key of their own
  multilabel = False  # its labels can carry any number of tags (task=multilabel)
  lists_labels = False  # every example's label is known without reading its image
  title = ''  # how messages name the kind ('label file')

  @classmethod
  def selects(cls, dataset) -> bool:
    """Whether config.dataset (or a `DatasetSpec`'s settings) names this kind."""
    return bool(dataset.get(cls.key)) if cls.key else False

  @classmethod
  def check(cls, config) -> None:
    """Raises ConfigError for a key of this kind that cannot work (before any work starts)."""

  @classmethod
  def create(cls, dataset, task: str) -> 'Source':
    """The source config.dataset (or a spec's settings) names, labelled for `task`."""
    return cls(dataset, task)

  in_memory = False
  channels = 3  # of the decoded images (set by `splits` where the data says)

  def splits(self, train_spec: Optional[str], eval_spec: str,
             class_names: Optional[Sequence[str]]) -> tuple[Optional[Split], Split, tuple[str, ...]]:
    """(train split or None when `train_spec` is None, eval split, class names); `class_names`
    (a checkpoint's, or the training split's) set the classes when given."""
    raise NotImplementedError

  def native_sizes(self, splits: Sequence[Split]) -> set:
    # A sample of headers sizes the cache; decoding a cached split checks every file anyway.
    return set().union(*(sample_sizes(split) for split in splits))

  def checked(self, split: Split, num_workers: int, skip_corrupt: bool) -> tuple[Split, set]:
    """Before streaming: the split less what cannot be read, and its images' sizes."""
    return scan(split, num_workers, skip_corrupt)

  def arrays(self, split: Split, fits_in_memory: bool) -> tuple[np.ndarray, np.ndarray]:
    """An `in_memory` source's split decoded: uint8 images [N, H, W, C] and int32 labels."""
    raise NotImplementedError
