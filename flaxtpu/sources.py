"""Where examples come from: one class per kind of dataset, the same methods for each.

`get(config.dataset, config.task)` picks the source: a label file (CSV or
JSON Lines beside a folder of images in any layout), WebDataset-style tar
shards, parquet files (e.g. a Hugging Face copy), an image folder, an
embedded dataset, a TFDS dataset prepared as ArrayRecord (streamed) or as
TFRecord (read into memory). `data.load` builds its batches from whichever it
gets (`Source` says what each offers), so adding a source adds a class here.

A split is a random-access list of (undecoded image, label): file paths for
a folder or a label file, tar members (by offset) and parquet rows,
ArrayRecord records for TFDS, arrays for an in-memory source. Nothing is
decoded here, so a split of a million images costs its file list, not its
pixels. Every kind pickles cheaply into the input workers. Labels are class
indices, or multi-hot rows under task=multilabel.

Slices are taken along a fixed stratified order (the same on every machine
and run): each class's examples are shuffled with a fixed seed, then the
classes are interleaved evenly. So a slice such as `train[:90%]` takes 90%
of every class (to within one example) and `train[90%:]` holds out the rest.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import functools
import glob
import io
import json
import logging
import os
import posixpath
import re
import socket
import tarfile
import threading
import urllib.parse
from typing import Callable, NamedTuple, Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu import files, preprocess, storage, workers
from flaxtpu.errors import UserError
from flaxtpu.preprocess import IMAGE_EXTENSIONS

ALL = 'all'  # the split name for a folder laid out as root/class/image, without split folders
FOLDER_ORDER_SEED = 0  # the fixed shuffle within each class; changing it reshuffles every slice
UNKNOWN_CLASSES = ('error', 'drop')  # dataset.unknown_classes: a class folder training never saw


class DataError(UserError):
  """A dataset that cannot be read; the message names the file, folder or key."""


@dataclasses.dataclass(frozen=True)
class Split:
  """One (possibly sliced) split; `load(i)` gives what `preprocess.open_image` opens, and the label.

  Labels are int32 [N] class indices, or uint8 [N, C] multi-hot rows (task=multilabel; a row may
  be all zeros); `load` gives an int, or that uint8 [C] row.
  """
  name: str  # the spec, e.g. 'train[:90%]'
  paths: Optional[np.ndarray] = None  # files: bytes [N], relative to `root`
  labels: Optional[np.ndarray] = None  # known without opening an image (None: TFDS records hold them)
  root: str = ''
  records: object = None  # TFDS, shards, parquet: a random-access source of {'image': ..., 'label': ...}
  indices: Optional[np.ndarray] = None  # with records: the record index of each example
  images: Optional[np.ndarray] = None  # in memory: uint8 [N, H, W, C], decoded already
  shards: Optional[np.ndarray] = None  # tar shards: int32 [N], the shard each example is in

  def __len__(self) -> int:
    return len(self.labels) if self.labels is not None else len(self.indices)

  def load(self, index: int) -> tuple[object, int | np.ndarray]:
    if self.paths is not None:
      item = os.path.join(self.root, os.fsdecode(self.paths[index]))
      if storage.is_remote(item):  # an object in a bucket: its bytes (a local file is opened lazily)
        item = files.open_bytes(item)
    elif self.images is not None:
      item = self.images[index]
    else:
      record = self.records[int(self.indices[index])]
      if self.labels is None:  # TFDS: the record holds the label
        return record['image'], record['label']
      item = record['image']
    return item, self.label(index)

  def label(self, index: int) -> int | np.ndarray:
    label = self.labels[index]
    return int(label) if self.labels.ndim == 1 else label

  def describe(self, index: int) -> str:
    """The example as a user finds it: its file, or its record or position in the split."""
    if self.paths is not None:
      return os.path.join(self.root, os.fsdecode(self.paths[index]))
    if hasattr(self.records, 'describe'):  # a tar member or a parquet row
      return self.records.describe(int(self.indices[index]))
    if self.indices is not None:
      return f'record {int(self.indices[index])} of TFDS split {self.name!r}'
    return f'image {index} of split {self.name!r}'

  def subset(self, keep: np.ndarray) -> 'Split':
    """The examples at positions `keep` (e.g. without the files that cannot be read)."""
    kept = {field: getattr(self, field)[keep] for field in ('labels', 'paths', 'indices', 'images', 'shards')
            if getattr(self, field) is not None}
    return dataclasses.replace(self, **kept)


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


# --- embedded datasets: ship with flaxtpu, need no download -------------------------------

EMBEDDED = {'digits': 'digits.npz'}  # flaxtpu/datasets/: see its README for source and licence


def embedded_arrays(name: str, spec: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
  """A split of an embedded dataset as uint8 images, int32 labels and its class names."""
  path = os.path.join(os.path.dirname(__file__), 'datasets', EMBEDDED[name])
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


# --- image folders ------------------------------------------------------------------------


def folder_split(root: str, spec: str, class_names: Optional[Sequence[str]] = None,
                 unknown_classes: str = 'error') -> tuple[Split, tuple[str, ...]]:
  """A split of `root/split/class/image` and the class names its labels index.

  Without `class_names` (the training split) they are the first part's sorted
  class folders. Every other part, and a split given `class_names` (the
  training split's or a checkpoint's), is matched to them by folder name, so
  a label means the same class in every split. A folder of a class not in
  the list is a DataError naming it, or with `unknown_classes='drop'` its
  images are left out with a warning; a split may lack classes.
  """
  if not files.isdir(root):
    raise DataError(f'config.dataset.folder={root!r} is not a directory; point it at a folder '
                    'laid out as split/class/image')
  if unknown_classes not in UNKNOWN_CLASSES:
    raise DataError(f'config.dataset.unknown_classes={unknown_classes!r} is not one of '
                    f'{", ".join(UNKNOWN_CLASSES)}')
  paths, labels = [], []
  for split_name, start, stop in parse_spec(spec):
    images_by_class = _list_folder_split(root, split_name)
    if class_names is None:
      class_names = tuple(images_by_class)
    split_paths, split_labels = _match_classes(images_by_class, tuple(class_names), root, split_name,
                                               unknown_classes)
    order = _stratified_order(np.asarray(split_labels))
    first, last = slice_bounds(start, stop, len(order))
    paths += [split_paths[i] for i in order[first:last]]
    labels += [split_labels[i] for i in order[first:last]]
  if not paths:
    raise DataError(f'split {spec!r} of {root} holds no examples; widen the slice')
  # fsencode: a file name that is not UTF-8 (a surrogate-escaped str) keeps its bytes.
  return Split(name=spec, paths=np.asarray([os.fsencode(p) for p in paths]),
               labels=np.asarray(labels, np.int32), root=root), tuple(class_names)


def _match_classes(images_by_class: dict[str, list[str]], class_names: tuple[str, ...], root: str,
                   split: str, unknown_classes: str) -> tuple[list[str], list[int]]:
  """(paths, labels) of a split's class folders, each labelled by its name's index in `class_names`."""
  index = {name: label for label, name in enumerate(class_names)}
  unknown = [name for name in images_by_class if name not in index]
  if unknown:
    shown = ', '.join(f'{printable(name)} ({len(images_by_class[name])} images)' for name in unknown[:5])
    more = f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''
    if unknown_classes != 'drop':
      raise DataError(f'split {split!r} of {root} has class folders the model is not trained on: '
                      f"{shown}{more}; the model's {len(class_names)} classes are {_listed(class_names)}; "
                      'rename or remove them, or set --config.dataset.unknown_classes=drop to leave their '
                      'images out')
    logging.warning('leaving out class folders of split %r of %s that the model is not trained on '
                    '(dataset.unknown_classes=drop): %s%s', split, root, shown, more)
  paths, labels = [], []
  for name, images in images_by_class.items():
    if name in index:
      paths += images
      labels += [index[name]] * len(images)
  if not paths:
    raise DataError(f'split {split!r} of {root} has none of the model\'s classes '
                    f'({_listed(class_names, 5)}); is it the right folder?')
  return paths, labels


def _listed(class_names: Sequence[str], count: int = 10) -> str:
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
                    'support 0', split.name, len(missing), len(class_names), _listed(missing, 20))


def printable(text: str) -> str:
  """A file or class name fit for a one-line message: newlines, control characters and bytes
  that are not UTF-8 written as backslash escapes."""
  if text.isprintable():
    return text
  return ''.join(char if char.isprintable() else
                 # a byte that os.fsdecode kept
                 f'\\x{ord(char) - 0xdc00:02x}' if 0xdc80 <= ord(char) <= 0xdcff else
                 char.encode('unicode_escape').decode('ascii') for char in text)


def _stratified_order(labels: np.ndarray) -> np.ndarray:
  """A fixed order in which every prefix holds each class in proportion to its size."""
  rng = np.random.default_rng(FOLDER_ORDER_SEED)
  keys = np.empty(len(labels))
  for label in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == label))
    keys[members] = (np.arange(len(members)) + 0.5) / len(members)  # evenly spread over [0, 1)
  return np.lexsort((labels, keys))


def folder_classes(root: str, spec: str) -> Optional[tuple[str, ...]]:
  """The class names training on split `spec` gives (its first part's class folders); None when
  there is no such split (a folder holding only an eval split)."""
  try:
    return tuple(_class_dirs(root, parse_spec(spec)[0][0])[1])
  except DataError:
    return None


def _class_dirs(root: str, split: str) -> tuple[str, dict[str, str]]:
  """The split's folder and its class folders: name -> real path, in name order."""
  if storage.is_remote(root):
    return _remote_class_dirs(root, split)
  # `all` is the root itself when it holds the class folders directly (root/class/image).
  split_dir = (root if split == ALL and not os.path.isdir(os.path.join(root, ALL))
               else os.path.join(root, split))
  if not os.path.isdir(split_dir):
    found = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if found and any(name.lower().endswith(IMAGE_EXTENSIONS)
                     for name in os.listdir(os.path.join(root, found[0]))):
      raise DataError(f'{root} holds class folders ({", ".join(found[:3])}, ...) with no split folders; '
                      f"hold out a part with --config.dataset.train_split='{ALL}[:80%]' "
                      f"--config.dataset.eval_split='{ALL}[80%:]'")
    raise DataError(f'{split_dir} does not exist; splits found in {root}: '
                    f'{", ".join(found) or "none"} (set config.dataset.train_split/eval_split)')
  split_real = os.path.realpath(split_dir)
  class_dirs = {}
  for name in sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d))):
    real = os.path.realpath(os.path.join(split_dir, name))
    if _inside(split_real, real):  # a link to the split folder or above it: a loop, not a class
      logging.warning('not following %s -> %s: it leads back to the folder it is in (a loop)',
                      printable(os.path.join(split_dir, name)), printable(real))
    else:
      class_dirs[name] = real
  if not class_dirs:
    raise DataError(f'{split_dir} has no class folders; expected {split_dir}/<class>/<image>')
  return split_dir, class_dirs


