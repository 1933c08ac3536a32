"""One live trainer per workdir: an exclusive lock on WORKDIR/train.lock.

The lock is an `flock` held for the whole run, so the kernel releases it when
the process ends in any way (kill -9 included): a dead run never blocks the
next one. The file names the holder (pid, host, start time) for the refusal.
Evaluating a live run's checkpoints takes no lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time

from flaxtpu.errors import UserError

LOCK_FILE = 'train.lock'


class WorkdirBusy(UserError):
  """Another live process trains into this workdir."""


class WorkdirLock:
  """`with WorkdirLock(workdir):` trains alone in `workdir`, or raises WorkdirBusy naming the holder."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd = None

  def __enter__(self) -> 'WorkdirLock':
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        holder = _describe(os.pread(fd, 4096, 0))
        os.close(fd)
        raise WorkdirBusy(f'--workdir={os.path.dirname(self.path)} is in use by a live trainer ({holder}); '
                          'wait for it to finish, stop it, or use another --workdir') from None
      # Some network filesystems have no flock: train, but nothing guards the workdir.
      logging.warning('cannot lock %s (%s); make sure no other trainer uses this workdir', self.path,
                      e.strerror)
      os.close(fd)
      return self
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(),
                              'started': time.strftime('%Y-%m-%d %H:%M:%S')}).encode(), 0)
    self._fd = fd
    return self

  def __exit__(self, *exc_info) -> None:
    if self._fd is not None:
      os.close(self._fd)  # releases the flock; the file stays, naming the last holder
      self._fd = None


def _describe(content: bytes) -> str:
  try:
    holder = json.loads(content)
    return f'pid {holder["pid"]} on host {holder["host"]}, started {holder["started"]}'
  except (ValueError, KeyError, TypeError):
    return 'a process that has not written its pid yet'
