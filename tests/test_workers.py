"""Worker processes hand large results (batches) back through a fixed set of shared-memory blocks:
the arrays arrive equal, the open files and blocks do not grow with the batches, nothing is left
in /dev/shm, and without room there the pipe carries them."""

import collections
import logging
import os

import numpy as np
import pytest

from flaxtpu.data import shared_blocks, workers

Batch = collections.namedtuple('Batch', 'images labels mask')


def big_batch(step: int) -> Batch:
  """A 1.3 MiB batch whose pixels and labels depend on the step; step 7's has twice the images."""
  rng = np.random.default_rng(step)
  count = 96 if step == 7 else 48
  return Batch(rng.integers(0, 256, (count, 96, 96, 3), dtype=np.uint8),
               np.arange(count, dtype=np.int32) + step, rng.random(count) < 0.5)


def failing_or_small(step: int):
  return ('failure', step) if step % 2 else np.full(3, step)


@pytest.fixture
def made_blocks(monkeypatch):
  """Every `shared_blocks.Blocks` a pass makes, to look at after it."""
  made = []
  original = shared_blocks.Blocks.__init__

  def record(self, count):
    original(self, count)
    made.append(self)
  monkeypatch.setattr(shared_blocks.Blocks, '__init__', record)
  return made


def test_batches_come_back_equal_through_blocks(made_blocks):
  blocks = []
  for step, batch in enumerate(workers.run(big_batch, range(12), workers=2, buffer=2)):
    expected = big_batch(step)
    assert type(batch) is Batch
    for got, want in zip(batch, expected):
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(got, want)
    if step == 3:
      blocks = [(block.name, block.size) for block in made_blocks[0]._all]
  # One block per item in flight (2 workers + 2 ahead), each the first batch's arrays plus an eighth:
  # step 7's batch (twice as large) came back through the pipe, equal all the same.
  packed = sum(-(-array.nbytes // 64) * 64 for array in big_batch(0))
  assert [size for _, size in blocks] == [packed + packed // 8] * 4
  # Unlinked at the end of the pass.
  if os.path.isdir('/dev/shm'):
    assert not any(os.path.exists(f'/dev/shm/{name.lstrip("/")}') for name, _ in blocks)


@pytest.mark.skipif(not os.path.isdir('/proc/self/fd'), reason='counts open files in /proc (Linux)')
def test_open_files_and_blocks_stay_flat_over_many_batches(made_blocks):
  counts = []
  for step, batch in enumerate(workers.run(big_batch, range(200), workers=2, buffer=1)):
    assert batch.labels[0] == step
    if step % 20 == 0 and step:  # from when every block has come back once (each is mapped here then)
      counts.append(len(os.listdir('/proc/self/fd')))
  assert max(counts) - min(counts) <= 1, counts
  assert len(made_blocks) == 1 and made_blocks[0]._all == []  # closed: 3 blocks were made, all unlinked


def test_without_room_in_dev_shm_batches_come_through_the_pipe(monkeypatch, made_blocks, caplog):
  monkeypatch.setattr(shared_blocks, 'shm_room', lambda: 1 << 20)
  with caplog.at_level(logging.INFO):
    batches = list(workers.run(big_batch, range(5), workers=2, buffer=1))
  for step, batch in enumerate(batches):
    np.testing.assert_array_equal(batch.images, big_batch(step).images)
  assert made_blocks[0]._all == [] and made_blocks[0]._sized
  assert 'too little for 3 blocks' in caplog.text and 'through pipes' in caplog.text


def test_small_and_non_batch_results_stay_on_the_pipe(made_blocks):
  results = list(workers.run(failing_or_small, range(6), workers=2, buffer=1))
  assert results[1] == ('failure', 1) and results[5] == ('failure', 5)
  np.testing.assert_array_equal(results[4], [4, 4, 4])
  assert made_blocks[0]._all == []  # 24-byte results: no blocks made


def test_a_known_result_size_sends_even_the_first_batches_through_blocks(monkeypatch, made_blocks):
  through = []
  original = shared_blocks.Blocks.unpacked

  def record(self, result, block):
    through.append(block is not None)
    return original(self, result, block)
  monkeypatch.setattr(shared_blocks.Blocks, 'unpacked', record)
  size = 48 * 96 * 96 * 3  # the images of big_batch's batches; labels and mask fit in the eighth more
  for step, batch in enumerate(workers.run(big_batch, range(6), workers=2, buffer=2, result_bytes=size)):
    np.testing.assert_array_equal(batch.images, big_batch(step).images)
  assert through == [True] * 6
  # Without the size, the 4 results first in flight (2 workers + 2 ahead) came through the pipe.
  through.clear()
  list(workers.run(big_batch, range(6), workers=2, buffer=2))
  assert through == [False] * 4 + [True] * 2


def built_in_place(step: int) -> Batch:
  """A batch whose images are built as a loader builds them (`result_array`); its labels say whether
  they were a view of shared memory (not an array of their own) while the worker filled them."""
  images = shared_blocks.result_array((48, 96, 96, 3), np.uint8)
  images[...] = step
  return Batch(images, np.array([not images.flags.owndata, step]), np.ones(48, bool))


def test_a_worker_builds_its_batch_in_the_block_it_goes_back_through():
  size = 48 * 96 * 96 * 3
  for step, batch in enumerate(workers.run(built_in_place, range(6), workers=2, buffer=2, result_bytes=size)):
    assert batch.labels.tolist() == [1, step]  # built in the block: no copy into it afterwards
    assert (batch.images == step).all() and batch.images.flags.owndata  # copied out of it by the trainer
  # Elsewhere (this process, a thread) an array of its own.
  assert built_in_place(0).labels.tolist() == [0, 0]
  assert [batch.labels[0] for batch in workers.run(built_in_place, range(4), workers=2, buffer=2,
                                                      threads=True)] == [0] * 4


def test_an_array_in_place_in_its_block_is_not_copied_there():
  from multiprocessing import shared_memory
  block = shared_memory.SharedMemory(create=True, size=2 * 2**20)
  try:
    with shared_blocks.building_in(block):
      images = shared_blocks.result_array((1024, 1024), np.uint8)
      assert shared_blocks._building_in is None  # one array a result: the next is a plain one
      assert shared_blocks.result_array((4,), np.uint8).flags.owndata
    images[...] = 5
    target = np.ndarray(images.shape, images.dtype, buffer=block.buf)
    assert shared_blocks._in_place(images, target) and not shared_blocks._in_place(images.copy(), target)
    packed = shared_blocks.packed(Batch(images, np.arange(3), np.ones(3, bool)), block)
    assert packed.images == shared_blocks.InBlock(0, (1024, 1024), '|u1') and (target == 5).all()
    # Too large for the block: an array of its own.
    with shared_blocks.building_in(block):
      assert shared_blocks.result_array((3, 2**20), np.uint8).flags.owndata
    assert shared_blocks._building_in is None
    del images, target
  finally:
    block.close()
    block.unlink()


def mapped_bytes() -> int:
  """What glibc's malloc holds in blocks mapped apart from its heap (`mallinfo2().hblkhd`)."""
  import ctypes  # pylint: disable=g-import-not-at-top

  class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks',
        'keepcost')]
  mallinfo2 = ctypes.CDLL(None).mallinfo2
  mallinfo2.restype = MallInfo2
  return mallinfo2().hblkhd


def mapped_batch(step: int) -> Batch:
  """A 40 MiB batch built as a loader builds one (an empty array filled row by row); its labels say
  how many more bytes malloc had mapped apart from its heap while it was alive."""
  before = mapped_bytes()
  images = np.empty((40, 1024, 1024), np.uint8)
  for row in images:
    row[...] = step
  return Batch(images, np.array([mapped_bytes() - before]), np.ones(40, bool))


def has_mallinfo2() -> bool:
  import ctypes  # pylint: disable=g-import-not-at-top
  try:
    return bool(ctypes.CDLL(None).mallinfo2)
  except (AttributeError, OSError):
    return False


@pytest.mark.skipif(not has_mallinfo2(), reason="looks at glibc's malloc (2.33 or later)")
def test_batches_past_32_mib_reuse_the_heap_in_the_workers_and_the_trainer():
  # glibc maps every block over 32 MiB apart from its heap, fresh, and unmaps it when freed: a page
  # fault for every page of every batch, in the worker that fills it and in the trainer that copies
  # it out (43 ms a 38 MiB batch on a TPU host's gVisor sandbox, against 3.3 ms for reused pages).
  # `keep_freed_memory` has both serve batches from the heap, where the last one's pages are reused.
  size = 40 * 2**20
  in_worker, in_trainer = [], []
  batches = workers.run(mapped_batch, range(6), workers=1, buffer=1, result_bytes=size)
  for step in range(6):
    before = mapped_bytes()  # what the trainer's process had mapped already (its other arrays)
    batch = next(batches)
    assert batch.images[-1, -1, -1] == step
    in_worker.append(int(batch.labels[0]))
    in_trainer.append(mapped_bytes() - before)
    del batch
  assert next(batches, None) is None
  # The worker attaches an item's block, and sets malloc's threshold, before it builds the item.
  assert max(in_worker) < size, in_worker
  assert max(in_trainer) < size, in_trainer


def resident_bytes(buffer) -> int:
  """How much of the mapping behind `buffer` is in this process's page tables (/proc/self/smaps)."""
  import ctypes
  address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
  with open('/proc/self/smaps', encoding='ascii') as smaps:
    inside = False
    for line in smaps:
      head = line.split()[0]
      if '-' in head and ':' not in head:
        start, stop = (int(part, 16) for part in head.split('-'))
        inside = start <= address < stop
      elif inside and head == 'Rss:':
        return int(line.split()[1]) * 1024
  raise AssertionError('mapping not found in /proc/self/smaps')


@pytest.mark.skipif(not hasattr(__import__('mmap'), 'MAP_POPULATE') or not os.path.isdir('/dev/shm'),
                    reason="MAP_POPULATE and /dev/shm are Linux's")
def test_blocks_are_mapped_with_every_page_in_place():
  """A block a worker (or the trainer) maps has all its pages in place before the first write: under
  gVisor each page faulted on first touch, 127 ms a batch (shared_blocks.attach)."""
  from multiprocessing import shared_memory
  size = 8 << 20
  block = shared_memory.SharedMemory(create=True, size=size)
  try:
    plain = shared_memory.SharedMemory(block.name)  # as multiprocessing attaches: nothing mapped yet
    populated = shared_blocks.attach(block.name)
    try:
      assert resident_bytes(plain.buf) == 0
      assert resident_bytes(populated.buf) == size
      assert populated.size == size
      np.ndarray(16, np.uint8, buffer=populated.buf)[:] = 7  # one memory: the creator sees the write
      assert bytes(block.buf[:16]) == bytes([7] * 16)
    finally:
      plain.close()
      populated.close()
  finally:
    block.close()
    block.unlink()


class Heavy:
  """A worker's function that carries 1 MiB with it, as a loader carries its list of files."""

  def __init__(self):
    self.payload = np.arange(1 << 18, dtype=np.int32)

  def __call__(self, step: int) -> int:
    return int(self.payload[step]) * 2


def test_workers_start_without_the_parent_waiting_on_each(monkeypatch):
  """What a worker's spawn writes into its pipe stays under the pipe's 64 KiB, however large the
  function: else the parent waits for each new interpreter to read it before starting the next
  (13 workers began one by one over 9.5 s on a TPU host). The function still arrives whole, from a
  shared-memory block (or a file where /dev/shm has no room), and nothing stays behind."""
  from multiprocessing import popen_spawn_posix
  written = []
  original = popen_spawn_posix.reduction.dump

  def dump(obj, file, protocol=None):
    before = file.tell()
    original(obj, file, protocol)
    written.append(file.tell() - before)
  monkeypatch.setattr(popen_spawn_posix.reduction, 'dump', dump)
  handed, hand_over = [], workers._HandOver

  def recorded(function):
    handed.append(hand_over(function))
    return handed[-1]
  monkeypatch.setattr(workers, '_HandOver', recorded)
  for room in (None, 1024):  # /dev/shm as it is, then (as in a small container) without room
    monkeypatch.setattr(shared_blocks, 'shm_room', lambda room=room: room)
    results = workers.run(Heavy(), range(0, 40000, 1000), workers=2, buffer=2)
    assert list(results) == list(range(0, 80000, 2000))
    kind, name, size = handed[-1].where
    assert (kind, size > 1 << 20) == (('shared_memory' if room is None else 'file'), True)
    assert not os.path.exists(name if kind == 'file' else os.path.join('/dev/shm', name.lstrip('/')))
  assert len(written) == 8  # each worker: its preparation data, then its process object
  assert max(written) < 64 << 10


_SLOW_TO_START = '''
import sys, time
if __name__ != '__main__':  # in a worker: spawn imports this file again before the worker runs
  time.sleep(3)
if __name__ == '__main__':
  sys.path.insert(0, sys.argv[1])
  from flaxtpu.data import workers
  print(sum(workers.run(abs, range(-50, 0), workers=2, buffer=1)), flush=True)
'''


def test_workers_whose_parent_is_killed_while_they_start_end_too(tmp_path):
  """A trainer killed by kill -9 while its input workers were still starting (a second or more on a
  TPU host) left them waiting on their queue for ever, and multiprocessing's resource tracker with
  them: they now see that their parent is gone and end."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  import psutil  # pylint: disable=g-import-not-at-top

  def command(process) -> str:
    try:
      return ' '.join(process.cmdline())
    except psutil.Error as e:
      return type(e).__name__

  def running(process) -> bool:  # a zombie has ended (nobody reaped it yet)
    try:
      return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
      return False

  script = tmp_path / 'slow_to_start.py'
  script.write_text(_SLOW_TO_START)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  parent = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE)
  deadline, starting = time.time() + 60, []
  while len(starting) < 2 and time.time() < deadline:  # both workers made, asleep before their start
    children = psutil.Process(parent.pid).children(recursive=True)
    starting = [child for child in children if 'spawn_main' in command(child)]
    time.sleep(0.01)
  assert len(starting) == 2
  parent.kill()
  parent.wait()
  _, alive = psutil.wait_procs(children, timeout=15)
  alive = [process for process in alive if running(process)]
  for process in alive:
    process.kill()
  assert not alive, [command(process) for process in alive]
