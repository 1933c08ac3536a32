"""Whether a run fits in memory, checked before it starts: the input pipeline's host memory, the
train step's device memory.

A run whose batches cannot fit used to grow until the kernel killed it (image_size=100000 reached
23.6 GB), leaving a lock and an empty metrics file; it now stops with one line naming the key.

JAX-free at import: the CLI checks a config before JAX starts and before the workdir is touched.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import ml_collections

from flaxtpu.data.spec import DatasetSpec, input_workers
from flaxtpu.settings.errors import ConfigError
from flaxtpu.settings.lengths import resolved_eval_batch_size

# A grain worker's own memory (a fresh interpreter with numpy, OpenCV, Pillow and grain): 97 MiB
# measured (USS; its RSS of 215 MiB includes the shared libraries every worker shares).
WORKER_BYTES = 100 * 2**20
# Train batches alive besides the prefetched ones: the one the step trains on and the two that
# train.py has put on the devices ahead (host memory too on CPU). Eval: the one it scores.
TRAIN_BATCHES_IN_USE = 3
EVAL_BATCHES_IN_USE = 1
# What the keys that size the pipeline are compared with to find the one to blame.
MODEST = {'dataset.image_size': 224, 'batch_size': 256, 'eval_batch_size': 256, 'input.prefetch': 4,
          'input.workers': 4}


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Host bytes the input pipeline holds at its peak, by part."""
  train_batches: int
  eval_batches: int
  workers: int

  @property
  def total(self) -> int:
    return self.train_batches + self.eval_batches + self.workers


def host_estimate(config: ml_collections.ConfigDict, image_shape: tuple[int, int, int], *,
                  streamed: bool, training: bool = True) -> Estimate:
  """The uint8 batches decoded ahead (train and eval), and the worker processes that decode them.

  A streamed split is read by `input.workers` processes, each building one batch while up to
  max(prefetch, workers) wait; a cached one by one thread, `prefetch` ahead. Both pipelines are alive
  during an evaluation in training.
  """
  image_bytes = image_shape[0] * image_shape[1] * image_shape[2]
  workers = input_workers(config.input.workers) if streamed else 0
  waiting = max(config.input.prefetch, workers) + max(workers, 1)  # buffered + being built

  def batches(batch_size: int, in_use: int) -> int:
    return batch_size * image_bytes * (waiting + in_use)

  pipelines = 2 if training else 1
  return Estimate(
      train_batches=batches(config.batch_size, TRAIN_BATCHES_IN_USE) if training else 0,
      eval_batches=batches(resolved_eval_batch_size(config), EVAL_BATCHES_IN_USE),
      workers=pipelines * workers * WORKER_BYTES)


def available_bytes() -> int:
  """Host memory a new allocation can take: /proc/meminfo's MemAvailable within a cgroup's limit."""
  available = None
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      available = next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
  except (OSError, StopIteration, ValueError):
    pass
  if available is None:
    try:
      available = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES')
    except (ValueError, OSError, AttributeError):
      return 2**62  # unknown: refuse nothing
  try:  # a container's own limit (cgroup v2)
    with open('/sys/fs/cgroup/memory.max', encoding='ascii') as f:
      limit = f.read().strip()
    with open('/sys/fs/cgroup/memory.current', encoding='ascii') as f:
      used = int(f.read().strip())
    if limit != 'max':
      available = min(available, int(limit) - used)
  except (OSError, ValueError):
    pass
  return available


def format_bytes(count: float) -> str:
  return f'{count / 2**30:.1f} GiB' if count >= 2**30 else f'{count / 2**20:.0f} MiB'


