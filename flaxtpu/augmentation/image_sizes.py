"""Resolution over a run and at evaluation (issue 41): `augment.train_sizes` (progressive resizing,
as Composer, timm's --train-img-sizes and FFCV do) and `eval.image_size` / `eval.crop_fraction`
(evaluating at another size than training: torchvision's FixRes recipe, train 176 / eval 224).

Progressive resizing: the input pipeline keeps producing batches at the run's size
(dataset.image_size, or the native size) and the train step resizes the augmented batch on the
device (`jax.image.resize`, antialiased) to the size the schedule gives the step. The size is a
pure function of (step, total steps, accumulate_steps), so a resumed run, another process count or
a rerun replays it bit for bit. Each size is one compiled step, compiled when first reached and
kept; the run logs each switch and records the sizes in metrics.jsonl and results.json.

Evaluation size: the eval split has its own `Transform` (the shorter side resized to
eval.image_size / crop fraction, the centre cut out; at native size the whole image resized), used
by in-training eval, --mode=eval, calibrate, predict and export (which serves at that size).

No JAX at import (config.py reads the checks); `resize_batch` imports it when called.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import ml_collections

from flaxtpu import models
from flaxtpu.settings.errors import ConfigError

MIN_SIZE = 8  # the smallest side a schedule or eval.image_size may ask for


# --- the checks (config.validate and check_against_data) ------------------------------------------


def check(config: ml_collections.ConfigDict) -> None:
  """augment.train_sizes and eval.image_size / eval.crop_fraction, without the data."""
  sizes = config.augment.train_sizes
  key = 'config.augment.train_sizes'
  example = '--config.augment.train_sizes="((0.0, 24), (0.5, 28), (0.75, 32))"'
  if sizes:
    if isinstance(sizes, str) or not all(isinstance(entry, (tuple, list)) and len(entry) == 2
                                         for entry in sizes):
      raise ConfigError(f'{key}={sizes!r} must be (fraction of the steps, size) pairs, e.g. {example}')
    fractions = [entry[0] for entry in sizes]
    for fraction, size in sizes:
      if not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ConfigError(f'{key} start {fraction!r} must be a fraction of the steps in [0, 1), e.g. '
                          f'{example}')
      if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
        raise ConfigError(f'{key} size {size!r} must be a whole number of pixels >= {MIN_SIZE}')
    if fractions[0] != 0:
      raise ConfigError(f'{key}={tuple(map(tuple, sizes))} must start at fraction 0 (the first step\'s '
                        f'size), e.g. {example}')
    if any(b <= a for a, b in zip(fractions, fractions[1:])):
      raise ConfigError(f'{key}={tuple(map(tuple, sizes))}: the start fractions must increase; sort them')
    _check_family(config, key)
    if config.time_budget:
      raise ConfigError(f'config.time_budget measures one step time, and {key} changes it at every switch; '
                        'set num_train_steps (or num_epochs) instead, or drop one of the two')
  if config.eval.image_size:
    if config.eval.image_size < MIN_SIZE:
      raise ConfigError(f'config.eval.image_size={config.eval.image_size} must be 0 (the train size) or '
                        f'>= {MIN_SIZE}')
    _check_family(config, 'config.eval.image_size')
  if not 0.0 <= config.eval.crop_fraction <= 1.0:
    raise ConfigError(f'config.eval.crop_fraction={config.eval.crop_fraction!r} must be in (0, 1] (0 = '
                      'dataset.crop_fraction), e.g. 0.875; torchvision\'s resize 232 / crop 224 is 0.9655')
  if config.eval.crop_fraction and not config.eval.image_size:
    raise ConfigError('config.eval.crop_fraction applies with eval.image_size; set that too (or '
                      'dataset.crop_fraction to change the train size\'s eval crop)')


def _check_family(config: ml_collections.ConfigDict, key: str) -> None:
  if models.get_family(config.model.name).fixed_image_size:
    raise ConfigError(f'{key}: {config.model.name}\'s position embeddings fix the image size it reads '
                      '(no interpolation here); use a convolutional model or leave it unset')


def check_against_data(config: ml_collections.ConfigDict, image_shape: tuple[int, ...]) -> None:
  """Each scheduled size fits the images the pipeline makes; each size suits the model."""
  side = min(image_shape[:2])
  for size in sizes_of(config):
    if size > side:
      raise ConfigError(f'config.augment.train_sizes asks for {size} px, above the {image_shape[0]}x'
                        f'{image_shape[1]} images the pipeline makes; set --config.dataset.image_size={size} '
                        '(the largest size) so that every batch is resized down, never up')
    models.check_image_shape(config.model.name, (size, size, image_shape[-1]), config.model.patch_size)
  if config.eval.image_size:
    models.check_image_shape(config.model.name, (config.eval.image_size,) * 2 + (image_shape[-1],),
                             config.model.patch_size)


# --- the schedule (a pure function of the step) ----------------------------------------------------


def sizes_of(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  return tuple(int(size) for _, size in config.augment.train_sizes)


def switches(config: ml_collections.ConfigDict, total_steps: int) -> tuple[tuple[int, int], ...]:
  """(first step, size) of each schedule entry: it runs from step first + 1 on (steps count from 1).

  A start is fraction x total steps, rounded down to a whole optimizer update (accumulate_steps), so
  one update never mixes sizes. Entries that round onto the same step keep the last.
  """
  accumulate = max(1, config.optimizer.accumulate_steps)
  starts: dict[int, int] = {}
  for fraction, size in config.augment.train_sizes:
    starts[int(fraction * total_steps) // accumulate * accumulate] = int(size)
  return tuple(sorted(starts.items()))


def size_at(schedule: tuple[tuple[int, int], ...], step: int) -> int:
  """The size of step `step` (1-based), 0 without a schedule."""
  size = 0
  for first, scheduled in schedule:
    if first < step:
      size = scheduled
  return size


def largest(config: ml_collections.ConfigDict, image_shape: tuple[int, ...]) -> int:
  """The largest size the train step sees: what --mode=plan compiles (0 = the pipeline's)."""
  sizes = sizes_of(config)
  return max(sizes) if sizes and max(sizes) < image_shape[0] else 0


# --- on the device ---------------------------------------------------------------------------------


def resize_batch(images, size: int):
  """uint8/float [B, H, W, C] -> float32 [B, size, size, C] in the same pixel scale (0..255),
  antialiased when shrinking (as PIL's and OpenCV's area resize); unchanged at size 0 or its own."""
  if not size or images.shape[1:3] == (size, size):
    return images
  import jax  # pylint: disable=g-import-not-at-top  # config.py imports this module: no JAX at import
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  shape = (images.shape[0], size, size, images.shape[-1])
  return jax.image.resize(images.astype(jnp.float32), shape, method='linear', antialias=True)


def sized_task(task, size: int):
  """The task whose train step resizes to `size` (0 = the pipeline's size)."""
  return dataclasses.replace(task, train_size=size)


class TrainSteps:
  """The compiled train step of each step's size: compiled once per size when first reached, kept,
  each switch logged."""

  def __init__(self, config: ml_collections.ConfigDict, total_steps: int, image_shape: tuple[int, ...],
               compile_for_size: Callable):
    self.schedule = switches(config, total_steps)
    self.pipeline_size = image_shape[0]
    self.compile_for_size = compile_for_size  # (state, batch, size) -> compiled step
    self.compiled: dict[int, Callable] = {}
    self.size: Optional[int] = None

  def at(self, step: int, state, batch) -> Callable:
    """The compiled step for step `step`; compiles (and logs the switch) at a new size."""
    size = size_at(self.schedule, step) or self.pipeline_size
    if size != self.size:
      if self.size is not None or self.schedule:
        logging.info('train image size %s%d px from step %d (augment.train_sizes)',
                     '' if self.size is None else f'{self.size} -> ', size, step)
      self.size = size
    if size not in self.compiled:
      self.compiled[size] = self.compile_for_size(state, batch, 0 if size == self.pipeline_size else size)
    return self.compiled[size]


def logged(config: ml_collections.ConfigDict, total_steps: int, step: int, pipeline_size: int) -> dict:
  """metrics.jsonl's `train_image_size` of a log line (only with a schedule)."""
  if not config.augment.train_sizes:
    return {}
  return {'train_image_size': size_at(switches(config, total_steps), step) or pipeline_size}


def report(config: ml_collections.ConfigDict, total_steps: int) -> dict:
  """results.json's record of the sizes: the train schedule's switches, the eval size."""
  record = {}
  if config.augment.train_sizes:
    record['train_image_sizes'] = [{'from_step': first + 1, 'size': size}
                                   for first, size in switches(config, total_steps)]
  if config.eval.image_size:
    record['eval_image_size'] = config.eval.image_size
  return record


# --- evaluation at eval.image_size (host side) ------------------------------------------------------


def eval_transform(transform, eval_size: int, eval_crop_fraction: float):
  """The eval split's `preprocess.Transform`: `transform` (the train size's) at eval.image_size.

  Images read at a size (dataset.image_size > 0) keep dataset.crop_fraction unless
  eval.crop_fraction sets one; images at their native size are resized whole (crop fraction 1)
  unless it sets one.
  """
  if not eval_size:
    return transform
  fraction = eval_crop_fraction or (transform.crop_fraction if transform.size else 1.0)
  return dataclasses.replace(transform, size=eval_size, crop_fraction=fraction)


def eval_shape(config: ml_collections.ConfigDict, image_shape: tuple[int, ...]) -> tuple[int, int, int]:
  """The shape evaluation, predict and export feed the model."""
  size = config.eval.image_size
  return (size, size, image_shape[-1]) if size else tuple(image_shape)
