"""Where examples come from: one class per kind of dataset, the same methods for each.

`get(config.dataset)` picks the source: an image folder, an embedded
dataset, a TFDS dataset prepared as ArrayRecord (streamed) or as TFRecord
(read into memory). `data.load` builds its batches from whichever it gets
(`Source` says what each offers), so adding a source adds a class here.

A split is a random-access list of (undecoded image, label): file paths for
a folder, ArrayRecord records for TFDS, arrays for an in-memory source.
Nothing is decoded here, so a split of a million images costs its file list,
not its pixels. Every kind pickles cheaply into the input workers.

Folder examples are in a fixed stratified order (the same on every machine
and run): each class's files are shuffled with a fixed seed, then the
classes are interleaved evenly. So a slice such as `train[:90%]` takes 90%
of every class (to within one file) and `train[90%:]` holds out the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import threading
import urllib.parse
from typing import Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu import preprocess, workers
from flaxtpu.errors import UserError
from flaxtpu.preprocess import IMAGE_EXTENSIONS

ALL = 'all'  # the split name for a folder laid out as root/class/image, without split folders
FOLDER_ORDER_SEED = 0  # the fixed shuffle within each class; changing it reshuffles every slice
UNKNOWN_CLASSES = ('error', 'drop')  # dataset.unknown_classes: a class folder training never saw


class DataError(UserError):
  """A dataset that cannot be read; the message names the file, folder or key."""


@dataclasses.dataclass(frozen=True)
class Split:
  """One (possibly sliced) split; `load(i)` gives what `preprocess.open_image` opens, and the label."""
  name: str  # the spec, e.g. 'train[:90%]'
  paths: Optional[np.ndarray] = None  # files: bytes [N], relative to `root`
  labels: Optional[np.ndarray] = None  # files, arrays: int32 [N], known without opening a file
  root: str = ''
  records: object = None  # TFDS: a random-access source of {'image': bytes, 'label': int}
  indices: Optional[np.ndarray] = None  # TFDS: the record index of each example
  images: Optional[np.ndarray] = None  # in memory: uint8 [N, H, W, C], decoded already

  def __len__(self) -> int:
    return len(self.labels) if self.labels is not None else len(self.indices)

  def load(self, index: int) -> tuple[object, int]:
    if self.paths is not None:
      return os.path.join(self.root, os.fsdecode(self.paths[index])), int(self.labels[index])
    if self.images is not None:
      return self.images[index], int(self.labels[index])
    record = self.records[int(self.indices[index])]
    return record['image'], record['label']

  def describe(self, index: int) -> str:
    """The example as a user finds it: its file, or its record or position in the split."""
    if self.paths is not None:
      return os.path.join(self.root, os.fsdecode(self.paths[index]))
    if self.indices is not None:
      return f'record {int(self.indices[index])} of TFDS split {self.name!r}'
    return f'image {index} of split {self.name!r}'

  def subset(self, keep: np.ndarray) -> 'Split':
    """The examples at positions `keep` (e.g. without the files that cannot be read)."""
    return dataclasses.replace(
        self, labels=None if self.labels is None else self.labels[keep],
        paths=None if self.paths is None else self.paths[keep],
        indices=None if self.indices is None else self.indices[keep],
        images=None if self.images is None else self.images[keep])


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
  if not os.path.isdir(root):
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
    known = ', '.join(printable(name) for name in class_names[:10]) + (', ...' if len(class_names) > 10 else '')
    if unknown_classes != 'drop':
      raise DataError(f'split {split!r} of {root} has class folders the model is not trained on: '
                      f"{shown}{more}; the model's {len(class_names)} classes are {known}; rename or remove them, "
                      'or set --config.dataset.unknown_classes=drop to leave their images out')
    logging.warning('leaving out class folders of split %r of %s that the model is not trained on '
                    '(dataset.unknown_classes=drop): %s%s', split, root, shown, more)
  paths, labels = [], []
  for name, images in images_by_class.items():
    if name in index:
      paths += images
      labels += [index[name]] * len(images)
  if not paths:
    raise DataError(f'split {split!r} of {root} has none of the model\'s classes '
                    f'({", ".join(printable(name) for name in class_names[:5])}, ...); is it the right folder?')
  return paths, labels


def missing_classes(labels: np.ndarray, class_names: Sequence[str]) -> list[str]:
  """The classes of which a split holds no example."""
  present = np.bincount(labels, minlength=len(class_names)) > 0
  return [name for name, found in zip(class_names, present) if not found]


def printable(text: str) -> str:
  """A file or class name fit for a one-line message: newlines, control characters and bytes
  that are not UTF-8 written as backslash escapes."""
  if text.isprintable():
    return text
  return ''.join(char if char.isprintable() else
                 f'\\x{ord(char) - 0xdc00:02x}' if 0xdc80 <= ord(char) <= 0xdcff else  # a byte os.fsdecode kept
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
  # `all` is the root itself when it holds the class folders directly (root/class/image).
  split_dir = root if split == ALL and not os.path.isdir(os.path.join(root, ALL)) else os.path.join(root, split)
  if not os.path.isdir(split_dir):
    found = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if found and any(f.lower().endswith(IMAGE_EXTENSIONS) for f in os.listdir(os.path.join(root, found[0]))):
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


def _list_folder_split(root: str, split: str) -> dict[str, list[str]]:
  """Class folder name -> its image paths (relative to `root`, sorted), in class-name order."""
  split_dir, class_dirs = _class_dirs(root, split)
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
      elif os.path.islink(path) and any(_inside(real, other) or _inside(other, real) for other in other_classes):
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
  return f'cannot decode image {where} ({type(error).__name__}{": " if reason else ""}{reason}); remove or replace it'


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
  parsed = urllib.parse.urlsplit(proxy if '://' in (proxy or '') else f'http://{proxy}') if proxy else None
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
    if missing := missing_classes(evaluation.labels, class_names):
      logging.warning('eval split %r has no examples of %d of the %d classes: %s; their per-class '
                      'rows show support 0', eval_spec, len(missing), len(class_names),
                      ', '.join(printable(name) for name in missing[:20]) + (', ...' if len(missing) > 20 else ''))
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


def get(dataset: ml_collections.ConfigDict) -> Source:
  """The source `config.dataset` names: a folder (wins when set), an embedded dataset or TFDS."""
  if dataset.folder:
    return FolderSource(dataset.folder, dataset.train_split, dataset.unknown_classes)
  if dataset.name in EMBEDDED:
    return EmbeddedSource(dataset.name)
  builder = tfds_builder(dataset.name, dataset.data_dir)
  return TfdsSource(builder) if tfds_info(builder).array_record else TfdsMemorySource(builder)
