"""Work computed ahead of its consumer: in worker processes, grain's worker threads, or one
background thread.

JAX-free: the worker processes are fresh interpreters that import only what the
work needs (numpy, Pillow, TFDS data sources).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import itertools
import logging
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
from typing import Iterable, Iterator, Sequence

from flaxtpu.data import shared_blocks
from flaxtpu.settings.errors import UserError


class InputWorkerDied(UserError):
  """A worker process of the input ended without its result: killed, or by the OOM killer. Not a bug
  in the trainer, and nothing it can retry safely; the run stops in one line and resumes from its
  checkpoint."""


def with_progress(chunks: Iterable, total: int, what: str, every_s: float = 10.0, size=len) -> Iterator:
  """Yields `chunks` (of `size(chunk)` results each: lists by default), logging `what`: done/total
  and an ETA every `every_s` seconds.

  Long preparation (a header scan or cache decode of a large split) then shows that it advances.
  """
  started = last = time.time()
  done = 0
  for chunk in chunks:
    done += size(chunk)
    now = time.time()
    if now - last >= every_s and done < total:
      logging.info('%s: %d/%d (%.0f%%), %.0fs, about %.0fs left', what, done, total, 100 * done / total,
                   now - started, (now - started) * (total - done) / done)
      last = now
    yield chunk


def run(function, items, workers: int, buffer: int, min_items_per_worker: int = 1,
        threads: bool = False, result_bytes: int = 0) -> Iterator:
  """`map(function, items)` in order, `buffer` results computed ahead: in `workers` processes, or
  `workers` threads of this process (`threads`, grain's read-ahead threads), or one thread if 0.

  Starting a process costs ~1 s (a fresh interpreter): short jobs stay on the thread. Threads
  suit work that releases the GIL for most of its time (JPEG decoding and resizing in
  libjpeg-turbo and OpenCV do) where system calls are cheap; one process's threads share its
  GIL, which capped them near 11,000-13,000 img/s here, and on a gVisor sandbox (Cloud TPU hosts)
  their file reads queue behind each other.

  The processes are a standard-library pool, not grain's: grain's workers import JAX (on a TPU
  host each ran the TPU runtime's start-up checks) and hand every array of a result over in a
  shared-memory block of its own, created and unlinked per batch. Here the function is sent to
  each worker once, not with each item, and large results come back through a fixed set of
  shared-memory blocks (`shared_blocks.Blocks`), small ones pickled through the pool's pipe. A
  worker that dies (the OOM killer) stops the pass with an error instead of a hang. `result_bytes`,
  the size of the arrays of a result where the caller knows it, sizes the blocks before the first
  result: else the first results in flight come back through the pipe.
  """
  workers = min(workers, len(items) // min_items_per_worker)
  if workers <= 0:
    return prefetch(map(function, items), size=buffer)
  if not threads:
    return _in_processes(function, items, workers, ahead=workers + buffer, result_bytes=result_bytes)
  import grain  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():  # grain reads its options from absl flags
    flags.FLAGS.mark_as_parsed()
  source = (grain.MapDataset.range(items.start, items.stop, items.step) if isinstance(items, range)
            else grain.MapDataset.source(list(items)))
  read = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=max(buffer, workers))
  return _closing_threads(iter(source.map(function).to_iter_dataset(read)))


def pool_map(function, items: Sequence, workers: int, threads: bool = False) -> Iterator:
  """`map(function, items)` in order, all submitted at once to `workers` processes (threads with
  `threads`; this thread if 0): for one-off jobs of compact results, such as decoding a split into
  memory chunk by chunk. The function goes to each worker once; each item travels: keep items small.

  On the TPU host's gVisor sandbox threads decoded CIFAR-10 in 11.6 s, 12 processes in 4.5 s.
  """
  workers = min(workers, len(items))
  if workers <= 1:
    yield from map(function, items)
    return
  if threads:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      yield from pool.map(function, items)
    return
  yield from _in_processes(function, items, workers, ahead=len(items))


def _in_processes(function, items: Iterable, workers: int, ahead: int, result_bytes: int = 0) -> Iterator:
  """`map(function, items)` in order in `workers` fresh processes, at most `ahead` items submitted
  and not yet consumed. The processes stop (their current items done) when the consumer stops.

  Results of tuples of arrays (batches) of 1 MiB or more come back through `ahead` shared-memory
  blocks (`shared_blocks.Blocks`) of `result_bytes`, or sized by the first result; the rest through
  the pool's pipe.
  """
  handed, blocks = _HandOver(function), shared_blocks.Blocks(ahead)
  pool = concurrent.futures.ProcessPoolExecutor(  # its processes start with the first items
      workers, mp_context=multiprocessing.get_context('spawn'), initializer=_start_worker,
      initargs=(handed.where, os.getpid()))
  try:
    if result_bytes:
      blocks.make(result_bytes)
    pending, items = collections.deque(), iter(items)

    def submit(count: int) -> None:
      for item in itertools.islice(items, count):
        block = blocks.take()
        pending.append((pool.submit(_work, item, block.name if block else None), block))

    submit(ahead)
    while pending:
      future, block = pending.popleft()
      result = blocks.unpacked(future.result(), block)
      submit(1)
      yield result
  except concurrent.futures.process.BrokenProcessPool as e:
    raise InputWorkerDied('an input worker process died (killed, or out of memory?); the checkpoints saved '
                          'so far are kept: lower --config.input.workers or --config.input.prefetch, then '
                          'run the same command to resume') from e
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
    blocks.close()
    handed.remove()


def _closing_threads(iterator) -> Iterator:
  """`iterator`, closed (what has not started is cancelled) when its consumer stops early."""
  try:
    yield from iterator
  finally:
    iterator.close()


class _HandOver:
  """`function` pickled where the workers read it as they start: a shared-memory block (which the
  resource tracker removes even if this process is killed), or a temporary file where /dev/shm has
  no room for it.

  Sent with each worker's start instead (`initargs`), it would travel through the pipe that
  multiprocessing's spawn writes and the parent waits on: past the pipe's 64 KiB (a loader's list
  of 6,400 file names is ~200 KB) the parent waits for each new interpreter to start and read it
  before it starts the next. On a TPU host's gVisor sandbox 13 workers so began their first batch
  one by one, 0.64 s to 9.5 s after the pool was made, and the input ran at half its rate for its
  first ~80 batches (`python -m benchmarks.input.host_probes batches`).
  """

  def __init__(self, function):
    data = multiprocessing.reduction.ForkingPickler.dumps(function)
    self._block = None
    room = shared_blocks.shm_room()
    if room is None or room >= 2 * len(data):
      self._block = shared_blocks.new_block(max(len(data), 1))
      self._block.buf[:len(data)] = data
      self.where = ('shared_memory', self._block.name, len(data))
      return
    with tempfile.NamedTemporaryFile('wb', prefix='flaxtpu-work-', suffix='.pickle', delete=False) as f:
      f.write(data)
    self.where = ('file', f.name, len(data))

  @staticmethod
  def load(where):
    """In a worker: the function."""
    kind, name, size = where
    if kind == 'file':
      with open(name, 'rb') as f:
        return pickle.load(f)
    block = shared_blocks.attach(name)
    try:
      return pickle.loads(bytes(block.buf[:size]))
    finally:
      block.close()

  def remove(self) -> None:
    if self._block is not None:
      self._block.close()
      self._block.unlink()
    else:
      os.unlink(self.where[1])


_worker_function = None  # in a worker process: what `_work` calls


def _start_worker(handed: tuple, parent: int) -> None:
  global _worker_function
  _die_with_parent(parent)
  function = _HandOver.load(handed)
  try:  # one OpenCV thread per worker: the workers are the parallelism (as PyTorch's DataLoader does)
    import cv2  # pylint: disable=g-import-not-at-top
    cv2.setNumThreads(1)
  except ImportError:
    pass
  _worker_function = function


_attached: dict = {}  # in a worker: the parent's shared-memory blocks it has opened, by name


def _work(item, block_name: str | None = None):
  if block_name is None:
    return _worker_function(item)
  if block_name not in _attached:  # at most one per item in flight: a fixed set
    # The workers share the parent's resource tracker, which keeps a set of names: attaching adds
    # nothing, and the parent's unlink at the end of the pass removes the name.
    _attached[block_name] = shared_blocks.attach(block_name)
    # Each batch is built in pages the last one freed.
    shared_blocks.keep_freed_memory(_attached[block_name].size)
  # The block is this item's alone from its submission until the parent has copied the result out.
  with shared_blocks.building_in(_attached[block_name]):
    result = _worker_function(item)
  return shared_blocks.packed(result, _attached[block_name])


def _die_with_parent(parent: int) -> None:
  """Runs first in each worker: on Linux, the kernel kills the worker when its parent (pid `parent`)
  dies, and a worker whose parent died while it was starting ends at once.

  Without it, a trainer stopped by kill -9 (or the OOM killer) leaves its workers behind, holding
  memory and file handles until the machine reboots. A fresh interpreter takes a second or more to
  get here (on a TPU host's gVisor sandbox), and a parent killed in that time has already given the
  worker to another (its parent id changed): such workers waited on their queue for ever, and kept
  multiprocessing's resource tracker alive with them.
  """
  if sys.platform.startswith('linux'):
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
  if os.getppid() != parent:
    os._exit(1)  # pylint: disable=protected-access  # nothing of the parent's to clean up here


class prefetch:  # pylint: disable=invalid-name  (used like a function: prefetch(iterator))
  """Runs `iterator` in a background thread, `size` items ahead of the consumer.

  `close()` (or the end of a `with` block) stops the thread and closes the
  iterator, which stops its worker processes.
  """

  def __init__(self, iterator: Iterator, size: int = 2):
    self._buffer: queue.Queue = queue.Queue(maxsize=max(size, 1))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._produce, args=(iterator,), daemon=True)
    self._thread.start()

  _DONE = object()

  def _produce(self, iterator: Iterator) -> None:
    try:
      for item in iterator:
        if not self._put(item):
          break
      self._put(self._DONE)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the consumer)
      self._put(e)
    finally:
      if hasattr(iterator, 'close'):
        iterator.close()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._buffer.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def __iter__(self):
    return self

  def __next__(self):
    item = self._buffer.get()
    if item is self._DONE:
      self._buffer.put(item)  # stay exhausted
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
