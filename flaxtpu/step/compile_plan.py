"""The train step compiled ahead of time on a zero batch, without a dataset, and its per-device
memory plan: what `--mode=plan` reports, what the training log shows, what the benchmarks time;
and, while a run's data is decoded, its first programs compiled into the persistent compilation
cache (`compile_ahead`)."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import jax
import ml_collections
import numpy as np

from flaxtpu.augmentation import image_sizes
from flaxtpu.data import sampling
from flaxtpu.settings.lengths import run_length
from flaxtpu.step import parallel, placing, steps


def compile_on_zeros(config: ml_collections.ConfigDict, *, image_shape: tuple[int, int, int],
                     num_classes: int, num_train_examples: int = 50_000, mean=None, std=None):
  """The config's train step compiled for data of this shape, with a zero batch and no dataset
  (normalised with `mean`/`std` where the config standardises; 0 and 1 if not given).

  Returns (placement, state, batch, compiled step, memory plan): what
  --mode=plan reports and what the benchmarks time.
  """
  length = run_length(config, num_train_examples)
  zeros = np.zeros(image_shape[-1], np.float32)
  task = steps.create_task(config, num_classes=num_classes, image_shape=image_shape,
                           mean=zeros if mean is None else mean, std=zeros + 1 if std is None else std,
                           length=length)
  # augment.train_sizes: the largest size the step resizes to is the one that needs the most memory.
  task = image_sizes.sized_task(task, image_sizes.largest(config, image_shape))
  placement = placing.place(task, parallel.make_mesh(config), config)
  batch = placing.zero_batch(task, placement, config.batch_size)
  if placement.parallelism != 'jit':  # pmap lowers for arrays with their device axis: the state first
    state = placing.create_state(task, placement, config.seed)
    return (placement, state, batch, *placement.compile_train_step(state, batch))
  # The train step compiles beside the state's initialisation, as a run's does (placing.StepAhead): on a
  # TPU v5e the two took 3.4 and 7.8 s one after the other.
  ahead = placing.StepAhead.start(task, placement, config.batch_size)
  state = placing.create_state(task, placement, config.seed)
  return (placement, state, batch, *ahead.result_for(batch))


def compile_ahead(config: ml_collections.ConfigDict, listed) -> None:
  """Compiles the run's first programs (its state's initialisation, its train step, the augmentation
  of its first images for TensorBoard) for the data as listed (`pipeline.load`'s `on_listed`),
  before its images are decoded (logging how long that took, or why nothing is compiled ahead).

  The compiled programs go into the persistent compilation cache, where the run finds them once
  the data is read: they are the same programs, built from the same config, shapes and run length.
  Not where the run builds its step from more than that (see `ahead_reason`), nor without the
  cache. A cold `configs/cifar10.py` on a TPU v5e read its data until 15.6 s after the command and
  then compiled for 10 s (docs/performance.md).
  """
  if reason := ahead_reason(config):
    logging.info('the train step compiles after the data is read (%s)', reason)
    return
  started = time.time()
  # As the run counts its length (train.py), from the listed split: the schedule is in the step.
  examples = sampling.examples_per_epoch(listed, config.batch_size, jax.process_count())
  # Before its first step a run also augments the first images of its first batch (run_log.py): a
  # dozen small programs, which compile beside the step's.
  sample = np.zeros((min(steps.AUGMENTED_SAMPLE_IMAGES, config.batch_size), *listed.image_shape), np.uint8)
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='flaxtpu-sample') as pool:
    augmented = pool.submit(steps.augmented_sample, config.augment, config.seed, 0, sample)
    compile_on_zeros(config, image_shape=listed.image_shape, num_classes=listed.num_classes,
                     num_train_examples=examples, mean=listed.mean, std=listed.std)
    augmented.result()
  logging.info('compiled the train step ahead, while the data is read, in %.1f s', time.time() - started)


def ahead_reason(config: ml_collections.ConfigDict) -> str:
  """Why the run's train step cannot be compiled before its data is read ('' where it can): what
  the step is built from beyond the config and the listing."""
  if not jax.config.jax_compilation_cache_dir:
    return 'no persistent compilation cache: compilation_cache_dir=none'
  reasons = {'several processes': jax.process_count() > 1,
             'remat=auto chooses a policy by compiling each': config.model.remat == 'auto',
             'augment.train_sizes': bool(config.augment.train_sizes),
             'a time budget plans the schedule': bool(config.time_budget),
             'a distillation teacher': bool(config.distill.teacher)}
  return ', '.join(reason for reason, applies in reasons.items() if applies)


def plan_memory(config: ml_collections.ConfigDict, *, image_shape: tuple[int, int, int],
                num_classes: int, num_train_examples: int = 50_000) -> dict:
  """Compiles the train step for this config without training: what --mode=plan reports.
  `num_train_examples` sets the run's length, which the schedule in the step depends on."""
  placement, _, _, _, plan = compile_on_zeros(config, image_shape=image_shape, num_classes=num_classes,
                                              num_train_examples=num_train_examples)
  return {'model': config.model.name, 'remat': config.model.remat, 'dtype': config.dtype,
          'batch_size': config.batch_size, 'parallelism': config.parallelism,
          'mesh': dict(placement.mesh.shape), 'image_shape': list(image_shape),
          **({'train_image_size': max(image_sizes.sizes_of(config))} if config.augment.train_sizes else {}),
          **plan}


def format_plan(plan: dict) -> str:
  """The memory plan in MiB, for the log line after the compile."""
  if 'total_bytes' not in plan:
    return 'not reported by this backend'
  mib = lambda key: f'{plan[key] / 2**20:.1f} MiB'
  return (f'arguments {mib("argument_bytes")}, outputs {mib("output_bytes")}, temporaries '
          f'{mib("temp_bytes")}, total {mib("total_bytes")}')
