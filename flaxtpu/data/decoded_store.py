"""Decoded splits on local disk (`dataset.decoded_cache_dir`): a split of image files decoded into
memory once is written there, and the next run that decodes the same files with the same settings
reads it back instead (CIFAR-10's 50,000 JPEGs: one file of 150 MiB).

The key is a hash of every file's path, size and modification time and of the decode settings,
so a changed, added or removed file (or another image size) misses and decodes afresh. A stored
file is an uncompressed `.npz`: zip checks each member's CRC-32 as it is read, so a truncated or
corrupt file is noticed, reported in one line, deleted and rebuilt, never trusted. Files are
written under a temporary name and renamed, so a run stopped mid-write leaves no half file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile

import cv2
import numpy as np
import simplejpeg

from flaxtpu.data import file_stats
from flaxtpu.data.sources.base import Split
from flaxtpu.data.sources.folder import FileRecords
from flaxtpu.io import storage

FORMAT = 1  # bump when what a stored file holds, or how an image is decoded, changes
UNUSED_DAYS = 30  # a stored split no run has read for this long is deleted (a dataset since edited)
STAT_THREADS = 32  # stat() waits on the file system: on a gVisor sandbox 32 threads took half the time of one


@dataclasses.dataclass
class DecodedChunk:
  """Consecutive images of a split decoded: their pixels one after another, each image's shape
  ((0, 0, 0) where it failed), what is wrong with the failed ones (by position in the chunk), and
  the labels the records gave (only where the split does not list them)."""
  pixels: np.ndarray
  shapes: np.ndarray
  failures: dict[int, str]
  labels: list

  @property
  def count(self) -> int:
    return len(self.shapes)


@dataclasses.dataclass
class Decoded(DecodedChunk):
  """A whole split decoded (`DecodedChunk`s joined): image i is `pixels[offsets[i]:offsets[i+1]]`."""

  @classmethod
  def joined(cls, chunks: list[DecodedChunk], starts) -> 'Decoded':
    pixels = np.concatenate([chunk.pixels for chunk in chunks]) if chunks else np.zeros(0, np.uint8)
    shapes = np.concatenate([chunk.shapes for chunk in chunks]) if chunks else np.zeros((0, 3), np.int32)
    failures = {start + i: message for start, chunk in zip(starts, chunks)
                for i, message in chunk.failures.items()}
    return cls(pixels, shapes, failures, [label for chunk in chunks for label in chunk.labels])

  def images(self, keep: np.ndarray) -> list[np.ndarray]:
    """The images at positions `keep`, as views of `pixels` (no copy)."""
    offsets = np.concatenate([[0], np.cumsum(np.prod(self.shapes, axis=1, dtype=np.int64))])
    return [self.pixels[offsets[i]:offsets[i + 1]].reshape(self.shapes[i]) for i in keep]

  def stacked(self, keep: np.ndarray) -> np.ndarray:
    """The images at `keep` (all of one shape) as one uint8 [N, H, W, C] array; a view of `pixels`
    when nothing failed."""
    if len(keep) == len(self.shapes) and len(keep):
      return self.pixels.reshape(len(keep), *self.shapes[0])
    return np.stack(self.images(keep)) if len(keep) else np.zeros((0, 1, 1, 1), np.uint8)


def key(split: Split, channels: int, side: int, threads: int = STAT_THREADS) -> str | None:
  """The store key of `split` decoded with these settings; None for splits it does not keep (not
  local image files, or labels that only the records give)."""
  records = split.records
  if not isinstance(records, FileRecords) or split.labels is None or storage.is_remote(records.root):
    return None
  root = os.fsencode(os.path.realpath(records.root))
  paths = [os.path.join(root, os.fsencode(path)) for path in records.paths]
  digest = hashlib.sha256(f'{FORMAT} {channels} {side} simplejpeg {simplejpeg.__version__} '
                          f'opencv {cv2.__version__}\n'.encode())
  digest.update(stat_lines(paths, max(1, min(threads, STAT_THREADS))))
  return digest.hexdigest()[:32]


def stat_lines(paths: list[bytes], threads: int) -> bytes:
  """`file_stats.lines` of `paths`, from a child process: in this one, its threads waited for the GIL
  after every stat() while the main thread imported JAX and the trainer (CIFAR-10's 60,000 files: 9.7
  s on a TPU v5e host, 3.4 s without the imports). Where no child can run, in this process."""
  if not paths:
    return b''
  if sys.executable:  # empty or None where the interpreter cannot tell
    try:  # in its own session: a Ctrl-C at the terminal asks the run to stop cleanly, not the child
      return subprocess.run([sys.executable, '-I', '-S', file_stats.__file__, str(threads)],
                            input=b'\0'.join(paths), capture_output=True, check=True,
                            start_new_session=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
      logging.debug('stat() in a child process failed (%s); in this one instead',
                    getattr(e, 'stderr', b'').decode(errors='replace').strip()[-300:] or e)
  return file_stats.lines(paths, threads)


def folder(store: str) -> str:
  """`dataset.decoded_cache_dir`, where '' is the user's cache folder ($XDG_CACHE_HOME or ~/.cache)
  /flaxtpu/decoded."""
  if store:
    return os.path.expanduser(store)
  user_cache = os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache')
  return os.path.join(user_cache, 'flaxtpu', 'decoded')


def path_of(store: str, split_key: str) -> str:
  return os.path.join(folder(store), f'{split_key}.npz')


def load(store: str, split_key: str, count: int, channels: int = 0, side: int = 0) -> Decoded | None:
  """The decoded split stored under `split_key`, or None when there is none or it is unreadable or
  does not hold what this split decodes to (then deleted, saying so in one line)."""
  path = path_of(store, split_key)
  if not os.path.exists(path):
    return None
  try:
    identity = _identity(path)
    with np.load(path, allow_pickle=False) as stored:  # every member read whole: its CRC is checked
      pixels, shapes = stored['pixels'], stored['shapes']
      positions, messages = stored['failure_positions'], stored['failure_messages']
    _check_stored(pixels, shapes, positions, messages, count, channels, side)
  except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
    reason = ' '.join(str(e).split()) or type(e).__name__
    logging.warning('decoded cache %s is unreadable (%s); decoding the images again and rewriting it',
                    path, reason)
    if _identity(path) == identity:  # not a file another run has written there meanwhile
      _remove(path)
    return None
  _touch(path)
  logging.info('read %d decoded images from %s (dataset.decoded_cache_dir)', count, path)
  return Decoded(pixels, shapes, dict(zip(positions.tolist(), messages.tolist())), [])


def _identity(path: str) -> tuple | None:
  try:
    stat = os.stat(path)
  except OSError:
    return None
  return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _check_stored(pixels: np.ndarray, shapes: np.ndarray, positions: np.ndarray, messages: np.ndarray,
                  count: int, channels: int, side: int) -> None:
  """Raises ValueError unless the stored arrays are a split of `count` images decoded as this run
  decodes them: uint8 pixels, one (height, width, channels) row per image, (0, 0, 0) exactly where a
  failure is listed, the shorter side at most `side` (where given), and every pixel accounted for.

  A file that passed zip's CRC can still be another's (copied over, or edited): trained on, its wrong
  shapes would cut the pixels into other images with no error anywhere."""
  if pixels.dtype != np.uint8 or pixels.ndim != 1:
    raise ValueError(f'its pixels are {pixels.dtype} of {pixels.ndim} dimensions, not a flat uint8 array')
  if not np.issubdtype(shapes.dtype, np.integer) or shapes.shape != (count, 3):
    raise ValueError(f'it holds image shapes of {tuple(shapes.shape)}, not the ({count}, 3) of the {count} '
                     'images listed')
  if (not np.issubdtype(positions.dtype, np.integer) or positions.ndim != 1
      or positions.shape != messages.shape or messages.dtype.kind != 'U'):
    raise ValueError('its list of failed images is malformed')
  failed = np.zeros(count, bool)
  if len(positions):
    if positions.min() < 0 or positions.max() >= count or len(np.unique(positions)) != len(positions):
      raise ValueError(f'it lists failed images outside the {count} listed')
    failed[positions] = True
  if np.any(shapes[failed] != 0):
    raise ValueError('it gives pixels to images it lists as failed')
  decoded = shapes[~failed]
  if np.any(decoded <= 0) or (channels and np.any(decoded[:, 2] != channels)):
    raise ValueError(f'its image shapes are not those of {channels or "any"}-channel images')
  if side and len(decoded) and decoded[:, :2].min(axis=1).max() > side:
    raise ValueError(f'it holds images larger than the {side}-pixel shorter side this run decodes to')
  if pixels.size != int(np.prod(shapes, axis=1, dtype=np.int64).sum()):
    raise ValueError(f'it holds {len(shapes)} images of {pixels.size} bytes, not the {count} listed')


def save(store: str, split_key: str, decoded: Decoded) -> None:
  """Writes `decoded` under `split_key`, atomically; a store that cannot be written is skipped
  with a warning (the run goes on, decoding again next time)."""
  path = path_of(store, split_key)
  temporary = ''
  positions = np.array(sorted(decoded.failures), np.int64)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # A name of its own: runs sharing the store (another host's pid may equal this one's) never write
    # into each other's file; the last rename wins, and each renamed file is whole.
    with tempfile.NamedTemporaryFile('wb', dir=os.path.dirname(path), prefix=f'{split_key}.npz.tmp-',
                                     delete=False) as f:
      temporary = f.name
      np.savez(f, pixels=decoded.pixels, shapes=decoded.shapes, failure_positions=positions,
               failure_messages=np.array([decoded.failures[i] for i in positions.tolist()], dtype=str))
    os.replace(temporary, path)
  except OSError as e:
    folder_of = os.path.dirname(path)
    is_file = os.path.exists(folder_of) and not os.path.isdir(folder_of)
    logging.warning('cannot keep the decoded images in %s (%s); set --config.dataset.decoded_cache_dir to a '
                    'writable folder, or none', folder_of if is_file else path,
                    'it is a file, not a folder' if is_file else e.strerror or e)
    if temporary:
      _remove(temporary)
    return
  logging.info('kept the decoded images in %s for the next run (dataset.decoded_cache_dir)', path)
  _remove_unused(os.path.dirname(path))


def _touch(path: str) -> None:
  """Marks a stored split as used now (its mtime: access times are often not kept)."""
  try:
    os.utime(path)
  except OSError:
    pass


def _remove_unused(store: str, now: float | None = None) -> None:
  """Deletes stored splits no run has read for UNUSED_DAYS, and temporary files a killed run left
  (a day old), so the folder does not grow with every edit of a dataset."""
  now = time.time() if now is None else now
  for name in os.listdir(store):
    path = os.path.join(store, name)
    try:
      age_days = (now - os.path.getmtime(path)) / 86400 if os.path.isfile(path) else 0
    except OSError:  # renamed or removed meanwhile by another run sharing the folder
      continue
    if (name.endswith('.npz') and age_days > UNUSED_DAYS) or ('.npz.tmp-' in name and age_days > 1):
      logging.info('removing %s: no run has read it for %.0f days (dataset.decoded_cache_dir)', path,
                   age_days)
      _remove(path)


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except OSError:
    pass