def _remote_class_dirs(root: str, split: str) -> tuple[str, dict[str, str]]:
  """_class_dirs of a folder in an object store (no links there to follow or refuse)."""
  split_dir = root if split == ALL and not files.isdir(files.join(root, ALL)) else files.join(root, split)
  if not files.isdir(split_dir):
    found = sorted(name for name in files.listdir(root) if files.isdir(files.join(root, name)))
    raise DataError(f'{split_dir} does not exist; splits found in {root}: '
                    f'{", ".join(found) or "none"} (set config.dataset.train_split/eval_split)')
  class_dirs = {name: files.join(split_dir, name) for name in sorted(files.listdir(split_dir))
                if files.isdir(files.join(split_dir, name))}
  if not class_dirs:
    raise DataError(f'{split_dir} has no class folders; expected {split_dir}/<class>/<image>')
  return split_dir, class_dirs


def _remote_image_files(top: str) -> list[str]:
  """image_files of a folder in an object store."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  top = top.rstrip('/')
  found = []
  for directory, _, names in epath.Path(top).walk():
    # gcsfs names the folders it walks without their gs://, TensorFlow's gfile with it.
    below = str(directory).split('://', 1)[-1][len(top.split('://', 1)[-1]):].strip('/')
    found += [posixpath.join(top, below, name) for name in names
              if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith('._')]
  return found


def _list_folder_split(root: str, split: str) -> dict[str, list[str]]:
  """Class folder name -> its image paths (relative to `root`, sorted), in class-name order."""
  split_dir, class_dirs = _class_dirs(root, split)
  if storage.is_remote(root):
    prefix = len(root.rstrip('/')) + 1
    return {name: sorted(path[prefix:] for path in _remote_image_files(class_dir)) or _no_images(class_dir)
            for name, class_dir in class_dirs.items()}
  split_real = os.path.realpath(split_dir)
  images_by_class = {}
  for name in class_dirs:
    class_dir = os.path.join(split_dir, name)
    others = [real for other, real in class_dirs.items() if other != name]
    images = sorted(os.path.relpath(path, root) for path in image_files(class_dir, split_real, others))
    if not images:
      raise DataError(f'class folder {class_dir} has no images ({", ".join(IMAGE_EXTENSIONS)}); '
                      'add images or remove the folder')
    images_by_class[name] = images
  return images_by_class


def _no_images(class_dir: str):
  raise DataError(f'class folder {class_dir} has no images ({", ".join(IMAGE_EXTENSIONS)}); '
                  'add images or remove the folder')


def image_files(top: str, split_real: str = '', other_classes: Sequence[str] = ()) -> list[str]:
  """The image files under `top` (its path joined to theirs), following linked folders once each.

  A linked folder is not followed (a warning names it) when it was read
  already -- a loop such as a link to `..` or between sibling folders, or a
  second link to one folder -- when it holds `top` or the split folder
  `split_real` (a link to the dataset root or `/`), or when it is inside, or
  holds, another class's folder (`other_classes`, real paths), whose images
  would be labelled twice.
  """
  top_real = os.path.realpath(top)
  walked = {top_real}
  found = []
  for directory, subdirectories, names in os.walk(top, followlinks=True):
    kept = []
    for name in subdirectories:
      path = os.path.join(directory, name)
      real = os.path.realpath(path)
      if real in walked:
        why = 'it leads to a folder read already (a loop, or a second link to it)'
      elif os.path.islink(path) and (_inside(top_real, real) or (split_real and _inside(split_real, real))):
        why = 'it leads back to a folder that holds it (a loop)'
      elif os.path.islink(path) and any(_inside(real, other) or _inside(other, real)
                                        for other in other_classes):
        why = "it leads into another class's folder"
      else:
        walked.add(real)
        kept.append(name)
        continue
      logging.warning('not following %s -> %s: %s', printable(path), printable(real), why)
    subdirectories[:] = kept  # os.walk descends only into these
    found += [os.path.join(directory, name) for name in names
              if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith('._')]
  return found


def _inside(path: str, folder: str) -> bool:
  """Whether `path` is `folder` or below it (both real paths)."""
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


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
  """(height, width) from the file's header (its pixels stay unread), or what is wrong with it."""
  path, _ = split.load(index)
  try:
    with preprocess.open_image(path) as image:
      width, height = preprocess.upright_size(image)
      return height, width
  except Exception as e:  # pylint: disable=broad-except
    return unreadable(path, e)


class _HeaderScan:
  """The header sizes of one chunk of a split's files."""

  def __init__(self, split: Split):
    self.split = split

  def __call__(self, chunk: int) -> list:
    return [_header_size(self.split, index)
            for index in range(chunk * SCAN_CHUNK, min((chunk + 1) * SCAN_CHUNK, len(self.split)))]


