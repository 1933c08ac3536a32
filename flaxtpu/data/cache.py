"""The decoded-split cache (`dataset.cache`): whether the splits fit a small share of host memory,
and decoding them once into it, in worker processes, each file checked as it decodes."""

from __future__ import annotations

import logging
import os

import numpy as np

from flaxtpu.data import preprocess, workers
from flaxtpu.data.dataset import Examples, image_shape, label_batch
from flaxtpu.data.preprocess import Transform
from flaxtpu.data.sources.base import Split, unreadable, without_unreadable
from flaxtpu.errors import ConfigError

# The decoded splits may take this share of host memory before `dataset.cache=auto` streams.
CACHE_MEMORY_FRACTION = 1 / 8
CACHE_MAX_BYTES = 4 * 2**30
CACHE_CHUNK = 500  # images per cache-decoding task: a hand-over to a worker costs several small decodes


def use_cache(cache: str, count: int, image_shape: tuple[int, int, int], transform: Transform) -> bool:
  """Whether the splits are decoded into memory: `auto` when they fit a share of it; `memory` forced,
  estimated first and refused (one line with the numbers) when they cannot fit what is available."""
  side = cache_side(transform) or max(image_shape[:2])
  needed = count * side * side * image_shape[2]  # at least: a cached image keeps its shorter side
  if cache == 'memory':
    from flaxtpu import memory  # pylint: disable=g-import-not-at-top  # memory reads the spec module
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


def examples(split: Split, *, cache: bool, transform: Transform, num_workers: int,
              skip_corrupt: bool) -> Examples:
  """The split to stream, or decoded into memory (where every file is checked as it decodes)."""
  if not cache:
    return Examples(source=split)
  logging.info('decoding %d images of %r into memory (dataset.cache)', len(split), split.name)
  chunks = range(-(-len(split) // CACHE_CHUNK))
  chunk_results = workers.run(_CacheDecoder(split, transform), chunks, num_workers, buffer=8,
                              min_items_per_worker=2)
  chunk_results = workers.with_progress(chunk_results, len(split), f'decoding {split.name!r}')
  decoded = [example for chunk in chunk_results for example in chunk]
  _, keep = without_unreadable(
      split, [image if isinstance(image, str) else None for image, _ in decoded], skip_corrupt)
  images = [decoded[i][0] for i in keep]
  # A split that lists its labels keeps their array (and dtype); TFDS records said them as they decoded.
  labels = split.labels[keep] if split.labels is not None else label_batch([decoded[i][1] for i in keep])
  if not transform.size:  # native size: the sampled headers may have missed an odd one
    image_shape({image.shape[:2] for image in images}, transform, transform.channels)
    images = np.stack(images)
  return Examples(images=images, labels=labels,
                  groups=None if split.groups is None else split.groups[keep])


class _CacheDecoder:
  """A chunk of indices -> (image as the cache keeps it, or what is wrong with its file; label).

  The cache keeps the native size, or the shorter side at the eval resize.
  """

  def __init__(self, split: Split, transform: Transform):
    self.split, self.transform = split, transform

  def __call__(self, chunk: int) -> list:
    examples = []
    for index in range(chunk * CACHE_CHUNK, min((chunk + 1) * CACHE_CHUNK, len(self.split))):
      label = None  # a record that gives no image (a null parquet cell) is unreadable like a bad file
      try:
        item, label = self.split.load(index)
        examples.append((self._cacheable(preprocess.open_image(item)), label))
      except Exception as e:  # pylint: disable=broad-except
        examples.append((unreadable(self.split.describe(index), e), label))
    return examples

  def _cacheable(self, image):
    from PIL import Image  # pylint: disable=g-import-not-at-top
    channels, side = self.transform.channels, cache_side(self.transform)
    if not side:
      return preprocess.to_array(preprocess.decode(image, channels), channels)
    width, height = preprocess.upright_size(image)
    scale = side / min(width, height)
    target = (max(1, round(width * scale)), max(1, round(height * scale)))
    decoded = preprocess.decode(image, channels, target if scale < 1 else None)
    if scale < 1:
      decoded = decoded.resize(target, Image.BILINEAR, reducing_gap=None)
    return preprocess.to_array(decoded, channels)
