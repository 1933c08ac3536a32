"""The decoded-split cache (`dataset.cache`): whether the splits fit a small share of host memory,
and decoding them once into it, in worker processes, each file checked as it decodes; kept on
local disk for the next run (`dataset.decoded_cache_dir`, `decoded_store.py`)."""

from __future__ import annotations

import logging
import os

import numpy as np

from flaxtpu.data import decoded_store, preprocess, workers
from flaxtpu.data.dataset import Examples, image_shape, label_batch
from flaxtpu.data.decoded_store import Decoded, DecodedChunk
from flaxtpu.data.preprocess import Transform
from flaxtpu.data.sources.base import Split, unreadable, without_unreadable
from flaxtpu.settings.errors import ConfigError

# The decoded splits may take this share of host memory before `dataset.cache=auto` streams.
CACHE_MEMORY_FRACTION = 1 / 8
CACHE_MAX_BYTES = 4 * 2**30
CACHE_CHUNK = 500  # images per decoding task at most: a hand-over to a worker costs several small decodes
CHUNK_BYTES = 32 * 2**20  # ... and pixels per task at most, which come back through a pipe


def use_cache(cache: str, count: int, image_shape: tuple[int, int, int], transform: Transform) -> bool:
  """Whether the splits are decoded into memory: `auto` when they fit a share of it; `memory` forced,
  estimated first and refused (one line with the numbers) when they cannot fit what is available."""
  side = cache_side(transform) or max(image_shape[:2])
  needed = count * side * side * image_shape[2]  # at least: a cached image keeps its shorter side
  if cache == 'memory':
    from flaxtpu.data import memory  # pylint: disable=g-import-not-at-top  # memory reads the spec module
    if needed > (available := memory.available_bytes()):
      raise ConfigError(
          f'config.dataset.cache=memory cannot fit: the {count} images decode to about '
          f'{memory.format_bytes(needed)} ({side}x{side}x{image_shape[2]} uint8 each at least), more than '
          f'the {memory.format_bytes(available)} of host memory available; set --config.dataset.cache=auto '
          '(or none) to stream them from disk, or lower config.dataset.image_size')
    return True
  if cache != 'auto':
    return False
  budget = min(_host_memory_bytes() * CACHE_MEMORY_FRACTION, CACHE_MAX_BYTES)
  return needed <= budget


def _host_memory_bytes() -> int:
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return 8 * 2**30


def cache_side(transform: Transform) -> int:
  """Cached images keep their shorter side at the eval resize: enough pixels for every crop."""
  return int(np.ceil(transform.size / transform.crop_fraction)) if transform.size else 0


def examples(split: Split, *, cache: bool, transform: Transform, num_workers: int, skip_corrupt: bool,
             threads: bool = False, store: str = 'none') -> Examples:
  """The split to stream, or decoded into memory (where every file is checked as it decodes).

  A split of local files decoded once is kept in `store` (a folder; `decoded_store.py`), and read
  back from there while its files and the decode settings stay the same.
  """
  if not cache:
    return Examples(source=split)
  channels, side = transform.channels, cache_side(transform)
  key = decoded_store.key(split, channels, side, num_workers) if store != 'none' else None
  decoded = decoded_store.load(store, key, len(split), channels, side) if key else None
  if decoded is None:
    decoded = _decode(split, channels, side, num_workers, threads)
    if key:
      decoded_store.save(store, key, decoded)
  _, keep = without_unreadable(split, [decoded.failures.get(i) for i in range(len(split))], skip_corrupt)
  # A split that lists its labels keeps their array (and dtype); TFDS records said them as they decoded.
  labels = split.labels[keep] if split.labels is not None else label_batch([decoded.labels[i] for i in keep])
  if transform.size:
    images = decoded.images(keep)
  else:  # native size: the sampled headers may have missed an odd one
    image_shape({tuple(shape[:2]) for shape in decoded.shapes[keep].tolist()}, transform, channels)
    images = decoded.stacked(keep)
  return Examples(images=images, labels=labels, groups=None if split.groups is None else split.groups[keep])


def _decode(split: Split, channels: int, side: int, num_workers: int, threads: bool) -> Decoded:
  """Every image of `split` decoded (`preprocess.shorter_side_at_most`), chunk by chunk in
  `num_workers` processes (threads with `threads`), each chunk's pixels packed in one array."""
  per_chunk = int(np.clip(CHUNK_BYTES // (max(side, 32) ** 2 * channels * 2), 16, CACHE_CHUNK))
  starts = range(0, len(split), per_chunk)
  count = min(num_workers, len(starts))
  logging.info('decoding %d images of %r into memory (dataset.cache) %s', len(split), split.name,
               f'in {count} {"threads" if threads else "processes"}' if count > 1 else 'in this process')
  tasks = [(split.subset(np.arange(start, min(start + per_chunk, len(split)))), channels, side,
            split.labels is None) for start in starts]
  chunks = workers.pool_map(_decode_chunk, tasks, num_workers, threads)
  chunks = workers.with_progress(chunks, len(split), f'decoding {split.name!r}',
                                 size=lambda chunk: chunk.count)
  return Decoded.joined(list(chunks), starts)


def _decode_chunk(task: tuple[Split, int, int, bool]) -> DecodedChunk:
  """One chunk of a split, decoded: its pixels packed, each image's shape, what failed and why."""
  split, channels, side, keep_labels = task
  images, shapes, failures, labels = [], np.zeros((len(split), 3), np.int32), {}, []
  for index in range(len(split)):
    label = None  # a record that gives no image (a null parquet cell) is unreadable like a bad file
    try:
      item, label = split.load(index)
      image = preprocess.shorter_side_at_most(item, channels, side)
      images.append(image.reshape(-1))
      shapes[index] = image.shape
    except Exception as e:  # pylint: disable=broad-except
      failures[index] = unreadable(split.describe(index), e)
    if keep_labels:
      labels.append(label)
  pixels = np.concatenate(images) if images else np.zeros(0, np.uint8)
  return DecodedChunk(pixels, shapes, failures, labels)
