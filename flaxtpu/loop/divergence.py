"""A NaN/Inf training loss: the one-line error that says what to change and which checkpoint is intact
(its first step is found by `window.TrainWindow`)."""

from __future__ import annotations

import ml_collections

from flaxtpu.settings.errors import UserError


class TrainingDiverged(UserError):
  """The loss became NaN or infinite: the state from that step on is not worth saving."""


class Diverged(Exception):
  """Raised in the loop at a NaN/Inf loss; the run closes and reports it as TrainingDiverged."""

  def __init__(self, step: int):
    super().__init__(step)
    self.step = step


def message(config: ml_collections.ConfigDict, step: int, checkpoints) -> str:
  """TrainingDiverged's line: the step, the likely causes and keys to change, the last good checkpoint."""
  saved = checkpoints.all_steps()
  last_good = (f'the last good checkpoint, step {max(saved)} in {checkpoints.directory}, is intact: '
               'change the config and run the same command to resume from it' if saved
               else 'no checkpoint was saved before it')
  overflow = f' or a {config.dtype} overflow (try dtype=float32)' if config.dtype != 'float32' else ''
  return (f'the training loss became NaN/Inf at step {step}; likely causes: a learning rate too high '
          f'(optimizer.learning_rate={config.optimizer.learning_rate}: lower it, add warmup or '
          f'optimizer.grad_clip_norm){overflow}; nothing from that step on was saved; {last_good}')
