"""The train step compiled ahead of time on a zero batch, without a dataset, and its per-device
memory plan: what `--mode=plan` reports, what the training log shows, what the benchmarks time."""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from flaxtpu.augmentation import image_sizes
from flaxtpu.settings.lengths import run_length
from flaxtpu.step import parallel, steps


def compile_on_zeros(config: ml_collections.ConfigDict, *, image_shape: tuple[int, int, int],
                     num_classes: int, num_train_examples: int = 50_000):
  """The config's train step compiled for data of this shape, with a zero batch and no dataset.

  Returns (placement, state, batch, compiled step, memory plan): what
  --mode=plan reports and what the benchmarks time.
  """
  length = run_length(config, num_train_examples)
  zeros = np.zeros(len(image_shape), np.float32)
  task = steps.create_task(config, num_classes=num_classes, image_shape=image_shape, mean=zeros,
                           std=zeros + 1, length=length)
  # augment.train_sizes: the largest size the step resizes to is the one that needs the most memory.
  task = image_sizes.sized_task(task, image_sizes.largest(config, image_shape))
  placement = steps.place(task, parallel.make_mesh(config), config)
  local_batch_size = config.batch_size // jax.process_count()
  images = np.zeros((local_batch_size, *image_shape), np.uint8)
  labels = (np.zeros((local_batch_size, num_classes), np.uint8) if task.multilabel
            else np.zeros((local_batch_size,), np.int32))
  state = steps.create_state(task, placement, config.seed)
  batch = placement.put_train_batch((images, labels))
  step, plan = placement.compile_train_step(state, batch)
  return placement, state, batch, step, plan


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
