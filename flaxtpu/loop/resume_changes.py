"""A run resumed with a config other than its checkpoint's: what changed, applied and said, or refused.

The rule (docs/workdir.md): a key that keeps the checkpoint's arrays meaning
what they meant (run length, schedule, learning rate and the optimizer's
numbers, augmentation, regularisation, evaluation, logging) is applied, and
each one is logged on a line of its own with its effect: the run's new length
in steps, the learning rate at the resume step before and after. A key that
would make the saved weights compute another function, or the saved optimizer
state mean another thing, is refused before anything is restored, in one line
that names it and the ways out.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax
import ml_collections

from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import RunLength, run_length
from flaxtpu.weights.checkpoint import changed_values

# Keys whose change makes the checkpoint another model, or its optimizer state another optimizer's.
# (Keys that change the arrays' shapes fail the restore itself, which names them too.)
REFUSED = ('model.name', 'model.patch_size', 'model.pool', 'model.padding', 'model.gelu', 'model.downsample',
           'task', 'optimizer.name', 'loss')  # (optimizer.accumulate_steps: refused with its own line)
# Keys of the model's memory plan or its regularisation only: the same weights compute the same function.
MODEL_KEYS_APPLIED = ('model.remat', 'model.remat_mlps', 'model.space_to_depth', 'model.dropout',
                      'model.drop_path')
RUN_LENGTH = ('num_epochs', 'num_train_steps')
# Keys the learning rate at a step depends on (beside the run length).
SCHEDULE = ('optimizer.learning_rate', 'schedule.', 'batch_size')


class ResumeRefused(UserError):
  """The config changed a key that the checkpoint cannot be resumed with."""


def refused(changed: dict[str, tuple], parallelism: str) -> list[str]:
  """The changed keys a resume refuses: the model's function, the optimizer's kind, and under pmap the
  batch size (each device's BatchNorm statistics and the data position are per-device batches)."""
  names = [key for key in changed
           if key in REFUSED or (key.startswith('model.') and key not in MODEL_KEYS_APPLIED)]
  if parallelism == 'pmap' and 'batch_size' in changed:
    names.append('batch_size')
  return names


def check(saved: dict, config: ml_collections.ConfigDict, current: dict, step: int, directory: str) -> None:
  """ResumeRefused, before any restore, where the config changed a key that the checkpoint at `step`
  cannot be resumed with."""
  changed = changed_values(saved, current)
  names = refused(changed, config.parallelism)
  if not names:
    return
  what = ', '.join(f'{key} {changed[key][0]!r} -> {changed[key][1]!r}' for key in names)
  raise ResumeRefused(
      f'checkpoint step {step} in {directory} cannot be resumed with this config ({what}): its weights and '
      'optimizer state belong to the old values; train with a new --workdir, or start a new run from its '
      f'weights with --config.init_from.checkpoint={directory} and a new --workdir, or resume with the old '
      'values')


def log_applied(saved: dict, current: dict, config: ml_collections.ConfigDict, step: int,
                num_train_examples: int, length: RunLength, schedule) -> list[str]:
  """Logs (and returns) one line per changed key that the resume applies, with its effect."""
  changed = changed_values(saved, current)
  if not changed:
    return []
  from flaxtpu.validation import workdir_config  # pylint: disable=g-import-not-at-top
  old_config = workdir_config.from_saved(saved)
  try:
    old_length = run_length(old_config, num_train_examples)
  except UserError:
    old_length = None
  lines = []
  learning_rate = _learning_rate_effect(old_config, old_length, config, step, schedule)
  for key, (old, new) in changed.items():
    effects = []
    if key in RUN_LENGTH and old_length and old_length.total_steps != length.total_steps:
      effects.append(f'{old_length.total_steps:,} -> {length.total_steps:,} steps')
    if learning_rate and (key in RUN_LENGTH or key.startswith(SCHEDULE)):
      effects.append(learning_rate)
      learning_rate = None  # said once, on the first line whose key moves it
    lines.append(f'resume: {key} {old!r} -> {new!r}' + (': ' + '; '.join(effects) if effects else ''))
  if learning_rate:
    lines.append(f'resume: {learning_rate}')
  for line in lines:
    logging.info('%s', line)
  return lines


def _learning_rate_effect(old_config: ml_collections.ConfigDict, old_length: Optional[RunLength],
                          config: ml_collections.ConfigDict, step: int, schedule) -> Optional[str]:
  """'learning rate at step N OLD -> NEW' where the resume changes it (None where it does not, or where
  the old rate cannot be known: a time budget set the old run's length)."""
  if old_length is None or old_config.time_budget or config.time_budget:
    return None
  from flaxtpu.optimizers import optim  # pylint: disable=g-import-not-at-top
  try:
    old_schedule = optim.learning_rate_schedule(old_config, old_length)
  except (UserError, ValueError):
    return None
  update = step // max(1, old_length.accumulate_steps)
  old, new = float(jax.device_get(old_schedule(update))), float(jax.device_get(schedule(step)))
  if abs(old - new) <= 1e-6 * max(abs(old), abs(new)):
    return None
  return f'learning rate at step {step:,} {old:.4g} -> {new:.4g}'
