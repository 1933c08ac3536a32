"""WebDataset-style tar shards (`dataset.shards`), and their sampler (`sampling=shards`).

Each shard is indexed once from its tar headers (member offsets and sizes, by worker processes
when there are many); an image is read by offset when it is used, through a few files each
process keeps open. Process p of P streams only its own shards (`ShardSampler`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import posixpath
import tarfile
import threading
from typing import Sequence

import ml_collections
import numpy as np

from flaxtpu.data import samplers, workers
from flaxtpu.data.preprocess import IMAGE_EXTENSIONS
from flaxtpu.data.sources.base import ALL, DataError, IndexedRecords, Split
from flaxtpu.data.sources.tagged import (
  Catalog,
  SeveralTags,
  TaggedSource,
  label_values,
  pattern_files,
  tags_of_files,
)
from flaxtpu.settings.errors import ConfigError

SHARD_CLASSES = 'classes.txt'  # beside the shards: one class name per line, indexed by KEY.cls
SHARD_LABEL_SUFFIXES = ('cls', 'json')
MAX_OPEN_SHARDS = 16  # open files each process keeps for reading members by offset
SHARDS_PER_INDEX_WORKER = 16  # a worker process starts in ~1-2 s: fewer shards are indexed in this one
_TAR_BLOCK = 512
_COMPRESSED = {b'\x1f\x8b': 'gzip', b'BZh': 'bzip2', b'\xfd7zXZ': 'xz', b'\x28\xb5\x2f\xfd': 'zstd'}
# sampling=shards: examples shuffled together, a few shards' worth (WebDataset's usual buffer).
SHUFFLE_WINDOW = 1_000


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
    try:
      return label_values(text, separated=False)
    except SeveralTags as e:
      raise ValueError(f'{e}, but KEY.cls holds one class: write tags as KEY.json {{"labels": [...]}}'
                       ) from None
  try:
    record = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f'is not valid JSON ({e.msg})') from None
  if not isinstance(record, dict) or not {'label', 'labels'} & set(record):
    raise ValueError('has no "label" or "labels" key')
  if 'labels' in record:
    return label_values(record['labels'])
  try:
    return label_values(record['label'], False)
  except SeveralTags as e:
    raise ValueError(f'{e}, but "label" holds one class: write tags as {{"labels": [...]}}') from None


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
  """The images of indexed shards read by offset (the store of a Split's `IndexedRecords`)."""

  def __init__(self, paths: tuple[str, ...], shard: np.ndarray, offset: np.ndarray, size: np.ndarray,
               names: list[str]):
    self.paths, self.shard, self.offset, self.size, self.names = paths, shard, offset, size, names

  def __len__(self) -> int:
    return len(self.shard)

  def __getitem__(self, index: int) -> tuple[bytes, None]:
    return read_member(self.paths[self.shard[index]], int(self.offset[index]), int(self.size[index])), None

  def describe(self, index: int) -> str:
    return f'{self.names[index]} in shard {self.paths[self.shard[index]]}'


class ShardSource(TaggedSource):
  """WebDataset-style tar shards (`dataset.shards`): KEY.jpg (or .png, ...) with KEY.cls or KEY.json.

  Each shard is indexed once from its tar headers (member offsets and sizes); an image is read by
  offset when it is used. The index is in pattern order then tar order, so resuming is exact.
  `{split}` in the pattern names the split; without it the one split is `all`, sliced.
  """
  kind, key, title = 'shards', 'shards', 'shards'

  @classmethod
  def check(cls, config) -> None:
    if config.dataset.sampling == 'shards' and not config.dataset.shards:
      raise ConfigError("config.dataset.sampling='shards' streams tar shards per process; set "
                        "config.dataset.shards too, or use sampling='shuffle'")

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    super().__init__(dataset, task)
    self.pattern = dataset.shards
    self.members = None

  def split(self, spec, positions, labels):
    return Split(name=spec, records=IndexedRecords(self.members, positions), labels=labels,
                 groups=self.members.shard[positions])

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
    # Each shard's class indices name the classes of the classes.txt beside IT (splits may list them in
    # other orders); they are matched to training's by name.
    classes_files = [os.path.join(os.path.dirname(path), SHARD_CLASSES) for path in paths]
    lists = {}
    for classes_file in dict.fromkeys(classes_files):
      if os.path.isfile(classes_file):
        with open(classes_file, encoding='utf-8') as f:
          lists[classes_file] = [line.strip() for line in f if line.strip()]
    tags, class_names = tags_of_files([row[5] for row in rows], np.asarray([row[0] for row in rows]),
                                      [lists.get(classes_file) for classes_file in classes_files],
                                      classes_files, where, f'shards {self.pattern}',
                                      f'no {SHARD_CLASSES} beside it')
    split_of_shard = [ALL if name is None else name for _, name in shard_splits]
    return Catalog(
        what=f'shards {self.pattern}', tags=tags,
        split_of=None if '{split}' not in self.pattern else np.asarray(
            [shard_splits[row[0]][1] for row in rows], object),
        class_names=class_names, where=where, absent=self._absent,
        class_lists=[(split_of_shard[shard], lists[file]) for shard, file in enumerate(classes_files)
                     if file in lists])

  def _absent(self, split: str, present: list) -> str:
    if present == [ALL]:
      return (f"config.dataset.shards={self.pattern!r} has no {{split}}, so its one split is '{ALL}': hold "
              f"out a part with --config.dataset.train_split='{ALL}[:80%]' "
              f"--config.dataset.eval_split='{ALL}[80%:]'")
    return f'the shards of split {split!r} ({self.pattern}) hold no examples; splits with examples: ' + (
        ', '.join(present))


class ShardSampler(samplers.Sampler):
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
    shard_order = samplers.generator(self.seed, samplers.SHARD_ORDER_STREAM, epoch).permutation(
        self.num_shards)
    turn = np.argsort(shard_order)  # when each shard comes this epoch
    stream = self.mine[np.argsort(turn[self.shard_of[self.mine]], kind='stable')]  # tar order within
    windows = samplers.generator(self.seed, samplers.SHARD_WINDOW_STREAM, epoch, self.process_index)
    for start in range(0, len(stream), SHUFFLE_WINDOW):
      stream[start:start + SHUFFLE_WINDOW] = windows.permutation(stream[start:start + SHUFFLE_WINDOW])
    return stream[:self.steps_per_epoch * self.local_batch_size]

  def _batch(self, order, position):
    return order[position * self.local_batch_size:(position + 1) * self.local_batch_size]



@samplers.register('shards')
def _shard_sampler(train, seed: int, batch_size: int, process_index: int = 0,
                   process_count: int = 1) -> ShardSampler:
  if train.example_groups is None:
    raise DataError('config.dataset.sampling=shards streams tar shards per process, and the train '
                    'split is not read from shards; set config.dataset.shards, or '
                    '--config.dataset.sampling=shuffle')
  return ShardSampler(seed, train.example_groups, batch_size, process_index=process_index,
                      process_count=process_count)
