"""SIGTERM and Ctrl-C become a request to stop at the next safe point, not a lost run; a lost workdir
lease (flaxtpu.io.lock), a request to stop there without saving.

JAX-free, so the CLI can install it before JAX starts: a preemption during
start-up, data loading, compilation or the final writes is honoured like one
during the loop.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from flaxtpu.settings.errors import UserError


class StopRequest:
  """While active, the first SIGTERM/SIGINT is recorded; the trainer saves and exits 0.

  A second Ctrl-C raises KeyboardInterrupt: the user asked twice, so stop now.
  """

  def __init__(self):
    self.signal_name: str | None = None
    self.abort_reason: str | None = None  # set from another thread: stop without saving, as an error
    self.reported = False  # the CLI printed the abort's error line
    self._previous: dict = {}
    self._watchdog: threading.Timer | None = None

  def __enter__(self) -> 'StopRequest':
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    _listening.append(self)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
    if self in _listening:
      _listening.remove(self)

  @property
  def active(self) -> bool:
    return bool(self._previous)

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if self.signal_name is None:
      logging.warning('%s received: stopping at the next safe point, after saving '
                      '(press Ctrl-C again to stop at once)', signal.Signals(signum).name)
    self.signal_name = signal.Signals(signum).name

  def abort(self, reason: str) -> None:
    """Asks the trainer to stop at its next step without saving, and to fail with `reason` (one line):
    what it would save no longer belongs to it (a lease lost to another trainer)."""
    self.abort_reason = self.abort_reason or reason
    if self._watchdog is None:
      self._watchdog = threading.Timer(abort_grace_s(), self._give_up)
      self._watchdog.daemon = True
      self._watchdog.start()

  def _give_up(self) -> None:
    """The trainer has not stopped within the grace period of an abort: it is blocked on a store that
    no longer answers (a hung connection, in a save or a write). Nothing it could still write is its
    own, so the process ends here, with the abort's error line."""
    if not self.reported:
      print(f'error: {self.abort_reason}', file=sys.stderr, flush=True)
    os._exit(2)  # pylint: disable=protected-access

  def raise_if_aborted(self) -> None:
    if self.abort_reason is not None:
      raise UserError(self.abort_reason)


_listening: list[StopRequest] = []  # the requests whose handlers are installed (the CLI's one)


def requested() -> bool:
  """Whether a listening StopRequest got its SIGTERM or Ctrl-C: for work before the loop that takes long
  and has no request of its own to ask (the time budget's probe)."""
  return any(request.signal_name is not None for request in _listening)


def abort_grace_s() -> float:
  """How long an aborted trainer may take to stop on its own (FLAXTPU_ABORT_GRACE_S)."""
  return float(os.environ.get('FLAXTPU_ABORT_GRACE_S', '60'))
