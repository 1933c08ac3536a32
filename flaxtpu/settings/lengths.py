"""How long a run is: epochs turned into steps, and the batch sizes that follow from the config.

No JAX: the memory estimate and `--mode=plan` read these before a device starts.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from flaxtpu.settings.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RunLength:
  """How long a run is, in steps, derived from the config and the dataset size."""
  steps_per_epoch: int
  total_steps: int
  eval_every_steps: int
  checkpoint_every_steps: int
  warmup_steps: int
  accumulate_steps: int = 1  # batches per optimizer update: the schedule counts updates

  @property
  def total_updates(self) -> int:
    return self.total_steps // self.accumulate_steps


def run_length(config: ml_collections.ConfigDict, num_train_examples: int,
               total_steps: int | None = None) -> RunLength:
  """Turns epochs into steps (training drops each epoch's last partial batch); `total_steps` (a time
  budget's plan) replaces num_train_steps and num_epochs."""
  steps_per_epoch = num_train_examples // config.batch_size
  if steps_per_epoch == 0:
    raise ConfigError(f'config.batch_size={config.batch_size} is larger than the train split '
                      f'({num_train_examples} examples); lower the batch size')
  if total_steps is not None:
    pass
  elif config.num_train_steps > 0:
    total_steps = config.num_train_steps
  else:
    total_steps = max(1, math.ceil(config.num_epochs * steps_per_epoch))
  # The run ends on an update: a last partial accumulation would be work thrown away.
  accumulate = config.optimizer.accumulate_steps
  total_steps = accumulate * max(1, math.ceil(total_steps / accumulate))

  def every(value: int) -> int:
    return min(steps_per_epoch if value == -1 else value, total_steps)

  return RunLength(
      steps_per_epoch=steps_per_epoch,
      total_steps=total_steps,
      eval_every_steps=every(config.eval_every_steps),
      checkpoint_every_steps=every(config.checkpoint_every_steps),
      warmup_steps=int(round(config.schedule.warmup_epochs * steps_per_epoch)),
      accumulate_steps=accumulate,
  )


def resolved_eval_batch_size(config: ml_collections.ConfigDict) -> int:
  """The global eval batch: config.eval_batch_size, or batch_size when it is -1."""
  return config.eval_batch_size if config.eval_batch_size > 0 else config.batch_size
