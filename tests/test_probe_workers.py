"""An outside probe of the input's worker processes (issue 70): a worker killed mid-run (kill -9, the
OOM killer). The run stops in one `error:` line that says what happened and how to resume, with no
traceback, and leaves nothing of its own in /dev/shm."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import ROOT, make_image_folder
from flaxtpu.data import shared_blocks, workers
from flaxtpu.settings.errors import UserError

DIED = ('error: an input worker process died (killed, or out of memory?); the checkpoints saved so far are '
        'kept: lower --config.input.workers or --config.input.prefetch, then run the same command to resume')


def _batch_or_death(index):
  """A 2 MiB result (it comes back through a shared-memory block); item 5 kills its worker."""
  if index == 5:
    os.kill(os.getpid(), signal.SIGKILL)
  return (np.full(2 << 20, index % 256, np.uint8), index)


def test_a_killed_worker_is_a_user_error_and_its_blocks_are_unlinked(monkeypatch):
  made = []
  make = shared_blocks.Blocks.make

  def recording(self, size):
    make(self, size)
    made.extend(block.name for block in self._all)

  monkeypatch.setattr(shared_blocks.Blocks, 'make', recording)
  with pytest.raises(workers.InputWorkerDied) as raised:
    for _ in workers.run(_batch_or_death, list(range(40)), workers=2, buffer=2):
      pass
  assert isinstance(raised.value, UserError) and f'error: {raised.value}' == DIED
  assert made and not [name for name in made if os.path.exists(os.path.join('/dev/shm', name.lstrip('/')))]


# Run first in every worker process the trainer spawns (and nowhere else): the worker dies at once, as
# one the OOM killer takes.
_KILLER = textwrap.dedent('''
    import os, signal, sys
    if '--multiprocessing-fork' in sys.argv:
      os.kill(os.getpid(), signal.SIGKILL)
''')


def test_a_killed_worker_stops_the_trainer_in_one_line(tmp_path):
  """The workers that decode the split into memory (3 chunks of 16 images at this size); streaming
  workers share the same pool code (the test above). Stopped before any step: the test stays short."""
  folder = make_image_folder(tmp_path / 'images', train_per_class=16, test_per_class=2)
  (tmp_path / 'hook').mkdir()
  (tmp_path / 'hook' / 'sitecustomize.py').write_text(_KILLER)
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(tmp_path / 'hook'), ROOT])}
  process = subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10.py', f'--workdir={tmp_path / "run"}',
       f'--config.dataset.folder={folder}', '--config.dataset.cache=memory', '--config.input.workers=2',
       '--config.dataset.image_size=1024', '--config.dataset.decoded_cache_dir=none',
       '--config.num_train_steps=10', '--config.batch_size=8', '--config.cpu_devices=1',
       '--config.compilation_cache_dir=none'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert process.returncode == 2, process.stderr[-2000:]
  assert 'Traceback' not in process.stderr
  assert [line for line in process.stderr.splitlines() if line.startswith('error')] == [DIED]


@pytest.mark.skipif(not os.path.isdir('/dev/shm'), reason='POSIX shared memory is not under /dev/shm here')
def test_blocks_a_killed_process_group_left_are_removed_by_the_next_pass(monkeypatch):
  """kill -9 of the trainer's whole group (scancel, a container's OOM kill) takes multiprocessing's
  resource tracker with it: the batches' blocks stayed in /dev/shm until a reboot. The next run's first
  pass unlinks the blocks whose maker is dead and that nobody wrote for ORPHAN_AGE_S, and only those."""
  finished = subprocess.Popen(['true'])
  finished.wait()
  dead, old = finished.pid, time.time() - shared_blocks.ORPHAN_AGE_S - 60
  names = {'orphan': f'flaxtpu_{dead}_0badc0de', 'recent': f'flaxtpu_{dead}_0badc0df',
           'live maker': f'flaxtpu_{os.getpid()}_0badc0e0', 'not ours': f'psm_probe_{dead}'}
  for what, name in names.items():
    with open(os.path.join('/dev/shm', name), 'wb') as f:
      f.write(b'\0' * 4096)
    if what != 'recent':
      os.utime(os.path.join('/dev/shm', name), (old, old))
  monkeypatch.setattr(shared_blocks, '_orphans_removed', False)
  try:
    for _ in workers.run(_batch_or_death, list(range(6, 12)), workers=2, buffer=2):
      pass
    left = {what for what, name in names.items() if os.path.exists(os.path.join('/dev/shm', name))}
    assert left == {'recent', 'live maker', 'not ours'}
  finally:
    for name in names.values():
      if os.path.exists(os.path.join('/dev/shm', name)):
        os.unlink(os.path.join('/dev/shm', name))
