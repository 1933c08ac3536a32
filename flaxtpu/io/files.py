"""The files a run and a sweep leave behind: atomic JSON, metrics.jsonl rows, durations; failed writes
(a full disk, a read-only workdir) as one line.

Every helper takes a local path or an object-store one (gs://, s3://): local paths go through `os`
exactly as before, remote ones through `etils.epath` (an object write is atomic by itself, so no
temporary file is renamed there). JAX-free: the sweep runner and the CLI use it before (or without)
starting JAX.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import errno
import json
import logging
import os
import shutil
import tempfile
import threading
from typing import Any, Iterator, Mapping, Optional

from flaxtpu.io.storage import is_remote
from flaxtpu.settings.errors import UserError

# Failures of the storage rather than of flaxtpu, by errno and by the words TensorStore and orbax wrap
# them in (their messages carry a spec of ~2,000 characters around the OSError's text).
STORAGE_ERRORS = {code: os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                                        errno.EACCES, errno.EPERM)}
_STORAGE_TEXTS = {**{text.lower(): text for text in STORAGE_ERRORS.values()},
                  f"os_error_code='{errno.ENOSPC}'": STORAGE_ERRORS[errno.ENOSPC]}

# A path named by the user that cannot be written as a file (`writing`).
PATH_ERRORS = {errno.ENOENT: 'its folder {folder} does not exist', errno.EISDIR: 'it is a folder',
               errno.ENOTDIR: 'a part of {folder} is a file, not a folder'}


def _epath(path: str):
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(path)


def join(directory: str, *names: str) -> str:
  """os.path.join, which also joins gs://bucket/run and a name correctly."""
  return os.path.join(directory, *names)


def absolute(path: str) -> str:
  """os.path.abspath for a local path; a remote path is absolute already (abspath would mangle it)."""
  return path if is_remote(path) else os.path.abspath(path)


def exists(path: str) -> bool:
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
  return _epath(path).is_file() if is_remote(path) else os.path.isfile(path)


def listdir(path: str) -> list[str]:
  """The names in directory `path` (OSError when it is missing)."""
  if not is_remote(path):
    return os.listdir(path)
  directory = _epath(path)
  if not directory.is_dir():
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
  return [child.name for child in directory.iterdir()]


def python_files(folder: str) -> str:
  """The recipes or experiment files in a local `folder` (its *.py but `_*`), as paths joined by
  commas, or 'none': what an error line about a wrong file offers instead."""
  found = sorted(name for name in os.listdir(folder) if name.endswith('.py') and not name.startswith('_')) \
      if os.path.isdir(folder) else []
  return ', '.join(os.path.join(folder, name) for name in found) or 'none'


def makedirs(path: str) -> None:
  """Creates directory `path` and its parents (an object store needs none: a no-op beyond a check)."""
  if is_remote(path):
    _epath(path).mkdir(parents=True, exist_ok=True)
  else:
    os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
  if is_remote(path):
    _epath(path).unlink()
  else:
    os.remove(path)


def rename(source: str, target: str) -> None:
  """os.replace; on an object store a copy and a delete (files and directories alike)."""
  if is_remote(source):
    _epath(source).rename(target)
  else:
    os.replace(source, target)


def open_file(path: str, mode: str = 'r', **kwargs):
  """`open` for a local path, epath's open for a remote one (text modes read UTF-8)."""
  if not is_remote(path):
    return open(path, mode, **kwargs)  # pylint: disable=unspecified-encoding
  return _epath(path).open(mode, **({} if 'b' in mode else {'encoding': kwargs.get('encoding', 'utf-8')}))


def upload(local_path: str, path: str) -> None:
  """Copies the local file `local_path` to `path` (any store), whole."""
  if is_remote(path):
    data = open_bytes(local_path)
    within_deadline(lambda: _epath(path).write_bytes(data), f'writing {path}')
  else:
    os.replace(local_path, path)


def store_timeout_s() -> float:
  """How long one write to an object store may take before it counts as failed (FLAXTPU_STORE_TIMEOUT_S)."""
  return float(os.environ.get('FLAXTPU_STORE_TIMEOUT_S', '300'))


