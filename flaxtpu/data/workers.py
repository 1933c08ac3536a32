"""Work computed ahead of its consumer: in grain worker threads or processes, or one background thread.

JAX-free: the worker processes are fresh interpreters that import only what the
work needs (numpy, Pillow, TFDS data sources).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import gc
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import time
from typing import Iterable, Iterator, Sequence

import numpy as np


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
        threads: bool = False) -> Iterator:
  """`map(function, items)` in order, computed ahead by grain: in `workers` threads of this
  process (`threads`) or `workers` processes, or in one thread if 0.

  Starting a process costs ~1-2 s (a fresh interpreter): short jobs stay on the thread. Threads
  suit work that releases the GIL for most of its time (JPEG decoding and resizing in
  libjpeg-turbo and OpenCV do): their results need no hand-over, whereas a process's results pass
  through a fresh shared-memory block, which cost ~20 ms of CPU per 19 MiB batch here (tmpfs
  page allocation), more than a third of what building the batch cost.
  """
  workers = min(workers, len(items) // min_items_per_worker)
  if workers <= 0:
    return prefetch(map(function, items), size=buffer)
  import grain  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():  # grain reads its options from absl flags
    flags.FLAGS.mark_as_parsed()
  source = (grain.MapDataset.range(items.start, items.stop, items.step) if isinstance(items, range)
            else grain.MapDataset.source(list(items)))
  mapped = source.map(function)
  if threads:  # grain's read-ahead threads: `buffer` results computed ahead, in order
    read = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=max(buffer, workers))
    return _closing_threads(iter(mapped.to_iter_dataset(read)))
  # No reader threads or read-ahead inside a worker: each element is a whole batch, and the
  # per-worker buffer of mp_prefetch already keeps `buffer` of them ready. (grain's defaults,
  # 16 threads and 500 elements, held gigabytes per worker when the consumer is slower.)
  # Results come back in shared memory (released by _closing). Through the pipe instead, a worker
  # stopped mid-write can leave a partial message that blocks close() forever.
  dataset = mapped.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  options = grain.MultiprocessingOptions(num_workers=workers,
                                         per_worker_buffer_size=max(1, buffer // workers))
  return _closing(iter(dataset.mp_prefetch(options, worker_init_fn=_die_with_parent)))


def pool_map(function, items: Sequence, workers: int, threads: bool = False) -> Iterator:
  """`map(function, items)` in order, in a pool of `workers` processes (threads with `threads`; this
  thread if 0): for one-off jobs whose results are few and compact, such as decoding a split into
  memory chunk by chunk.

  A result comes back pickled through the pool's pipe, not in shared memory: grain's hand-over
  gives every array of a result a shared-memory block of its own, which holds a file descriptor
  until a background thread frees it, so 500 small images per result ran a TPU host out of
  descriptors (Errno 24). Processes start from a fresh interpreter (never a fork of a trainer
  that holds an accelerator) and die with their parent. Threads suit work that releases the GIL
  for most of its time; on a gVisor sandbox (as Cloud TPU hosts run) their file reads queue
  behind each other, and processes decoded CIFAR-10 2.6x faster (docs/performance.md).
  """
  workers = min(workers, len(items))
  if workers <= 1:
    yield from map(function, items)
    return
  if threads:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      yield from pool.map(function, items)
    return
  context = multiprocessing.get_context('spawn')
  with context.Pool(workers, initializer=_die_with_parent, initargs=(0, workers)) as pool:
    yield from pool.imap(function, items)


def _closing_threads(iterator) -> Iterator:
  """`iterator`, closed (what has not started is cancelled) when its consumer stops early."""
  try:
    yield from iterator
  finally:
    iterator.close()


def _die_with_parent(worker_index: int, worker_count: int) -> None:
  """Runs first in each worker: on Linux, the kernel kills the worker when its parent dies.

  Without it, a trainer stopped by kill -9 (or the OOM killer) leaves its
  workers behind, holding memory and file handles until the machine reboots.
  """
  del worker_index, worker_count
  if sys.platform.startswith('linux'):
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _closing(iterator) -> Iterator:
  try:
    for element in iterator:
      copy = _copied(element)
      del element  # its shared memory goes now, not when this generator ends
      yield copy
  finally:
    iterator.close()  # stops the worker processes, also when the consumer stops early
    _wait_for_shared_memory_release()


def _wait_for_shared_memory_release() -> None:
  """Returns once grain has unlinked the shared memory of every result dropped so far.

  grain unlinks a block when its array is deleted, from a background thread;
  the last arrays of a pass are held in reference cycles (grain's stored
  StopIteration and the frames its traceback keeps) until the collector runs.
  Blocks not unlinked when Python exits stay registered with the resource
  tracker, which then warns of 'leaked shared_memory objects' (and removes
  them) at the end of every streamed run.
  """
  from grain._src.python.ipc import shared_memory_array  # pylint: disable=g-import-not-at-top
  gc.collect()  # once per pass: the cycles holding the last arrays
  deleter = getattr(shared_memory_array.SharedMemoryArray, '_del_thread_pool', None)
  if deleter is not None:
    deleter.apply(int)  # one thread, first in first out: the deletions queued before have run


def _copied(element):
  """A private copy of a worker's result. Each array grain hands over lives in a shared-memory
  block that holds a file descriptor until the array is dropped: results kept for long (a
  decoded cache of 50,000 images) would run out of descriptors."""
  if isinstance(element, np.ndarray):
    return np.array(element)
  if isinstance(element, tuple) and hasattr(element, '_fields'):  # a NamedTuple such as a Batch
    return type(element)(*map(_copied, element))
  if isinstance(element, (tuple, list)):
    return type(element)(map(_copied, element))
  return element


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
