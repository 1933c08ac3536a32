"""The shared-memory blocks that input workers hand large results (batches) back through.

A fixed set per pass (`Blocks`), each mapped with its pages in place (`attach`); a worker builds a
batch's images straight into the block its result goes back through (`result_array`), and the parent
copies each array out once. JAX-free, like the workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import re
import secrets
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class InBlock:
  """An array a worker wrote into a shared-memory block: where, and what it is."""
  offset: int
  shape: tuple
  dtype: str


_ALIGN = 64  # each array of a block starts on a cache line


class Blocks:
  """The shared-memory blocks large results come back through: `count` of them (one per item in
  flight), made when the first result shows their size, reused for the whole pass, unlinked at its
  end. A pickled 38 MiB batch (256 images of 224x224) through a pipe capped a TPU host's gVisor
  sandbox near 940 img/s with 13 workers; here the parent copies each array out once.

  A fixed set: the open files and /dev/shm use do not grow with the batches (grain's hand-over
  made a block per array and ran out of file descriptors). Without room in /dev/shm (a container's
  64 MiB default) results stay on the pipe, said once.
  """

  MIN_BYTES = 1 << 20  # below, pickling through the pipe costs less than a block's bookkeeping

  def __init__(self, count: int):
    self._count, self._free, self._all = count, [], []
    self._sized = False
    self._mapped = {}  # block name -> its populated mapping here (`attach`), from its first result

  def take(self):
    return self._free.pop() if self._free else None

  def unpacked(self, result, block):
    """`result` with each array the worker wrote into `block` copied out; the block is free again."""
    if block is not None:
      if isinstance(result, tuple):
        if block.name not in self._mapped:  # after a worker's attach put its pages in place
          self._mapped[block.name] = attach(block.name, block)
        buffer = self._mapped[block.name].buf
        fields = [np.array(np.ndarray(field.shape, field.dtype, buffer=buffer, offset=field.offset))
                  if isinstance(field, InBlock) else field for field in result]
        result = _like(result, fields)
      self._free.append(block)
    elif not self._sized:
      self.make(packed_size(result))
    return result

  def make(self, size: int) -> None:
    """The blocks, for results whose arrays take `size` bytes (once; none below MIN_BYTES)."""
    self._sized = True
    if size < self.MIN_BYTES:
      return
    size += size // 8  # room for a larger batch (images of another size, more labels)
    if (room := shm_room()) is not None and room < 2 * size * self._count:
      logging.info('input workers: /dev/shm has %.0f MiB free, too little for %d blocks of %.0f MiB; '
                   'batches come back through pipes (slower; a larger /dev/shm, e.g. docker run '
                   '--shm-size, lifts it)', room / 2**20, self._count, size / 2**20)
      return
    keep_freed_memory(size)  # the copies out of the blocks reuse pages
    for _ in range(self._count):
      self._all.append(new_block(size))
    self._free = list(self._all)

  def close(self) -> None:
    for mapping in self._mapped.values():
      mapping.close()
    for block in self._all:
      block.close()
      block.unlink()
    self._all, self._free, self._mapped = [], [], {}


PREFIX = 'flaxtpu_'  # a block's name: flaxtpu_<pid of the process that made it>_<random>
ORPHAN_AGE_S = 600  # a dead maker's block untouched this long is an orphan (a live pass writes each batch)


def new_block(size: int):
  """A new shared-memory block named after this process (`remove_orphans` finds those a killed run left)."""
  from multiprocessing import shared_memory  # pylint: disable=g-import-not-at-top
  if not _orphans_removed:
    remove_orphans()
  while True:
    try:
      return shared_memory.SharedMemory(f'{PREFIX}{os.getpid()}_{secrets.token_hex(4)}', create=True,
                                        size=size)
    except FileExistsError:  # another block drew the same name
      continue


def remove_orphans(now: float | None = None) -> None:
  """Unlinks the blocks in /dev/shm that a run killed with its whole process group left (kill -9 of the
  group, scancel, a container's OOM kill: multiprocessing's resource tracker, which unlinks a killed
  trainer's blocks, died with it): their maker is gone and they were not written for ORPHAN_AGE_S.
  They hold /dev/shm (a batch of 256 224x224 images each, one per item in flight) until a reboot."""
  global _orphans_removed
  _orphans_removed = True
  now = time.time() if now is None else now
  removed, freed = 0, 0
  try:
    names = os.listdir('/dev/shm')
  except OSError:  # no /dev/shm (macOS)
    return
  for name in names:
    match = re.fullmatch(re.escape(PREFIX) + r'(\d+)_[0-9a-f]+', name)
    path = os.path.join('/dev/shm', name)
    try:
      if not match or _alive(int(match.group(1))) or now - os.stat(path).st_mtime < ORPHAN_AGE_S:
        continue
      freed += os.stat(path).st_size
      os.unlink(path)
      removed += 1
    except OSError:  # removed meanwhile, or not ours to remove
      continue
  if removed:
    logging.info('removed %d shared-memory blocks (%.0f MiB) that killed runs left in /dev/shm', removed,
                 freed / 2**20)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # another user's: alive
    return True
  return True


_orphans_removed = False  # remove_orphans has run in this process


@dataclasses.dataclass
class _Populated:
  """A shared-memory block mapped with every page in place (`attach`): what `packed` and the
  copy out need of a `SharedMemory`."""
  buf: mmap.mmap

  @property
  def size(self) -> int:
    return len(self.buf)

  def close(self) -> None:
    with contextlib.suppress(BufferError):  # an array still viewing it: unmapped when collected
      self.buf.close()


def attach(name: str, block=None):
  """Shared-memory block `name` mapped with all its pages in place at once (Linux's MAP_POPULATE),
  else as `multiprocessing` maps it (`block`, where this process has it; else attached by name).

  On a TPU host's gVisor sandbox every page of a block faulted on its first touch in each process:
  writing a batch (38 MiB) into a block new to a worker took 127 ms with 13 workers busy, and even
  later writes 19-36 ms, against 4 ms through a populated mapping (7 ms to map). Workers take
  whichever block is free, so each met every block once: the input ran at a third of its rate for
  its first ~100 batches (`python -m benchmarks.input.host_probes batches`).
  """
  populate = getattr(mmap, 'MAP_POPULATE', 0)
  path = os.path.join('/dev/shm', name.lstrip('/'))
  if populate and os.path.exists(path):
    fd = os.open(path, os.O_RDWR)
    try:
      return _Populated(mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | populate))
    finally:
      os.close(fd)
  if block is not None:
    return block  # closing it twice is harmless
  from multiprocessing import shared_memory  # pylint: disable=g-import-not-at-top
  return shared_memory.SharedMemory(name)


def keep_freed_memory(nbytes: int) -> None:
  """Has glibc's malloc serve blocks up to `nbytes` (a batch) from its heap and keep what is freed
  there, instead of mapping fresh pages for each and unmapping them when freed (its default above
  32 MiB; 38 MiB for 256 images of 224x224).

  Each fresh page is a page fault on first touch: on a TPU host's gVisor sandbox a new 38 MiB array
  took 42.9 ms to fill against 3.3 ms for one reused (3.2 ms after this call), 43 ms of every batch
  in each worker and again in the trainer that copies it out of its block. Process-wide, and only
  ever raised; elsewhere (no glibc) nothing changes.
  """
  global _heap_serves
  if nbytes <= _heap_serves:
    return
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (AttributeError, OSError):  # macOS, musl: no mallopt
    return
  m_trim_threshold, m_mmap_threshold = -1, -3
  # Room above `nbytes`: an array's allocation adds a header, and a batch may come a little larger.
  threshold = min(nbytes + nbytes // 4 + (1 << 20), 1 << 29)  # C ints
  # Trimming only past four batches of free heap: a batch freed at its top is reused, not unmapped.
  if mallopt(m_mmap_threshold, threshold) and mallopt(m_trim_threshold, 4 * threshold):
    _heap_serves = nbytes


_heap_serves = 0  # the largest block malloc serves from its heap here (keep_freed_memory)


def shm_room() -> int | None:
  try:
    stats = os.statvfs('/dev/shm')
  except OSError:  # no /dev/shm (macOS): POSIX shared memory lives elsewhere
    return None
  return stats.f_bavail * stats.f_frsize


def _block_arrays(result) -> list:
  """The fields of a tuple result (a batch) that can go into a block: plain numpy arrays."""
  if not isinstance(result, tuple):
    return []
  return [field for field in result if isinstance(field, np.ndarray) and not field.dtype.hasobject]


def packed_size(result) -> int:
  return sum(_aligned(array.nbytes) for array in _block_arrays(result))


def _like(result: tuple, fields: list) -> tuple:
  """`fields` as a tuple of `result`'s kind (a batch's named tuple, or a plain tuple)."""
  return type(result)._make(fields) if hasattr(result, '_make') else tuple(fields)


def _aligned(nbytes: int) -> int:
  return -(-nbytes // _ALIGN) * _ALIGN


def packed(result, block):
  """In a worker: `result` with its arrays written into `block` as far as they fit (`InBlock`s); an
  array built in place there (`result_array`) is not copied."""
  if not _block_arrays(result) or packed_size(result) > block.size:
    return result
  fields, offset = [], 0
  for field in result:
    if isinstance(field, np.ndarray) and not field.dtype.hasobject:
      target = np.ndarray(field.shape, field.dtype, buffer=block.buf, offset=offset)
      if not _in_place(field, target):
        target[...] = field
      field, offset = InBlock(offset, field.shape, field.dtype.str), offset + _aligned(field.nbytes)
    fields.append(field)
  return _like(result, fields)


def _in_place(array: np.ndarray, target: np.ndarray) -> bool:
  """Whether `array` already is `target`'s memory, laid out alike."""
  return array.ctypes.data == target.ctypes.data and array.strides == target.strides


def result_array(shape: tuple, dtype) -> np.ndarray:
  """A new array for the first array of a result (a batch's images) to be built in.

  In an input worker whose result goes back through a shared-memory block, it is a view of the
  block's start, where `packed` would otherwise copy it (a 38 MiB copy for each batch of 256
  224x224 images, in each worker); elsewhere (threads, the trainer's own process, a result too large)
  a plain `np.empty`.
  """
  global _building_in
  block, _building_in = _building_in, None  # the block's start holds one array
  dtype = np.dtype(dtype)
  if block is not None and int(np.prod(shape)) * dtype.itemsize <= block.size:
    return np.ndarray(shape, dtype, buffer=block.buf)
  return np.empty(shape, dtype)


_building_in = None  # in a worker computing an item: the block its result goes back through


@contextlib.contextmanager
def building_in(block):
  """In a worker: `result_array` builds the item computed inside in `block`."""
  global _building_in
  _building_in = block
  try:
    yield
  finally:
    _building_in = None
