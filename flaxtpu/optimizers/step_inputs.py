"""The optimizer's and the loss's numbers that the train step takes as inputs, not as constants.

A number compiled into the train step makes a new program of every value: a
learning-rate sweep, or a run resumed with a longer schedule, compiled the step
again (36.6 s for ResNet-20 on a TPU v5e), past XLA's persistent cache. Passed
as an argument, the same program serves every value, and every trial after the
first loads it from the cache. What stays a constant is what changes the
program's structure: whether a number is zero where zero means "leave that part
out" (no momentum, no weight decay, no clipping, no warmup), the optimizer and
schedule kinds, and the lengths that some parts take as Python numbers
(onecycle's phases, the step schedule's milestones, Lookahead, freeze_after).

`of(config, length)` gives the numbers of a run, {name: value}; the optax chain
and the schedule (optim.py) read them as floats on the host (the logged
learning rate, the chain that initialises the state) and as traced arrays in
the train step: the same code, the same values.
"""

from __future__ import annotations

from typing import Mapping

import ml_collections
import numpy as np

from flaxtpu.settings.lengths import RunLength

# Config keys whose values the train step takes as inputs.
CONFIG_KEYS = ('optimizer.learning_rate', 'optimizer.weight_decay', 'optimizer.bias_weight_decay',
               'optimizer.momentum', 'optimizer.b1', 'optimizer.eps', 'optimizer.grad_clip_norm',
               'schedule.final_lr_fraction', 'label_smoothing')


def warmup_updates(length: RunLength) -> int:
  """The schedule's warmup in optimizer updates: a warmup asked for is never lost (at least one update),
  and leaves at least one update after it."""
  warmup = length.warmup_steps // length.accumulate_steps
  return min(max(warmup, 1) if length.warmup_steps else 0, length.total_updates - 1)


def of(config: ml_collections.ConfigDict, length: RunLength) -> dict[str, float]:
  """The run's numbers, as the train step's argument takes them: {name: value}."""
  numbers = {key: float(config[key]) for key in CONFIG_KEYS}
  numbers['total_updates'] = float(length.total_updates)
  numbers['warmup_updates'] = float(warmup_updates(length))
  return numbers


def as_arrays(numbers: Mapping[str, float]) -> dict[str, np.ndarray]:
  """The numbers as float32 scalars (what the compiled step's signature holds, whatever the values)."""
  return {name: np.float32(value) for name, value in numbers.items()}