def within_deadline(call, what: str):
  """call(), or TimeoutError when it has not returned within store_timeout_s(): a store that stops
  answering holds its connection open, and gcsfs waits on it for ever (its retries included). The
  call goes on in a daemon thread, which the process does not wait for at exit."""
  outcome, done = {}, threading.Event()

  def run():
    try:
      outcome['value'] = call()
    except BaseException as e:  # pylint: disable=broad-except  # re-raised in the caller's thread
      outcome['error'] = e
    done.set()

  threading.Thread(target=run, name='flaxtpu-store', daemon=True).start()
  if not done.wait(store_timeout_s()):
    raise TimeoutError(f'{what}: the store did not answer within {store_timeout_s():.0f} s')
  if 'error' in outcome:
    raise outcome['error']
  return outcome.get('value')


class LocalStage:
  """Directory `path` for a library that writes only local files (jax.profiler: its own GCS client
  cannot reach an emulator): `local` is `path` itself when it is local, else a temporary directory
  (made on first use) whose files `publish()` uploads under `path`, keeping their relative paths."""

  def __init__(self, path: str):
    self.path = path
    self._local = None if is_remote(path) else path

  @property
  def local(self) -> str:
    if self._local is None:
      self._local = tempfile.mkdtemp(prefix='flaxtpu-stage-')
    return self._local

  def publish(self) -> None:
    """Uploads what the local directory holds (a no-op for a local `path`), then removes it."""
    if self._local is None or self._local == self.path:
      return
    for directory, _, names in os.walk(self._local):
      for name in names:
        source = os.path.join(directory, name)
        upload(source, join(self.path, os.path.relpath(source, self._local)))
    shutil.rmtree(self._local, ignore_errors=True)
    self._local = None


def open_bytes(path: str) -> bytes:
  with open_file(path, 'rb') as f:
    return f.read()


def atomic_write(path: str, write) -> None:
  """Calls write(local temporary path) and puts the file at `path` whole: a rename on a local disk,
  one object write on a store. A crash never leaves half a file."""
  if not is_remote(path):
    temporary = f'{path}.tmp.{os.getpid()}'  # per process: a CLI run and a trainer may write one file
    try:
      write(temporary)
      os.replace(temporary, path)
    finally:
      if os.path.exists(temporary):
        os.remove(temporary)
    return
  handle, temporary = tempfile.mkstemp(prefix='flaxtpu-upload-', suffix=os.path.splitext(path)[1])
  os.close(handle)
  try:
    write(temporary)
    upload(temporary, path)
  finally:
    if os.path.exists(temporary):
      os.remove(temporary)