def check_host(config: ml_collections.ConfigDict, image_shape: tuple[int, int, int], *, streamed: bool,
               training: bool = True, available: Optional[int] = None) -> Estimate:
  """Raises ConfigError naming the key to lower when the input pipeline cannot fit in host memory."""
  estimate = host_estimate(config, image_shape, streamed=streamed, training=training)
  available = available_bytes() if available is None else available
  if estimate.total <= available:
    return estimate
  key = _culprit(config, image_shape, streamed, training)
  value = config[key]
  height, width, channels = image_shape
  raise ConfigError(
      f'config.{key}={value} cannot fit: the input pipeline needs about {format_bytes(estimate.total)} '
      f'({estimate.total} bytes) of host memory, more than the {format_bytes(available)} available '
      f'(train batches {format_bytes(estimate.train_batches)}, eval batches '
      f'{format_bytes(estimate.eval_batches)}, workers {format_bytes(estimate.workers)}; '
      f'batch_size={config.batch_size} x ' + (f'{height}x{width}x{channels} uint8 images' if height else
                                               'images of a native size not read yet') + ', '
      f'input.prefetch={config.input.prefetch}); lower config.{key}')


def _culprit(config: ml_collections.ConfigDict, image_shape: tuple[int, int, int], streamed: bool,
             training: bool) -> str:
  """The key whose lowering to a modest value saves the most memory."""
  savings = {}
  total = host_estimate(config, image_shape, streamed=streamed, training=training).total
  for key, modest in MODEST.items():
    if key == 'dataset.image_size' and not config.dataset.image_size:
      continue  # the native size: not a key's value
    if key == 'batch_size' and not training:
      continue
    lowered = config.copy_and_resolve_references()
    parent, _, leaf = key.rpartition('.')
    node = lowered[parent] if parent else lowered
    current = resolved_eval_batch_size(config) if key == 'eval_batch_size' else (
        input_workers(config.input.workers) if key == 'input.workers' else node[leaf])
    node[leaf] = min(current, modest)
    shape = (*[min(side, modest) for side in image_shape[:2]], image_shape[2]) \
        if key == 'dataset.image_size' else image_shape
    savings[key] = total - host_estimate(lowered, shape, streamed=streamed, training=training).total
  return max(savings, key=savings.get)


def check_before_start(config: ml_collections.ConfigDict, mode: str) -> None:
  """What the config alone tells, before the data is read and the workdir is locked.

  A lower bound: the batches count only with dataset.image_size > 0 (the native size is not known
  yet), channels are 3 for folders (decoded as RGB) and at least 1 otherwise, and workers only with
  dataset.cache='none' (a cached split needs none). train.py checks again with the data's own shape.
  """
  if mode not in ('train', 'eval'):
    return
  spec = DatasetSpec.of(config)
  side = spec.image_size
  check_host(config, (side, side, 3 if spec.folder else 1), streamed=spec.cache == 'none',
             training=mode == 'train')


def device_need(plan: dict) -> Optional[tuple[int, int, str]]:
  """(bytes the compiled train step of XLA's per-device memory `plan` needs, bytes it may take, where
  those are), or None where the backend plans nothing.

  Accelerators report their limit (memory_stats()['bytes_limit']); CPU devices share host memory.
  """
  import jax  # pylint: disable=g-import-not-at-top  # only once JAX has started
  if 'total_bytes' not in plan:
    return None
  devices = jax.local_devices()
  stats = devices[0].memory_stats() or {}
  if 'bytes_limit' in stats:  # the state and batches live on the device too
    limit = stats['bytes_limit']
    return plan['total_bytes'], limit, f'the {format_bytes(limit)} of one {devices[0].device_kind}'
  # CPU devices: the state and batch are allocated already; the step adds its temporaries
  limit = available_bytes()
  return plan['temp_bytes'] * len(devices), limit, f'the {format_bytes(limit)} of host memory available'


def check_device(config: ml_collections.ConfigDict, plan: dict) -> None:
  """Raises ConfigError when XLA's per-device memory plan of the train step exceeds a device's memory."""
  need = device_need(plan)
  if need and need[0] > need[1]:
    needed, _, where = need
    raise ConfigError(
        f'config.batch_size={config.batch_size} cannot fit: the compiled train step of model.name='
        f'{config.model.name!r} needs {format_bytes(needed)} ({needed} bytes) of device memory, more than '
        f'{where}; lower config.batch_size or the image size, or set config.model.remat (auto picks the '
        'fastest policy that fits)')
