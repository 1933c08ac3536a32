"""One live trainer per workdir: an exclusive lock on WORKDIR/train.lock (and one sweep per sweep
directory: the same lock on DIR/sweep.lock, `file` and `who` naming it).

The lock is an `flock` held for the whole run, so the kernel releases it when
the process ends in any way (kill -9 included): a dead run never blocks the
next one. The file names the holder (pid, host, start time) for the refusal.
Evaluating a live run's checkpoints takes no lock.

An object store (gs://, s3://) has no flock: there the lock is a lease, the
object WORKDIR/train.lock written only if it is absent or expired (a
conditional write, through TensorStore's kvstore) and renewed while the run
lives. Nothing releases it when a process is killed: a kill -9'd run's lease
blocks the workdir until it expires (LEASE_SECONDS after its last renewal),
and the refusal says how long that is. A lease this run no longer holds (another
trainer took it over, or it could not be renewed before it expired) is reported
to `on_lost`: the trainer stops at its next step without saving.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from flaxtpu.io import files, storage
from flaxtpu.settings.errors import UserError

LOCK_FILE = 'train.lock'
# A lease not renewed for this long belongs to a dead run. Renewed every third of it, so a slow store
# (or a long checkpoint save, which does not block the renewing thread) misses two renewals before then.
LEASE_SECONDS = float(os.environ.get('FLAXTPU_LEASE_SECONDS', 120))


class WorkdirBusy(UserError):
  """Another live process trains into this workdir."""


class WorkdirLock:
  """`with WorkdirLock(workdir):` trains alone in `workdir`, or raises WorkdirBusy naming the holder."""

  def __new__(cls, workdir: str, *args, **kwargs):
    if cls is WorkdirLock and storage.is_remote(workdir):
      return WorkdirLease(workdir, *args, **kwargs)
    return super().__new__(cls)

  def __init__(self, workdir: str, on_lost: Optional[Callable[[str], None]] = None, file: str = LOCK_FILE,
               who: str = 'trainer'):
    del on_lost  # an flock is held until the process ends: it cannot be lost
    self.path = os.path.join(workdir, file)
    self.who = who
    self._fd = None

  def __enter__(self) -> 'WorkdirLock':
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a folder in its place, a file this user may not write
      raise WorkdirBusy(f'{self.path} cannot be opened as the {self.who}\'s lock file ({e.strerror}); move '
                        'it aside, then run the same command again') from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        holder = _describe(os.pread(fd, 4096, 0))
        os.close(fd)
        raise WorkdirBusy(f'--workdir={os.path.dirname(self.path)} is in use by a live {self.who} '
                          f'({holder}); wait for it to finish, stop it, or use another --workdir') from None
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


class WorkdirLease(WorkdirLock):
  """WorkdirLock on an object store: WORKDIR/train.lock is a lease object (holder's pid, host, start
  and renewal times), written only where the generation read before is still the one stored, so of
  two trainers racing for it one wins. Renewed by a thread every LEASE_SECONDS / 3; deleted on exit.

  Each renewal first reads the lease back: another holder's content (or none) means it was taken over.
  (The conditional write alone would say so on GCS, but not on an emulator that ignores it.) A lease
  taken over, or not renewed for 2/3 of its life (the store kept failing), is lost: `on_lost(message)`
  is called once, from the renewing thread, and renewing stops.
  """

  def __init__(self, workdir: str, seconds: float | None = None,  # pylint: disable=super-init-not-called
               on_lost: Optional[Callable[[str], None]] = None, file: str = LOCK_FILE, who: str = 'trainer'):
    self.path = os.path.join(workdir, file)
    self.who = who
    self.seconds = LEASE_SECONDS if seconds is None else seconds
    self.on_lost = on_lost
    self.lost: Optional[str] = None
    self._store = None
    self._generation = None
    self._written = b''  # the lease as this run last wrote it
    self._renewed = 0.0
    self._holder = {'pid': os.getpid(), 'host': socket.gethostname(),
                    'started': time.strftime('%Y-%m-%d %H:%M:%S')}
    self._stopped = threading.Event()
    self._renewer = None
    # A store that stops answering (a hung connection) must fail a renewal, not block it for ever.
    self._timeout_s = max(self.seconds / 3, 1.0)

  def __enter__(self) -> 'WorkdirLease':
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    self._store = ts.KvStore.open(self.path).result()
    current = self._store.read('').result(timeout=self._timeout_s)
    if current.state == 'value':
      holder = _lease_holder(current.value) or {'renewed': 0.0}  # unreadable: expired
      age, limit = time.time() - holder['renewed'], holder.get('seconds', self.seconds)
      if age < limit:
        wait = limit - age
        raise WorkdirBusy(f'--workdir={os.path.dirname(self.path)} is leased by a {self.who} '
                          f'({_describe(current.value)}, renewed {age:.0f} s ago); if it was killed, '
                          f'its lease expires in {wait:.0f} s: run again then, or delete {self.path} to '
                          'take over now; else use another --workdir')
      logging.warning('taking over %s: its holder (%s) has not renewed it for %.0f s', self.path,
                      _describe(current.value), age)
    if not self._write(current.stamp.generation):
      holder = _describe(self._store.read('').result(timeout=self._timeout_s).value)
      raise WorkdirBusy(f'--workdir={os.path.dirname(self.path)} was leased by another {self.who} at the '
                        f'same moment ({holder}); use another --workdir')
    self._renewer = threading.Thread(target=self._renew, name='flaxtpu-lease', daemon=True)
    self._renewer.start()
    return self

  def _write(self, generation) -> bool:
    """Writes the lease where `generation` is still the stored one; whether it was written."""
    renewed = time.time()
    payload = json.dumps({**self._holder, 'renewed': renewed, 'seconds': self.seconds}).encode()
    written = self._store.write('', payload, if_equal=generation).result(timeout=self._timeout_s)
    if not written.generation:  # TensorStore's answer to a failed condition: no generation
      return False
    self._generation, self._written, self._renewed = written.generation, payload, renewed
    return True

  def _renew(self) -> None:
    interval = self.seconds / 3
    while not self._stopped.wait(interval):
      try:
        current = self._store.read('').result(timeout=self._timeout_s)
        if current.state != 'value' or current.value != self._written or not self._write(self._generation):
          taker = (f'another trainer ({_describe(current.value)})' if current.state == 'value'
                   else 'nobody: it was deleted')
          self._lose(f'the lease {self.path} was taken over by {taker}; this run stopped without saving, '
                     'so that it never writes over that trainer\'s checkpoints; let that trainer finish, or '
                     'stop it and run this command again to resume')
          return
        interval = self.seconds / 3
      except Exception as e:  # pylint: disable=broad-except  # a store that fails now may answer later
        age = time.time() - self._renewed
        if age >= 2 * self.seconds / 3:  # another trainer may take it over once it expires
          self._lose(f'could not renew the lease {self.path} for {age:.0f} s ({files.short_error(e, 200)}); '
                     f'it expires after {self.seconds:.0f} s and another trainer could then take over '
                     'the workdir, so this run stopped without saving; check the connection to the bucket '
                     'and run the same command again to resume')
          return
        logging.warning('could not renew the lease %s (%s); retrying', self.path, files.short_error(e, 200))
        interval = min(self.seconds / 3, 5.0)  # retry sooner than the usual renewal

  def _lose(self, message: str) -> None:
    self.lost, self._generation = message, None  # nothing of ours left to delete on exit
    logging.error('%s', message)
    if self.on_lost is not None:
      self.on_lost(message)

  def __exit__(self, *exc_info) -> None:
    self._stopped.set()
    if self._renewer is not None:
      self._renewer.join()
      self._renewer = None
    if self._generation is not None:
      try:
        current = self._store.read('').result(timeout=self._timeout_s)
        if current.state == 'value' and current.value == self._written:  # only our own lease
          self._store.write('', None, if_equal=self._generation).result(timeout=self._timeout_s)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning('could not release the lease %s (%s); it expires in %.0f s', self.path,
                        files.short_error(e, 200), self.seconds)
      self._generation = None


def _lease_holder(content: bytes) -> dict | None:
  try:
    holder = json.loads(content)
    return holder if isinstance(holder, dict) and isinstance(holder.get('renewed'), (int, float)) else None
  except ValueError:
    return None