def storage_error(error: BaseException) -> Optional[str]:
  """The cause of a failed write in a few words when the storage refused it ('No space left on
  device', 'Read-only file system', ...), found in the exception chain or its text; else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in STORAGE_ERRORS:
      return STORAGE_ERRORS[error.errno]
    text = str(error).lower()
    for words, reason in _STORAGE_TEXTS.items():
      if words in text:
        return reason
    error = error.__cause__ or error.__context__
  return None


def short_error(error: BaseException, limit: int = 150) -> str:
  """A failure in at most `limit` characters: the storage's cause, else the error's first line, cut."""
  if (reason := storage_error(error)) is not None:
    return reason
  text = str(error).strip()
  line = f'{type(error).__name__}: {text.splitlines()[0]}' if text else type(error).__name__
  return line if len(line) <= limit else line[:limit - 3] + '...'


@contextlib.contextmanager
def writing(path: str, fix: str) -> Iterator[None]:
  """Turns a write the storage refuses, or a path that cannot be a file (its folder missing, a folder
  itself), into UserError: one line naming `path`, the cause and `fix`."""
  try:
    yield
  except OSError as e:
    reason = storage_error(e) or PATH_ERRORS.get(e.errno, '').format(folder=os.path.dirname(path) or '.')
    if not reason:
      raise
    raise UserError(f'cannot write {path}: {reason}; {fix}') from e


def unwritable(directory: str) -> Optional[str]:
  """Why files cannot be created in `directory` (made if missing), or None when they can.

  Tried, not asked: os.access says yes to root on a read-only mount's files in some setups. On an
  object store a probe object is written and deleted.
  """
  if is_remote(directory):
    probe = _epath(directory) / f'.write-test-{os.getpid()}'
    try:
      probe.write_bytes(b'')
      probe.unlink()
    except Exception as e:  # pylint: disable=broad-except  # each store's client raises its own errors
      return short_error(e)
    return None
  try:
    os.makedirs(directory, exist_ok=True)
    handle, probe = tempfile.mkstemp(dir=directory, prefix='.write-test-')
    os.close(handle)
    os.remove(probe)
  except OSError as e:
    return storage_error(e) or e.strerror or type(e).__name__
  return None


def creatable(directory: str) -> Optional[str]:
  """Why files could not be written in local directory `directory`, or None when they could; found
  without making it: a probe file is created and removed in it, or else in its nearest existing parent.
  A remote directory gives None (its store is asked when it is written)."""
  if is_remote(directory):
    return None
  path = os.path.abspath(os.path.expanduser(directory))
  while not os.path.exists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path):
    return f'{path} is a file, not a folder'
  try:
    handle, probe = tempfile.mkstemp(dir=path, prefix='.write-test-')
    os.close(handle)
    os.remove(probe)
  except OSError as e:
    # A folder that exists but takes no new files (a /proc or /sys) says ENOENT.
    return storage_error(e) or (f'{path} takes no new files' if e.errno == errno.ENOENT else
                                e.strerror or type(e).__name__)
  return None


def writable_or_elsewhere(directory: str, what: str) -> str:
  """`directory` when files can be written there, else one under the system's temporary directory
  (said in a warning): the evaluation of a run on a read-only disk, or in a bucket this user may only
  read, still leaves `what`."""
  reason = unwritable(directory)
  if reason is None:
    return directory
  name = directory.replace('://', '_', 1) if is_remote(directory) else os.path.abspath(directory)
  elsewhere = os.path.join(tempfile.gettempdir(), 'flaxtpu', name.strip(os.sep).replace(os.sep, '_'))
  if (other := unwritable(elsewhere)) is not None:
    raise UserError(f'cannot write {what}: {directory} ({reason}) and {elsewhere} ({other}) refuse '
                    'files; free disk space or copy the run to a writable directory')
  logging.warning('%s is not writable (%s): %s go to %s instead', directory, reason, what, elsewhere)
  return elsewhere


def write_csv(path: str, rows: list[dict], key: str) -> None:
  """`rows` as a CSV at `path`, through a temporary file; a refused write names config.`key`."""
  def write(temporary: str) -> None:
    with open(temporary, 'w', newline='', encoding='utf-8') as f:
      writer = csv.DictWriter(f, fieldnames=list(rows[0]))
      writer.writeheader()
      writer.writerows(rows)

  with writing(path, f'choose another --config.{key}'):
    atomic_write(path, write)


def write_json(path: str, payload: Mapping[str, Any]) -> None:
  """Writes through a temporary file and a rename, so a reader (or a crash) never sees half a file."""
  if is_remote(path):
    _epath(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + '\n')
    return
  temporary = f'{path}.tmp'
  with open(temporary, 'w', encoding='utf-8') as f:
    json.dump(payload, f, indent=2, sort_keys=True)
    f.write('\n')
  os.replace(temporary, path)


def read_json(path: str) -> dict[str, Any] | None:
  """The JSON object in `path`, or None when it is missing, unreadable (e.g. cut off by a crash) or not
  an object (a hand-edited file holding a list or a number)."""
  try:
    with open_file(path, encoding='utf-8') as f:
      loaded = json.load(f)
  except (OSError, ValueError):
    return None
  return loaded if isinstance(loaded, dict) else None


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """Every complete JSON line of `path` ([] when missing); a line cut off mid-write is skipped."""
  rows = []
  try:
    with open_file(path, encoding='utf-8') as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except ValueError:
          continue
  except OSError:
    return []
  return rows


def truncate_jsonl(path: str, last_step: int) -> None:
  """Drops metrics rows after `last_step`: a resumed run rewrites them, as if never interrupted."""
  if not exists(path):
    return
  rows = [row for row in read_jsonl(path) if row.get('step', 0) <= last_step]
  if is_remote(path):
    _epath(path).write_text(''.join(json.dumps(row) + '\n' for row in rows))
    return
  with open(f'{path}.tmp', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
  os.replace(f'{path}.tmp', path)


def format_duration(seconds: float) -> str:
  """Seconds as H:MM:SS (whole seconds), e.g. 3725.4 -> '1:02:05'."""
  return str(datetime.timedelta(seconds=int(seconds)))


def csv_path(path: str) -> str:
  """A file path as a CSV cell: valid UTF-8 (bytes that are not UTF-8 written as \\xNN) and never
  read as a spreadsheet formula (a relative path starting with =, +, - or @ gets './', the same file)."""
  text = os.fsencode(path).decode('utf-8', 'backslashreplace')
  return f'.{os.sep}{text}' if text.startswith(('=', '+', '-', '@')) else text