def scan(split: Split, num_workers: int, skip_corrupt: bool) -> tuple[Split, set]:
  """Reads every file's header (not its pixels), `num_workers` processes at a time.

  Returns the split without unreadable files (with `skip_corrupt`; else the
  first is named in a DataError) and the set of (height, width) sizes.
  """
  chunks = range(-(-len(split) // SCAN_CHUNK))
  scanned = workers.run(_HeaderScan(split), chunks, num_workers, buffer=4, min_items_per_worker=4)
  scanned = workers.with_progress(scanned, len(split), f'reading the headers of {split.name!r}')
  results = [result for chunk in scanned for result in chunk]
  split, keep = without_unreadable(split, [r if isinstance(r, str) else None for r in results],
                                   skip_corrupt)
  return split, {results[i] for i in keep}


def sample_sizes(split: Split, count: int = 32) -> set:
  """The sizes of `count` evenly spaced files: enough to size a cache without reading every header.

  Files that cannot be read are left out here; decoding or the scan names them.
  """
  positions = np.linspace(0, len(split) - 1, min(count, len(split))).astype(int)
  return {size for size in (_header_size(split, i) for i in positions) if not isinstance(size, str)}


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


# --- TFDS -----------------------------------------------------------------------------------


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
  except tfds.core.registered.DatasetNotFoundError as e:
    raise DataError(f'config.dataset.name={name!r} is not a TFDS dataset; use a name from '
                    'tfds.list_builders() (e.g. cifar10, mnist, imagenet2012) or set '
                    'config.dataset.folder') from e
  if not builder.is_prepared():
    if (offline := network_problem()) is not None:  # TFDS would retry for minutes before failing
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


DOWNLOAD_HOST = ('storage.googleapis.com', 443)  # where TFDS looks first for prepared datasets
NETWORK_TIMEOUT_S = 5.0


def network_problem(address: Optional[tuple[str, int]] = None,
                    timeout_s: float = NETWORK_TIMEOUT_S) -> Optional[str]:
  """None if `address` (DOWNLOAD_HOST when None, or the HTTPS proxy) answers within `timeout_s`,
  else why not."""
  address = address or DOWNLOAD_HOST
  proxy = os.environ.get('HTTPS_PROXY') or os.environ.get('https_proxy')
  parsed = (urllib.parse.urlsplit(proxy if '://' in proxy else f'http://{proxy}') if proxy
            else None)
  host, port = (parsed.hostname, parsed.port or 3128) if parsed and parsed.hostname else address
  outcome: list[str] = []

  def connect() -> None:
    try:
      socket.create_connection((host, port), timeout=timeout_s).close()
      outcome.append('')
    except OSError as e:
      outcome.append(f'connecting to {host}:{port} failed: {e.strerror or e}')

  # A resolver without network can hang longer than the connect timeout: bound both.
  probe = threading.Thread(target=connect, daemon=True)
  probe.start()
  probe.join(2 * timeout_s)
  if not outcome:
    return f'no answer from {host}:{port} in {2 * timeout_s:.0f}s'
  return outcome[0] or None


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
  return Split(name=spec, records=_Records(records, image_key, label_key),
               indices=np.arange(len(records)))


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

  def __init__(self, source, image_key: str, label_key: str):
    self._source, self._image_key, self._label_key = source, image_key, label_key

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict:
    record = self._source[index]
    return {'image': record[self._image_key], 'label': int(record[self._label_key])}


# --- the sources: one class per kind, the same methods ------------------------------------


class Source:
  """What `data.load` asks of every kind of dataset.

  `splits` lists the train (when asked) and eval split, undecoded, with the
  class names their labels index. `native_sizes` says the (height, width) of
  their images ({None} when they vary) without decoding them. A source that
  is `in_memory` hands each split over decoded (`arrays`); any other split is
  cached or streamed by `data.py`, and before streaming `checked` drops what
  cannot be read. The defaults suit splits of files (paths and labels).
  """
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


class FolderSource(Source):
  """root/split/class/image (or root/class/image as split `all`): classes matched by folder name."""

  def __init__(self, root: str, train_spec: str, unknown_classes: str = 'error'):
    self.root, self.train_spec, self.unknown_classes = root, train_spec, unknown_classes

  def splits(self, train_spec, eval_spec, class_names):
    train = None
    if train_spec is not None:
      train, class_names = folder_split(self.root, train_spec, class_names, self.unknown_classes)
    elif class_names is None:  # evaluating alone: the classes training on train_spec gives
      class_names = folder_classes(self.root, self.train_spec)
    evaluation, class_names = folder_split(self.root, eval_spec, class_names, self.unknown_classes)
    warn_missing_classes(evaluation, class_names)
    return train, evaluation, class_names


class EmbeddedSource(Source):
  """A small dataset shipped with flaxtpu (`EMBEDDED`), read into memory."""
  in_memory = True

  def __init__(self, name: str):
    self.name = name

  def splits(self, train_spec, eval_spec, class_names):
    del class_names  # the file's own, the same in every split
    listed = {}
    for spec in [eval_spec] + ([train_spec] if train_spec is not None else []):
      images, labels, names = embedded_arrays(self.name, spec)
      listed[spec] = Split(name=spec, images=images, labels=labels)
    self.channels = images.shape[-1]
    return listed.get(train_spec), listed[eval_spec], names

  def native_sizes(self, splits):
    return {split.images.shape[1:3] for split in splits}

  def arrays(self, split, fits_in_memory):
    return split.images, split.labels


class TfdsSource(Source):
  """A TFDS dataset prepared as ArrayRecord: records read by index, images decoded when used."""

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
      listed[spec] = Split(name=spec, indices=np.arange(self.builder.info.splits[spec].num_examples))
    return listed.get(train_spec), listed[eval_spec], self.info.class_names

  def arrays(self, split, fits_in_memory):
    if not fits_in_memory:
      tfds_split(self.builder, split.name)  # raises, explaining how to prepare ArrayRecord
    return tfds_arrays(self.builder, split.name)


# --- labels beside the images: label files, tar shards, parquet ------------------------------
#
# These sources know every example's labels before opening an image. Each reads its examples
# into a `_Catalog` (tags as written, split, where each came from); splits, slices, class names
# and the label arrays are then made the same way for all three (`_TaggedSource`).

TAG_SEPARATOR = ';'  # between the tags of a `labels` cell
IMAGE_COLUMNS = ('path', 'image', 'img', 'file', 'filename')  # a label file's image column, if not set
PARQUET_IMAGE_COLUMNS = ('image', 'img', 'path')
LABEL_COLUMNS = ('label', 'labels')  # label: one per row; labels (or a set label_column): tags
SPLIT_COLUMN = 'split'
_INTEGER = re.compile(r'-?\d+')


@dataclasses.dataclass
class _Catalog:
  """Every example of a labelled source, before splits and slices."""
  what: str  # how messages name the dataset
  tags: list  # per example: its class names (tuple of str), first tag first; () = untagged
  split_of: Optional[np.ndarray]  # per example: its split (str); None = one split, 'all'
  class_names: tuple[str, ...]  # the dataset's own classes, the same for every split
  where: Callable[[int], str]  # example -> 'line 7 of labels.csv (cat/1.jpg)', for messages
  absent: Callable[[str, list], str]  # (split, the splits there are) -> why it is not there

  @functools.cached_property
  def strata(self) -> np.ndarray:
    """Each example's first tag as an index into the dataset's own classes (-1: untagged): what a
    slice keeps in proportion, whichever classes a model was given."""
    index = {name: label for label, name in enumerate(self.class_names)}
    return np.asarray([index.get(tags[0], -1) if tags else -1 for tags in self.tags], np.int64)

  def rows(self, split: str) -> np.ndarray:
    """The examples of `split`, in storage order; a DataError naming the splits there are if none."""
    if self.split_of is None:
      if split != ALL:
        raise DataError(self.absent(split, [ALL]))
      return np.arange(len(self.tags))
    rows = np.flatnonzero(self.split_of == split)
    if not len(rows):
      raise DataError(self.absent(split, sorted(set(self.split_of.tolist()))))
    return rows

  def check_tags(self, multilabel: bool) -> None:
    """Multiclass: exactly one label per example (multilabel takes any number, none included)."""
    if multilabel:
      return
    for position, tags in enumerate(self.tags):
      if not tags:
        raise DataError(f'{self.where(position)} has no label; give every image one (or remove it), or set '
                        '--config.task=multilabel for images with any number of tags, none included')
      if len(tags) > 1:
        shown = TAG_SEPARATOR.join(printable(tag) for tag in tags[:5])
        raise DataError(f'{self.where(position)} has {len(tags)} labels ({shown}); a multiclass model takes '
                        'one per image: set --config.task=multilabel for images with several tags')


def _sliced(catalog: _Catalog, spec: str) -> np.ndarray:
  """The examples `spec` names ('train[:80%]+val'). Each part's slice is taken along the fixed
  stratified order (as for folders), so it keeps the class proportions, then put back in storage
  order, so that reading a split goes through its files front to back."""
  parts = []
  for split_name, start, stop in parse_spec(spec):
    rows = catalog.rows(split_name)
    order = rows[_stratified_order(catalog.strata[rows])]
    first, last = slice_bounds(start, stop, len(order))
    parts.append(np.sort(order[first:last]))
  positions = np.concatenate(parts)
  if not len(positions):
    raise DataError(f'split {spec!r} of {catalog.what} holds no examples; widen the slice')
  return positions


def _encoded(catalog: _Catalog, positions: np.ndarray, class_names: Sequence[str], multilabel: bool,
             unknown_classes: str, spec: str) -> tuple[np.ndarray, np.ndarray]:
  """(the positions kept, their labels): int32 class indices, or uint8 multi-hot rows [N, C], by
  name in `class_names` (a checkpoint's may lack some of the file's classes: those stop here,
  or with unknown_classes=drop their examples are left out -- multilabel: only those tags)."""
  index = {name: label for label, name in enumerate(class_names)}
  unknown = collections.Counter(tag for position in positions for tag in catalog.tags[position]
                                if tag not in index)
  if unknown:
    shown = ', '.join(f'{printable(name)} ({count} examples)' for name, count in unknown.most_common(5))
    more = f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''
    if unknown_classes != 'drop':
      raise DataError(f'split {spec!r} of {catalog.what} has labels the model is not trained on: '
                      f"{shown}{more}; the model's {len(class_names)} classes are "
                      f'{_listed(class_names)}; fix the labels, or set '
                      '--config.dataset.unknown_classes=drop to leave them out')
    logging.warning('leaving out the %s of split %r of %s with classes the model is not trained on '
                    '(dataset.unknown_classes=drop): %s%s', 'tags' if multilabel else 'examples', spec,
                    catalog.what, shown, more)
  if multilabel:
    labels = np.zeros((len(positions), len(class_names)), np.uint8)
    for row, position in enumerate(positions):
      labels[row, [index[tag] for tag in catalog.tags[position] if tag in index]] = 1
    return positions, labels
  positions = positions[[catalog.tags[position][0] in index for position in positions]]
  if not len(positions):
    raise DataError(f"split {spec!r} of {catalog.what} has none of the model's classes "
                    f'({_listed(class_names, 5)}); is it the right dataset?')
  return positions, np.asarray([index[catalog.tags[position][0]] for position in positions], np.int32)


def sorted_classes(names) -> tuple[str, ...]:
  """Class names in order: numerically when every name is an integer ('2' before '10')."""
  names = set(names)
  if names and all(_INTEGER.fullmatch(name) for name in names):
    return tuple(sorted(names, key=lambda name: (int(name), name)))
  return tuple(sorted(names))


def _label_values(value, separated: bool = True) -> list:
  """A label as written (a class index or name, a list of them, a `;`-separated string, or None)
  -> its class indices (int) and names (str), in order, once each. A bad value is a ValueError."""
  if value is None:
    items = []
  elif isinstance(value, list):
    items = value
  elif isinstance(value, str) and separated:
    items = value.split(TAG_SEPARATOR)
  else:
    items = [value]
  values = []
  for item in items:
    if isinstance(item, float) and item.is_integer():
      item = int(item)
    if isinstance(item, str):
      item = item.strip()
      if not item:
        continue
      item = int(item) if _INTEGER.fullmatch(item) else item
    if isinstance(item, bool) or not isinstance(item, (int, str)):
      raise ValueError(f'label {item!r} is not a class index or name')
    if isinstance(item, int) and item < 0:
      raise ValueError(f'class index {item} is negative')
    if item not in values:
      values.append(item)
  return values


def _tags_of_values(values: list, names: Optional[Sequence[str]], where: Callable[[int], str],
                    what: str, names_from: str) -> tuple[list, tuple[str, ...]]:
  """Tags (class names) of labels written as class indices or names, and the class names: `names`
  (a classes.txt, a ClassLabel feature) when given, else the names used (sorted), or '0'..'K-1'
  for indices."""
  if names is None:
    kinds = {type(value) for labels in values for value in labels}
    if kinds == {int, str}:
      first = next(i for i, labels in enumerate(values) if any(isinstance(v, int) for v in labels))
      raise DataError(f'{what} mixes class indices ({where(first)}) with class names; write names '
                      f'only, or indices with their names in {names_from}')
    if kinds == {int}:
      names = tuple(str(label) for label in range(max(max(labels, default=0) for labels in values) + 1))
      return [tuple(str(value) for value in labels) for labels in values], names
    return [tuple(labels) for labels in values], sorted_classes(v for labels in values for v in labels)
  known = set(names)
  tags = []
  for position, labels in enumerate(values):
    for value in labels:
      if isinstance(value, int) and value >= len(names):
        raise DataError(f'{where(position)} has class index {value}, but {names_from} names '
                        f'{len(names)} classes (0-{len(names) - 1}); fix the label or the names')
      if isinstance(value, str) and value not in known:
        raise DataError(f'{where(position)} has class {printable(value)!r}, which {names_from} lacks; '
                        'add it there or fix the label')
    tags.append(tuple(names[value] if isinstance(value, int) else value for value in labels))
  return tags, tuple(names)


def _pick_column(names: Sequence[str], configured: str, candidates: Sequence[str], key: str, what: str,
                 where: str) -> str:
  """Which of `names` is the image (or label) column: `configured` (config.dataset.KEY), else the
  first of `candidates` present; names compare without case."""
  lowered = {name.strip().lower(): name for name in names}
  if configured:
    if configured.strip().lower() in lowered:
      return lowered[configured.strip().lower()]
    raise DataError(f'{where} has no column {configured!r} (config.dataset.{key}); its columns: '
                    f'{", ".join(map(str, names))}')
  for candidate in candidates:
    if candidate in lowered:
      return lowered[candidate]
  raise DataError(f'{where} has no {what} column (its columns: {", ".join(map(str, names)) or "none"}); '
                  f'name it {" or ".join(candidates)}, or set --config.dataset.{key}')


class _TaggedSource(Source):
  """A source whose labels are known without opening an image: a `_Catalog` of its examples,
  split and sliced the same way whatever the kind (label file, tar shards, parquet)."""

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    self.multilabel = task == 'multilabel'
    self.train_spec, self.unknown_classes = dataset.train_split, dataset.unknown_classes
    self.skip_corrupt = dataset.skip_corrupt
    self.image_column, self.label_column = dataset.get('image_column', ''), dataset.get('label_column', '')

  def catalog(self, split_names: Sequence[str], optional: Sequence[str]) -> _Catalog:
    """The examples of at least the splits `split_names` (and of `optional` ones if they exist)."""
    raise NotImplementedError

  def split(self, spec: str, positions: np.ndarray, labels: np.ndarray) -> Split:
    """The catalog's examples at `positions` as a Split."""
    raise NotImplementedError

  def splits(self, train_spec, eval_spec, class_names):
    names = lambda spec: [split for split, _, _ in parse_spec(spec)] if spec else []
    # Evaluating alone without the classes: those training on train_split gives.
    optional = names(self.train_spec) if train_spec is None and class_names is None else []
    catalog = self.catalog(list(dict.fromkeys(names(train_spec) + names(eval_spec))), optional)
    catalog.check_tags(self.multilabel)
    if not catalog.class_names:
      raise DataError(f'{catalog.what} has no labels at all; label its images')
    class_names = tuple(class_names) if class_names is not None else catalog.class_names
    loaded = []
    for spec in (train_spec, eval_spec):
      if spec is not None:
        positions = _sliced(catalog, spec)
        loaded.append(self.split(spec, *_encoded(catalog, positions, class_names, self.multilabel,
                                                 self.unknown_classes, spec)))
    warn_missing_classes(loaded[-1], class_names)
    return (loaded[0] if train_spec is not None else None), loaded[-1], class_names


# --- label files: CSV or JSON Lines of image paths and labels -----------------------------------


class LabelRow(NamedTuple):
  line: int  # in the file, from 1
  image: str  # as written
  tags: tuple[str, ...]
  split: Optional[str]  # None without a split column


def read_label_file(path: str, image_column: str = '', label_column: str = '') -> list[LabelRow]:
  """The rows of a CSV (with a header, or rows path,label[,label...]) or JSON Lines label file.

  Anything wrong with the file itself (not UTF-8, ragged rows, bad JSON, columns it cannot tell
  apart) is a DataError naming the line.
  """
  try:
    with open(path, encoding='utf-8-sig', newline='') as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise DataError(f'{path} is not UTF-8 text (byte {e.start}); save it as UTF-8') from None
  except OSError as e:
    raise DataError(f'cannot read config.dataset.labels={path!r} ({e.strerror or e}); point it at a CSV or '
                    'JSON Lines file of image paths and labels') from None
  if path.lower().endswith(('.jsonl', '.ndjson', '.json')) or text.lstrip().startswith('{'):
    rows = _json_lines_rows(path, text, image_column, label_column)
  else:
    rows = _csv_rows(path, text, image_column, label_column)
  if not rows:
    raise DataError(f'{path} holds no rows; write one row per image (path and label)')
  return rows


def _tags(cell: str, separated: bool) -> tuple[str, ...]:
  """A label cell's tags: split at ';' unless the column holds one label; blanks dropped."""
  pieces = cell.split(TAG_SEPARATOR) if separated else [cell]
  return tuple(dict.fromkeys(piece.strip() for piece in pieces if piece.strip()))


class _Columns(NamedTuple):
  image: str
  label: str
  split: Optional[str]


def _columns(names: Sequence[str], where: str, image_column: str, label_column: str) -> _Columns:
  """Which of a label file's columns (or a JSON line's keys) hold the image, the label and the split.

  A column it would not read is an error (a misspelt `split` would otherwise be ignored), unless
  both columns are named in the config: then the others are the user's own.
  """
  image = _pick_column(names, image_column, IMAGE_COLUMNS, 'image_column', 'image', where)
  label = _pick_column(names, label_column, LABEL_COLUMNS, 'label_column', 'label', where)
  split = next((name for name in names if name.strip().lower() == SPLIT_COLUMN), None)
  unknown = [name for name in names if name not in (image, label, split)]
  if unknown and not (image_column and label_column):
    raise DataError(f'{where} has columns flaxtpu does not read: {", ".join(map(repr, unknown))}; it reads '
                    f'an image column ({", ".join(IMAGE_COLUMNS)}), a label column (label, or labels with '
                    f'tags separated by {TAG_SEPARATOR}) and {SPLIT_COLUMN}; rename or remove them, or name '
                    'the two columns with --config.dataset.image_column and --config.dataset.label_column '
                    'to ignore the rest')
  return _Columns(image, label, split)


def _csv_rows(path: str, text: str, image_column: str, label_column: str) -> list[LabelRow]:
  reader = csv.reader(io.StringIO(text), delimiter='\t' if path.lower().endswith('.tsv') else ',',
                      strict=True)
  records = []
  try:
    for cells in reader:
      if any(cell.strip() for cell in cells):
        records.append((reader.line_num, cells))
  except csv.Error as e:
    raise DataError(f'line {reader.line_num} of {path} is not valid CSV ({e}); fix the quoting') from None
  if not records:
    return []
  _, first = records[0]
  recognised = {*IMAGE_COLUMNS, *LABEL_COLUMNS, SPLIT_COLUMN,
                *(name.strip().lower() for name in (image_column, label_column) if name)}
  if not recognised & {cell.strip().lower() for cell in first}:
    if not first[0].strip().lower().endswith(IMAGE_EXTENSIONS):
      raise DataError(f'the first row of {path} ({", ".join(first[:4])}) is neither a header naming its '
                      f'columns ({"/".join(IMAGE_COLUMNS)}, label or labels, split) nor a row path,label '
                      f'(its first cell is not an image file name); add a header row')
    # Header-less: path,label[,label...]; every cell after the path holds tags.
    return [LabelRow(line, cells[0].strip(), _tags(TAG_SEPARATOR.join(cells[1:]), True), None)
            for line, cells in records]
  columns = _columns(first, path, image_column, label_column)
  at = {name: column for column, name in enumerate(first)}
  rows = []
  for line, cells in records[1:]:
    if len(cells) != len(first):
      raise DataError(f'line {line} of {path} has {len(cells)} cells but the header has {len(first)} '
                      'columns; quote cells that hold a comma ("a,b"), or fix the row')
    split = cells[at[columns.split]].strip() if columns.split else None
    if columns.split and not split:
      raise DataError(f'line {line} of {path} has no {columns.split}; give every row one (train, test, ...) '
                      'or remove the column')
    rows.append(LabelRow(line, cells[at[columns.image]].strip(),
                         _tags(cells[at[columns.label]], columns.label.strip().lower() != 'label'), split))
  return rows


def _json_lines_rows(path: str, text: str, image_column: str, label_column: str) -> list[LabelRow]:
  rows, resolved = [], {}
  for line, content in enumerate(text.split('\n'), 1):
    if not content.strip():
      continue
    where = f'line {line} of {path}'
    try:
      record = json.loads(content)
    except json.JSONDecodeError as e:
      raise DataError(f'{where} is not valid JSON ({e.msg} at column {e.colno}); write one JSON object '
                      'per line') from None
    if not isinstance(record, dict):
      raise DataError(f'{where} is not a JSON object; write one per line, e.g. '
                      '{"path": "a.jpg", "label": "cat"}')
    keys = tuple(record)
    if keys not in resolved:
      resolved[keys] = _columns(keys, where, image_column, label_column)
    columns = resolved[keys]
    image, split = record[columns.image], record.get(columns.split) if columns.split else None
    if not isinstance(image, str):
      raise DataError(f'{where}: {columns.image!r} is {json.dumps(image)}, not a file path')
    if columns.split and (not isinstance(split, str) or not split.strip()):
      raise DataError(f'{where} has no {columns.split} name; give every line one (train, test, ...) '
                      'or leave the key out everywhere')
    try:
      values = _label_values(record[columns.label], columns.label.strip().lower() != 'label')
    except ValueError as e:
      raise DataError(f'{where}: {e}; write a class name, a list of them, or null') from None
    rows.append(LabelRow(line, image.strip(), tuple(str(value) for value in values),
                         split.strip() if split else None))
  return rows


def _relative_image(root: str, root_real: str, image: str, where: str) -> str:
  """An image path of a label file as a path inside `root` (an absolute root), normalised."""
  if not image:
    raise DataError(f'{where} has no image path; write one (relative to the image folder) or remove the row')
  path = os.path.normpath(os.path.join(root, image))
  if _inside(path, root):
    return os.path.relpath(path, root)
  real = os.path.realpath(path)  # an absolute path through a link to the folder
  if _inside(real, root_real):
    return os.path.relpath(real, root_real)
  raise DataError(f'{where}: image {printable(image)} is outside the image folder {printable(root)}; write '
                  'paths inside it (relative to it), or set --config.dataset.folder to a folder that holds '
                  'every image')


class LabelFileSource(_TaggedSource):
  """Images anywhere under a folder, labelled by a CSV or JSON Lines file (`dataset.labels`).

  The folder is `dataset.folder`, or the label file's own. Paths are checked once (inside the
  folder, each image once, each file there); the images stream or are cached as for folders.
  """

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    super().__init__(dataset, task)
    self.path = dataset.labels
    self.root = os.path.abspath(dataset.folder or os.path.dirname(os.path.abspath(self.path)))
    self._catalog, self._paths = None, None

  def catalog(self, split_names, optional):
    if self._catalog is None:
      self._catalog = self._read()
    return self._catalog

  def split(self, spec, positions, labels):
    return Split(name=spec, paths=self._paths[positions], labels=labels, root=self.root)

  def _read(self) -> _Catalog:
    if not os.path.isfile(self.path):
      raise DataError(f'config.dataset.labels={self.path!r} is not a file; point it at a CSV or JSON Lines '
                      'file of image paths and labels')
    if not os.path.isdir(self.root):
      raise DataError(f'the image folder {self.root} (config.dataset.folder) is not a directory; set it to '
                      "the folder the label file's paths are relative to")
    root_real, seen, rows, missing = os.path.realpath(self.root), {}, [], []
    for row in read_label_file(self.path, self.image_column, self.label_column):
      relative = _relative_image(self.root, root_real, row.image, f'line {row.line} of {self.path}')
      if relative in seen:
        raise DataError(f'image {printable(relative)} is listed twice in {self.path}, on lines '
                        f'{seen[relative]} and {row.line}; keep one row per image')
      seen[relative] = row.line
      (rows if os.path.isfile(os.path.join(self.root, relative)) else missing).append((relative, row))
    if missing:
      relative, row = missing[0]
      problem = (f'image {printable(os.path.join(self.root, relative))} (line {row.line} of {self.path}) '
                 'does not exist')
      if not self.skip_corrupt:
        more = f' ({len(missing) - 1} more rows name missing images)' if len(missing) > 1 else ''
        raise DataError(f'{problem}; fix the path (relative to {self.root}) or remove the row, or set '
                        f'--config.dataset.skip_corrupt=true to skip such rows{more}')
      logging.warning('skipping %d rows of %s whose image does not exist (dataset.skip_corrupt), e.g. %s',
                      len(missing), self.path, problem)
    lines = [row.line for _, row in rows]
    self._paths = np.asarray([os.fsencode(relative) for relative, _ in rows])
    has_split = any(row.split is not None for _, row in rows)
    if has_split and (unsplit := next((row for _, row in rows if row.split is None), None)):
      raise DataError(f'line {unsplit.line} of {self.path} has no {SPLIT_COLUMN} while other lines have one; '
                      'give every line a split (train, test, ...) or none')
    tags = [row.tags for _, row in rows]
    return _Catalog(
        what=self.path, tags=tags,
        split_of=np.asarray([row.split for _, row in rows], object) if has_split else None,
        class_names=sorted_classes(tag for row_tags in tags for tag in row_tags),
        where=lambda i: f'line {lines[i]} of {self.path} ({printable(os.fsdecode(self._paths[i]))})',
        absent=self._absent)

  def _absent(self, split: str, present: list) -> str:
    if present == [ALL]:
      return (f"{self.path} has no {SPLIT_COLUMN} column, so its one split is '{ALL}': hold out a part with "
              f"--config.dataset.train_split='{ALL}[:80%]' --config.dataset.eval_split='{ALL}[80%:]' "
              f'(or add a {SPLIT_COLUMN} column)')
    return (f'split {split!r} is not in {self.path}; its {SPLIT_COLUMN} column holds: {", ".join(present)} '
            '(set --config.dataset.train_split / eval_split)')


# --- WebDataset-style tar shards -------------------------------------------------------------

SHARD_CLASSES = 'classes.txt'  # beside the shards: one class name per line, indexed by KEY.cls
SHARD_LABEL_SUFFIXES = ('cls', 'json')
MAX_OPEN_SHARDS = 16  # open files each process keeps for reading members by offset
SHARDS_PER_INDEX_WORKER = 16  # a worker process starts in ~1-2 s: fewer shards are indexed in this one
_TAR_BLOCK = 512
_COMPRESSED = {b'\x1f\x8b': 'gzip', b'BZh': 'bzip2', b'\xfd7zXZ': 'xz', b'\x28\xb5\x2f\xfd': 'zstd'}
_BRACES = re.compile(r'\{(\d+)\.\.(\d+)\}|\{([^{}]*,[^{}]*)\}')


def expand_braces(pattern: str) -> list[str]:
  """'a-{00..02}.tar' -> a-00.tar, a-01.tar, a-02.tar (zero padding kept); '{x,y}' -> x, y. Several
  braces multiply, the leftmost slowest; other braces ('{split}') stay."""
  match = _BRACES.search(pattern)
  if not match:
    return [pattern]
  if match[3] is not None:
    values = match[3].split(',')
  else:
    first, last = match[1], match[2]
    padded = any(len(bound) > 1 and bound.startswith('0') for bound in (first, last))
    width = max(len(first), len(last)) if padded else 0
    step = 1 if int(last) >= int(first) else -1
    values = [str(number).zfill(width) for number in range(int(first), int(last) + step, step)]
  head, tails = pattern[:match.start()], expand_braces(pattern[match.end():])
  return [head + value + tail for value in values for tail in tails]


def pattern_files(pattern: str, key: str, split: Optional[str] = None) -> list[str]:
  """The files `pattern` names (config.dataset.KEY, `{split}` replaced), in pattern order: brace
  ranges first, then globs (sorted); a file named outright must exist."""
  files = []
  for path in expand_braces(pattern.replace('{split}', split) if split is not None else pattern):
    if glob.has_magic(path):
      files += sorted(glob.glob(path))
    elif os.path.isfile(path):
      files.append(path)
    else:
      raise DataError(f'{path} (from config.dataset.{key}={pattern!r}) does not exist; fix the pattern')
  if not files:
    found = split_values(pattern)
    raise DataError(f'config.dataset.{key}={pattern!r} matches no file'
                    + (f' for split {split!r}; splits found: {", ".join(found) or "none"}' if split else '')
                    + '; fix the pattern or the split names')
  return list(dict.fromkeys(files))


def split_values(pattern: str) -> list[str]:
  """The values `{split}` takes in the files that match `pattern`, for messages."""
  pieces = re.split(r'(\{split\}|\{[^{}]*\}|[*?]|\[[^\]]*\])', pattern)
  regex = ''.join('(?P<split>[^/]+)' if piece == '{split}' and index == pieces.index('{split}') else
                  '(?P=split)' if piece == '{split}' else
                  '.*' if piece[:1] in ('{', '*', '?', '[') else re.escape(piece)
                  for index, piece in enumerate(pieces))
  wildcard = ''.join('*' if piece[:1] in ('{', '*', '?', '[') else piece for piece in pieces)
  return sorted({match['split'] for path in glob.glob(wildcard) if (match := re.fullmatch(regex, path))})


def index_shard(path: str) -> dict:
  """A shard's examples from its tar headers: [(key, image member, data offset, size, label values or
  None, problem or None)] in tar order, and where the shard breaks (byte, why) when it is cut off
  or corrupt. Reads the small label members, never an image; runs in the index workers."""
  examples, groups, broken, end = [], {}, None, 0
  with open(path, 'rb') as f:
    magic = f.read(6)
  if kind := next((kind for prefix, kind in _COMPRESSED.items() if magic.startswith(prefix)), None):
    return {'examples': [], 'broken': None, 'compressed': kind}
  size = os.path.getsize(path)
  try:
    with tarfile.open(path, 'r:') as tar:
      for member in tar:
        if member.offset_data + member.size > size:
          broken = (member.offset, f'member {member.name} runs past the end of the file')
          break
        end = member.offset_data + member.size
        directory, base = posixpath.split(member.name)
        if not member.isfile() or base.startswith('.') or '.' not in base:
          continue
        stem, suffix = base.split('.', 1)
        group = groups.setdefault(posixpath.join(directory, stem), {})
        suffix = suffix.lower()
        if '.' + suffix in IMAGE_EXTENSIONS:
          if 'image' in group:
            group['problem'] = f'two images ({group["image"][0]} and {member.name})'
          group['image'] = (member.name, member.offset_data, member.size)
        elif suffix in SHARD_LABEL_SUFFIXES:
          try:
            group['label'] = _member_label(suffix, tar.extractfile(member).read())
          except ValueError as e:
            group['problem'] = f'{member.name} {e}'
      if broken is None and tar.offset + _TAR_BLOCK > size:  # no end-of-archive block: cut off
        broken = (size, 'the file ends without the tar end marker (cut off)')
  except (tarfile.TarError, OSError, EOFError) as e:
    broken = (end, f'{type(e).__name__}: {e}')
  for key, group in groups.items():
    if 'image' not in group and 'label' not in group:
      continue  # only other members (a caption, metadata)
    problem = group.get('problem') or (
        None if 'image' in group and 'label' in group else
        f'a label but no image ({", ".join(IMAGE_EXTENSIONS)})' if 'image' not in group else
        f'an image but no label ({key}.cls or {key}.json)')
    name, offset, length = group.get('image', ('', 0, 0))
    examples.append((key, name, offset, length, group.get('label'), problem))
  return {'examples': examples, 'broken': broken, 'compressed': None}


def _member_label(suffix: str, data: bytes) -> list:
  """KEY.cls (a class index or name) or KEY.json ({"label": x} or {"labels": [...]}) -> label values."""
  text = data.decode('utf-8').strip()  # UnicodeDecodeError is a ValueError
  if suffix == 'cls':
    return _label_values(text, separated=False)
  try:
    record = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f'is not valid JSON ({e.msg})') from None
  if not isinstance(record, dict) or not {'label', 'labels'} & set(record):
    raise ValueError('has no "label" or "labels" key')
  return _label_values(record['labels']) if 'labels' in record else _label_values(record['label'], False)


_SHARD_INDEXES: dict = {}  # (path, size, mtime) -> index_shard's answer: each shard is indexed once


def _indexed(paths: Sequence[str]) -> list[dict]:
  """index_shard of every path, in order; shards not indexed before by worker processes when many."""
  keys = []
  for path in paths:
    stat = os.stat(path)
    keys.append((os.path.abspath(path), stat.st_size, stat.st_mtime_ns))
  todo = [i for i, key in enumerate(keys) if key not in _SHARD_INDEXES]
  if todo:
    count = min(max((os.cpu_count() or 1) - 1, 1), 32)
    results = workers.run(index_shard, [paths[i] for i in todo], count, buffer=8,
                          min_items_per_worker=SHARDS_PER_INDEX_WORKER)
    results = workers.with_progress(([result] for result in results), len(todo), 'indexing tar shards')
    for i, (result,) in zip(todo, results):
      _SHARD_INDEXES[keys[i]] = result
  return [_SHARD_INDEXES[key] for key in keys]


_open_shards: collections.OrderedDict = collections.OrderedDict()  # path -> fd, this process's
_open_shards_lock = threading.Lock()
_open_shards_pid = [os.getpid()]


def read_member(path: str, offset: int, size: int) -> bytes:
  """`size` bytes at `offset` of a shard, through this process's few open files (never pickled)."""
  with _open_shards_lock:
    if _open_shards_pid[0] != os.getpid():  # a forked worker: the parent's files are not its own
      _open_shards.clear()
      _open_shards_pid[0] = os.getpid()
    fd = _open_shards.get(path)
    if fd is None:
      while len(_open_shards) >= MAX_OPEN_SHARDS:
        os.close(_open_shards.popitem(last=False)[1])
      fd = _open_shards[path] = os.open(path, os.O_RDONLY)
    _open_shards.move_to_end(path)
    data = os.pread(fd, size, offset)
  if len(data) != size:
    raise EOFError(f'the shard ends {size - len(data)} bytes before the end of this image')
  return data


class _ShardMembers:
  """The images of indexed shards as records read by offset (a Split's `records`)."""

  def __init__(self, paths: tuple[str, ...], shard: np.ndarray, offset: np.ndarray, size: np.ndarray,
               names: list[str]):
    self.paths, self.shard, self.offset, self.size, self.names = paths, shard, offset, size, names

  def __len__(self) -> int:
    return len(self.shard)

  def __getitem__(self, index: int) -> dict:
    return {'image': read_member(self.paths[self.shard[index]], int(self.offset[index]),
                                 int(self.size[index]))}

  def describe(self, index: int) -> str:
    return f'{self.names[index]} in shard {self.paths[self.shard[index]]}'


class ShardSource(_TaggedSource):
  """WebDataset-style tar shards (`dataset.shards`): KEY.jpg (or .png, ...) with KEY.cls or KEY.json.

  Each shard is indexed once from its tar headers (member offsets and sizes); an image is read by
  offset when it is used. The index is in pattern order then tar order, so resuming is exact.
  `{split}` in the pattern names the split; without it the one split is `all`, sliced.
  """

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    super().__init__(dataset, task)
    self.pattern = dataset.shards
    self.members = None

  def split(self, spec, positions, labels):
    return Split(name=spec, records=self.members, indices=positions, labels=labels,
                 shards=self.members.shard[positions])

  def catalog(self, split_names, optional):
    if '{split}' not in self.pattern:
      shard_splits = [(path, None) for path in pattern_files(self.pattern, 'shards')]
    else:
      shard_splits = [(path, name) for name in split_names
                      for path in pattern_files(self.pattern, 'shards', name)]
      for name in (name for name in optional if name not in split_names):
        try:
          shard_splits += [(path, name) for path in pattern_files(self.pattern, 'shards', name)]
        except DataError:
          pass  # evaluating alone on data without the training split
    paths = tuple(path for path, _ in shard_splits)
    rows = []  # (shard, key, member, offset, size, label values)
    skipped = []
    for shard, (path, index) in enumerate(zip(paths, _indexed(paths))):
      if index['compressed']:
        raise DataError(f'shard {path} is {index["compressed"]}-compressed, which cannot be read by offset; '
                        'write uncompressed .tar shards')
      if index['broken']:
        at, why = index['broken']
        problem = f'shard {path} is truncated or corrupt at byte {at} ({why})'
        if not self.skip_corrupt:
          raise DataError(f'{problem}; rebuild it, or set --config.dataset.skip_corrupt=true to keep its '
                          'readable members')
        logging.warning('%s; keeping the %d complete examples before it (dataset.skip_corrupt)', problem,
                        sum(example[-1] is None for example in index['examples']))
      for key, member, offset, size, values, problem in index['examples']:
        if problem is None:
          rows.append((shard, key, member, offset, size, values))
        elif self.skip_corrupt:
          skipped.append(f'{key} in shard {path} has {problem}')
        else:
          raise DataError(f'{key} in shard {path} has {problem}; fix the shard, or set '
                          '--config.dataset.skip_corrupt=true to skip such examples')
    if skipped:
      logging.warning('skipping %d examples of the shards (dataset.skip_corrupt), e.g. %s', len(skipped),
                      skipped[0])
    self.members = _ShardMembers(paths, np.asarray([row[0] for row in rows], np.int32),
                                 np.asarray([row[3] for row in rows], np.int64),
                                 np.asarray([row[4] for row in rows], np.int64), [row[2] for row in rows])
    where = lambda i: f'{rows[i][1]} in shard {paths[rows[i][0]]}'
    classes_file = os.path.join(os.path.dirname(paths[0]), SHARD_CLASSES)
    names = None
    if os.path.isfile(classes_file):
      with open(classes_file, encoding='utf-8') as f:
        names = [line.strip() for line in f if line.strip()]
    tags, class_names = _tags_of_values([row[5] for row in rows], names, where, f'shards {self.pattern}',
                                        classes_file)
    return _Catalog(
        what=f'shards {self.pattern}', tags=tags,
        split_of=None if '{split}' not in self.pattern else np.asarray(
            [shard_splits[row[0]][1] for row in rows], object),
        class_names=class_names, where=where, absent=self._absent)

  def _absent(self, split: str, present: list) -> str:
    if present == [ALL]:
      return (f"config.dataset.shards={self.pattern!r} has no {{split}}, so its one split is '{ALL}': hold "
              f"out a part with --config.dataset.train_split='{ALL}[:80%]' "
              f"--config.dataset.eval_split='{ALL}[80%:]'")
    return f'the shards of split {split!r} ({self.pattern}) hold no examples; splits with examples: ' + (
        ', '.join(present))


# --- parquet, e.g. a Hugging Face datasets copy ------------------------------------------------


_row_group: dict = {}  # (path, row group, column) -> its cells: this process's last row group read
_row_group_lock = threading.Lock()


class _ParquetImages:
  """The image cells of parquet files as records read by row (a Split's `records`). A row group
  is read whole (Parquet's smallest read), so each process keeps its last one."""

  def __init__(self, files: tuple[str, ...], column: str, file_of: np.ndarray, row_of: np.ndarray,
               group_starts: tuple[np.ndarray, ...]):
    self.files, self.column, self.file_of, self.row_of = files, column, file_of, row_of
    self.group_starts = group_starts  # per file: the first row of each row group

  def __len__(self) -> int:
    return len(self.file_of)

  def __getitem__(self, index: int) -> dict:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    path, row = self.files[self.file_of[index]], int(self.row_of[index])
    starts = self.group_starts[self.file_of[index]]
    group = int(np.searchsorted(starts, row, side='right')) - 1
    key = (path, group, self.column)
    with _row_group_lock:
      if key not in _row_group:
        _row_group.clear()
        _row_group[key] = pq.ParquetFile(path).read_row_group(group, columns=[self.column]).column(0)
      cell = _row_group[key][row - int(starts[group])].as_py()
    if isinstance(cell, dict):  # a Hugging Face Image: {bytes, path}
      cell = cell.get('bytes') or cell.get('path')
    if isinstance(cell, str) and cell:
      cell = os.path.join(os.path.dirname(path), cell)  # relative to the parquet file
    if not cell:
      raise ValueError(f'its {self.column!r} cell holds no image')
    return {'image': cell}

  def describe(self, index: int) -> str:
    return f'row {int(self.row_of[index])} of {self.files[self.file_of[index]]}'


def _hf_class_names(metadata: Optional[dict], column: str) -> Optional[list[str]]:
  """The class names a Hugging Face `datasets` parquet file keeps for `column`: a ClassLabel, or a
  Sequence (List) of ClassLabel for multi-label, in the schema metadata b'huggingface'."""
  try:
    feature = json.loads(metadata[b'huggingface'])['info']['features'][column]
  except (KeyError, TypeError, ValueError):
    return None
  if isinstance(feature, list) and len(feature) == 1:  # [ClassLabel]: the list shorthand
    feature = feature[0]
  if isinstance(feature, dict) and isinstance(feature.get('feature'), dict):  # Sequence / List
    feature = feature['feature']
  if isinstance(feature, dict) and feature.get('_type') == 'ClassLabel' and 'names' in feature:
    return [str(name) for name in feature['names']]
  return None


def _hf_split(path: str) -> str:
  """A Hugging Face file's split: train-00000-of-00004.parquet -> train; default/test/0000.parquet
  -> test."""
  word = re.split(r'[-.]', os.path.basename(path))[0]
  return os.path.basename(os.path.dirname(path)) if word.isdigit() else word


class ParquetSource(_TaggedSource):
  """Parquet files (`dataset.parquet`) with an image column and a label column.

  A file or a glob is one split, `all`; a folder's files are split by name as Hugging Face lays
  them out (data/train-00000-of-00004.parquet); `{split}` names the split. Labels are read for
  every row at once (one column), images by row when used.
  """

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    super().__init__(dataset, task)
    self.pattern = dataset.parquet
    self.images = None

  def split(self, spec, positions, labels):
    return Split(name=spec, records=self.images, indices=positions, labels=labels)

  def _files(self, split_names: Sequence[str], optional: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    """(file, split) of the files to read; split None where there is one split, `all`."""
    if '{split}' in self.pattern:
      files = [(path, name) for name in split_names for path in pattern_files(self.pattern, 'parquet', name)]
      for name in (name for name in optional if name not in split_names):
        try:
          files += [(path, name) for path in pattern_files(self.pattern, 'parquet', name)]
        except DataError:
          pass  # evaluating alone on data without the training split
      return files
    if os.path.isdir(self.pattern):
      found = sorted(glob.glob(os.path.join(self.pattern, '**', '*.parquet'), recursive=True))
      if not found:
        raise DataError(f'config.dataset.parquet={self.pattern!r} holds no .parquet files; point it at a '
                        'parquet file, a folder of them or a glob')
      return [(path, _hf_split(path)) for path in found]
    return [(path, None) for path in pattern_files(self.pattern, 'parquet')]

  def catalog(self, split_names, optional):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    files = self._files(split_names, optional)
    values, file_of, row_of, starts, column, names = [], [], [], [], None, None
    for number, (path, _) in enumerate(files):
      try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        image = _pick_column(schema.names, self.image_column, PARQUET_IMAGE_COLUMNS, 'image_column', 'image',
                             path)
        label = _pick_column(schema.names, self.label_column, LABEL_COLUMNS, 'label_column', 'label', path)
        image_type = schema.field(image).type
        if not (pa.types.is_binary(image_type) or pa.types.is_large_binary(image_type)
                or pa.types.is_string(image_type) or pa.types.is_large_string(image_type)
                or pa.types.is_struct(image_type) and image_type.get_field_index('bytes') >= 0):
          raise DataError(f'column {image!r} of {path} holds {image_type}, not images (encoded bytes, a '
                          "path, or Hugging Face's {bytes, path}); set --config.dataset.image_column")
        if column not in (None, image):
          raise DataError(f'{path} keeps its images in column {image!r}, {files[0][0]} in {column!r}; give '
                          'the files one layout')
        column = image
        cells = parquet.read(columns=[label]).column(0).to_pylist()
        groups = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
      except (pa.ArrowException, OSError) as e:
        raise DataError(f'{path} is not a readable parquet file ({type(e).__name__}: '
                        f'{" ".join(str(e).split())}); replace it') from None
      names = names or _hf_class_names(schema.metadata, label)
      for row, cell in enumerate(cells):
        try:
          values.append(_label_values(None if cell == -1 else cell, separated=False))  # -1: no label
        except ValueError as e:
          raise DataError(f'row {row} of {path}: {e}; labels are class indices or names, or lists of '
                          'them') from None
      file_of += [number] * len(cells)
      row_of.append(np.arange(len(cells)))
      starts.append(np.cumsum([0] + groups[:-1]))
    paths = tuple(path for path, _ in files)
    file_of = np.asarray(file_of, np.int32)
    row_of = np.concatenate(row_of)
    self.images = _ParquetImages(paths, column, file_of, row_of, tuple(starts))
    where = lambda i: f'row {row_of[i]} of {paths[file_of[i]]}'
    tags, class_names = _tags_of_values(values, names, where, f'parquet {self.pattern}',
                                        f'the ClassLabel feature of {paths[0]}')
    split_of = None
    if files[0][1] is not None:
      split_of = np.asarray([name for _, name in files], object)[file_of]
    return _Catalog(what=f'parquet {self.pattern}', tags=tags, split_of=split_of, class_names=class_names,
                    where=where, absent=self._absent)

  def _absent(self, split: str, present: list) -> str:
    if present == [ALL]:
      return (f"config.dataset.parquet={self.pattern!r} is one split, '{ALL}': hold out a part with "
              f"--config.dataset.train_split='{ALL}[:80%]' --config.dataset.eval_split='{ALL}[80%:]' (or "
              'point it at a folder of split-named files, or use {split})')
    return (f'no parquet file of {self.pattern} is of split {split!r}; its files are of: '
            f'{", ".join(present)} (set --config.dataset.train_split / eval_split)')



def get(dataset: ml_collections.ConfigDict, task: str = 'multiclass') -> Source:
  """The source `config.dataset` names: a label file, tar shards or parquet files (whichever is
  set; a label file's images are under `folder`), else a folder, an embedded dataset or TFDS.
  `task` (config.task) decides the labels: class indices, or multi-hot rows for multilabel."""
  if dataset.get('labels'):
    return LabelFileSource(dataset, task)
  if dataset.get('shards'):
    return ShardSource(dataset, task)
  if dataset.get('parquet'):
    return ParquetSource(dataset, task)
  if dataset.folder:
    return FolderSource(dataset.folder, dataset.train_split, dataset.unknown_classes)
  if dataset.name in EMBEDDED:
    return EmbeddedSource(dataset.name)
  builder = tfds_builder(dataset.name, dataset.data_dir)
  return TfdsSource(builder) if tfds_info(builder).array_record else TfdsMemorySource(builder)
