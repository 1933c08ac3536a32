"""Batches: this process's rows of each step's global batch, read and decoded by the input workers
(`workers.run`), or sliced from a cached array; evaluation batches padded and masked.

Example `p` of the global batch is augmented with a generator seeded by
(seed, s, p). So a resumed run or another worker count sees exactly the
same batches, and each process reads and decodes only its own rows. Under
shuffle and balanced another process count sees the same batches too;
under shards it does not: each process owns different shards, so the
batches depend on the process count. Evaluation covers the split once, the
last batch padded and masked.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Iterator, Optional

import numpy as np

from flaxtpu.data import preprocess, samplers, sampling, shared_blocks, workers
from flaxtpu.data.dataset import Batch, Dataset, Examples, label_batch, label_of
from flaxtpu.data.preprocess import Transform
from flaxtpu.data.sampling import Sampler, process_slice
from flaxtpu.data.sources.base import DataError, unreadable

MAX_SUBSTITUTIONS = 100  # skip_corrupt: how far to look for a readable example to stand in


def train_batches(dataset: Dataset, *, seed: int, batch_size: int, first_step: int, last_step: int,
                  process_index: int = 0, process_count: int = 1,
                  alternate_flip: bool = False) -> Iterator[Batch]:
  """This process's part of the global batches for steps [first_step, last_step), in the order
  `dataset.sampling` gives (its errors raise here, before the first batch is asked for).

  With `alternate_flip` the images come mirrored as `Sampler.mirrored` says
  (the device's random flip is then off: `augment.augment_image`).
  """
  chosen = sampling.sampler(dataset, seed=seed, batch_size=batch_size, process_index=process_index,
                            process_count=process_count)
  steps = range(first_step, last_step)
  train = dataset.train
  if _sliceable(train, dataset.transform):  # CIFAR-size: slicing is all there is
    return _sliced_train_batches(train, chosen, steps, alternate_flip)
  loader = _TrainLoader(train, dataset.transform, chosen, dataset.skip_corrupt, alternate_flip)
  return _loaded_train_batches(loader, steps, 0 if train.cached else dataset.workers, dataset.prefetch,
                               dataset.worker_threads)


def _loaded_train_batches(loader: _TrainLoader, steps: range, num_workers: int,
                          prefetch: int, threads: bool = False) -> Iterator[Batch]:
  # A generator, so the workers start with the first batch asked for and stop with the last.
  images_bytes = _images_bytes(loader.sampler.local_batch_size, loader.transform)
  yield from _checked(workers.run(loader, steps, num_workers, prefetch, threads=threads,
                                  result_bytes=images_bytes))


def _sliced_train_batches(train: Examples, chosen: Sampler, steps: range,
                          alternate_flip: bool) -> Iterator[Batch]:
  mask = np.ones(chosen.local_batch_size, bool)
  for step in steps:
    indices = chosen.indices(step)
    images = train.images[indices]
    if alternate_flip:
      mirror = chosen.mirrored(step, indices)
      images[mirror] = images[mirror][:, :, ::-1]
    yield Batch(images, train.labels[indices], mask)


def eval_batches(dataset: Dataset, *, batch_size: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[Batch]:
  """Every eval example once, in order; the last global batch is padded and masked, never dropped
  (padding rows repeat example 0, its label included, whichever form the labels take)."""
  rows = process_slice(batch_size, process_index, process_count)
  examples = dataset.eval
  starts = range(0, len(examples), batch_size)
  transform = dataset.eval_preprocessing  # eval.image_size's, else the train size's
  if _sliceable(examples, transform):
    for start in starts:
      indices, mask = _eval_rows(start, batch_size, rows, len(examples))
      yield Batch(examples.images[indices], examples.labels[indices], mask)
    return
  loader = _EvalLoader(examples, transform, dataset.skip_corrupt, batch_size, rows)
  yield from _checked(workers.run(loader, starts, 0 if examples.cached else dataset.workers,
                                  dataset.prefetch, threads=dataset.worker_threads,
                                  result_bytes=_images_bytes(rows.stop - rows.start, transform)))


def eval_image(dataset: Dataset, index: int) -> np.ndarray:
  """Eval example `index` as the model sees it (uint8 HxWxC), e.g. to picture a mistake."""
  if _sliceable(dataset.eval, dataset.eval_preprocessing):
    return dataset.eval.images[index]
  image, _ = _EvalLoader(dataset.eval, dataset.eval_preprocessing, skip_corrupt=True).example(index)
  return np.zeros(dataset.eval_image_shape, np.uint8) if isinstance(image, _Failure) else image


def _sliceable(examples: Examples, transform: Transform) -> bool:
  """Cached at the size the model sees: a batch is a slice of the array, nothing to decode."""
  return examples.cached and isinstance(examples.images, np.ndarray) and not transform.size


def _eval_rows(start: int, batch_size: int, rows: slice, size: int) -> tuple[np.ndarray, np.ndarray]:
  indices = np.arange(start, start + batch_size)[rows]
  mask = indices < size
  return np.where(mask, indices, 0), mask


def _checked(batches: Iterator) -> Iterator[Batch]:
  try:
    for batch in batches:
      if isinstance(batch, _Failure):
        raise DataError(batch.message)
      yield batch
  finally:
    batches.close()  # stops the thread or the worker processes, also after an early stop



def train_sample(dataset: Dataset, count: int) -> list[np.ndarray]:
  """`count` train images spread evenly over the split, as evaluation shows them (uint8 [H, W, C]
  each).

  The same on every host and in every run: the images at fixed positions, no randomness.
  """
  train = dataset.train
  return split_images(dataset, train, np.linspace(0, len(train) - 1, min(len(train), count)).astype(int))


def split_images(dataset: Dataset, examples: Examples, positions: np.ndarray) -> list[np.ndarray]:
  """The examples of a split at `positions`, as evaluation shows them at the train size (uint8 [H, W, C]
  each)."""
  if _sliceable(examples, dataset.transform):
    return list(examples.images[positions])
  loader = _EvalLoader(examples, dataset.transform, dataset.skip_corrupt)
  images = [image for image, _ in workers.run(loader.example, positions, dataset.workers, buffer=64,
                                              min_items_per_worker=500)]
  if failures := [image for image in images if isinstance(image, _Failure)]:
    raise DataError(failures[0].message)
  return images


# --- the work the input workers do ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Failure:
  """A worker's data error, returned (not raised) so the trainer reports it as one line."""
  message: str


class _ExampleReader:
  """Reads example `index` of a split, cached or from disk; with skip_corrupt, a broken one is
  replaced by the next readable example (deterministically, so batches stay reproducible)."""

  def __init__(self, examples: Examples, transform: Transform, skip_corrupt: bool):
    self.examples, self.transform, self.skip_corrupt = examples, transform, skip_corrupt

  def read(self, index: int, make_image) -> tuple[object, object]:
    """(image, label: an int or a uint8 [C] row), or (_Failure, 0)."""
    examples = self.examples
    for attempt in range(MAX_SUBSTITUTIONS if self.skip_corrupt else 1):
      position = (index + attempt) % len(examples)
      try:
        if examples.cached:
          item, label = examples.images[position], examples.labels[position]
        else:
          item, label = examples.source.load(position)
        return make_image(item), label_of(label)
      except Exception as e:  # pylint: disable=broad-except
        where = examples.source.describe(position) if examples.source else f'cached image {position}'
        reason = unreadable(where, e)
        if not self.skip_corrupt:
          return _Failure(f'{reason}, or set --config.dataset.skip_corrupt=true to skip such files'), 0
        print(f'warning: {reason}; skipped (dataset.skip_corrupt)', file=sys.stderr, flush=True)
    return _Failure(f'no readable image among {MAX_SUBSTITUTIONS} examples from {index} on'), 0


class _TrainLoader(_ExampleReader):
  """Step -> this process's rows of the global batch (the sampler's examples), random-resized-cropped
  per (seed, step, row of the global batch)."""

  def __init__(self, examples: Examples, transform: Transform, chosen: Sampler, skip_corrupt: bool,
               alternate_flip: bool = False):
    super().__init__(examples, transform, skip_corrupt)
    self.sampler, self.alternate_flip = chosen, alternate_flip

  def __call__(self, step: int):
    indices = self.sampler.indices(step)
    mirror = self.sampler.mirrored(step, indices) if self.alternate_flip else np.zeros(len(indices), bool)
    images, labels = _batch_images(len(indices), self.transform), []
    # Each row's crop from the global batch's draws for `step`: the same whichever process or worker
    # builds it.
    rows = self.sampler.rows
    draws = preprocess.crop_draws(samplers.generator(self.sampler.seed, samplers.CROPS_STREAM, step),
                                  rows.stop)[rows]
    for row, index in enumerate(indices):
      out = images[row] if isinstance(images, np.ndarray) else None
      image, label = self.read(int(index), functools.partial(preprocess.train_image, transform=self.transform,
                                                             draws=draws[row], out=out))
      if isinstance(image, _Failure):
        return image
      if out is None:
        images.append(image[:, ::-1] if mirror[row] else image)
      elif mirror[row]:
        out[:] = out[:, ::-1]  # numpy copies overlapping operands first
      labels.append(label)
    return Batch(_stack(images), label_batch(labels), np.ones(len(labels), bool))


def _images_bytes(count: int, transform: Transform) -> int:
  """What a batch's images take at a fixed image size (0 at native sizes: unknown before the first);
  its labels and mask fit in the eighth more that the workers' shared-memory blocks hold."""
  return count * transform.size * transform.size * transform.channels


def _batch_images(count: int, transform: Transform) -> np.ndarray | list:
  """Where a batch's images go: at a fixed image size, one array each image is resized straight
  into (no copy when the batch is stacked; in an input worker, the shared memory the batch goes back
  through); at native sizes, a list to stack."""
  if not transform.size:
    return []
  return shared_blocks.result_array((count, transform.size, transform.size, transform.channels), np.uint8)


class _EvalLoader(_ExampleReader):
  """Batch start -> this process's rows of the eval batch, resized and centre-cropped."""

  def __init__(self, examples, transform, skip_corrupt, batch_size=0, rows=slice(0)):
    super().__init__(examples, transform, skip_corrupt)
    self.batch_size, self.rows = batch_size, rows

  def example(self, index: int, out: Optional[np.ndarray] = None):
    return self.read(int(index), functools.partial(preprocess.eval_image, transform=self.transform, out=out))

  def __call__(self, start: int):
    indices, mask = _eval_rows(start, self.batch_size, self.rows, len(self.examples))
    images, labels = _batch_images(len(indices), self.transform), []
    for row, index in enumerate(indices):
      out = images[row] if isinstance(images, np.ndarray) else None
      image, label = self.example(index, out)
      if isinstance(image, _Failure):
        return image
      if out is None:
        images.append(image)
      labels.append(label)
    return Batch(_stack(images), label_batch(labels), mask)



def _stack(images: np.ndarray | list[np.ndarray]) -> np.ndarray:
  if isinstance(images, np.ndarray):
    return images
  shapes = {image.shape for image in images}
  if len(shapes) > 1:  # only possible with image_size=0 on a source whose sizes were not scanned
    raise DataError(f'images of sizes {sorted(shapes)[:3]} in one batch; set '
                    '--config.dataset.image_size=N')
  return np.stack(images)
