"""A saved run read without JAX: its complete checkpoint steps, the step `latest | best | N` names,
and the JSON record kept beside each step's arrays.

orbax writes a step's record (`STEP/record/metadata`) and its metrics (`STEP/metrics/metrics`) as plain
JSON; reading them here lets the CLI resolve a config from another run before JAX starts
(flaxtpu/validation/resolution.py). flaxtpu/weights/checkpoint.py reads and writes the arrays through orbax.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from flaxtpu.io import files, storage
from flaxtpu.settings.errors import CheckpointError

COMMIT_MARKER = 'commit_success.txt'  # orbax's mark of a complete step on an object store


def complete_steps(directory: str) -> list[int]:
  """The step directories orbax has renamed into place (a save in flight is STEP.orbax-checkpoint-tmp).

  An object store has no rename: there orbax writes STEP/ in place and marks it complete last with
  STEP/commit_success.txt.
  """
  try:
    names = [name for name in files.listdir(directory) if name.isdigit()]
  except OSError:
    return []
  if storage.is_remote(directory):
    names = [name for name in names if files.exists(os.path.join(directory, name, COMMIT_MARKER))]
  return [int(name) for name in names]


def pick_step(directory: str, which: str, key: str, steps: Sequence[int],
              best_step: Callable[[], Optional[int]]) -> int:
  """'latest' | 'best' | a step number -> one of `steps`, or CheckpointError naming config.`key`."""
  if not steps:
    raise CheckpointError(f'no complete checkpoint in {directory}; train first with the '
                          'same --workdir')
  if which == 'latest':
    return max(steps)
  if which == 'best':
    best = best_step()
    if best is None:
      raise CheckpointError(f'no checkpoint in {directory} has metrics to pick the best '
                            f'from; use --config.{key}=latest')
    return best
  if not which.isdigit() or int(which) not in steps:
    raise CheckpointError(f'config.{key}={which!r} is not a saved step in '
                          f'{directory}; saved steps: {list(steps)} (or latest, best)')
  return int(which)


def best_step(directory: str, steps: Sequence[int], metric: str, mode: str) -> Optional[int]:
  """The step orbax's CheckpointManager.best_step gives: without a metric the latest; else, of the steps
  saved with metrics, the last after a stable sort by `metric` (descending for mode 'min')."""
  if not metric:
    return max(steps) if steps else None
  scored = [(step, metrics) for step in sorted(steps)
            if (metrics := files.read_json(os.path.join(directory, str(step), 'metrics', 'metrics')))
            is not None]
  ranked = sorted(scored, key=lambda item: item[1][metric], reverse=mode == 'min')
  return ranked[-1][0] if ranked else None


def read_record(directory: str, step: int) -> dict:
  """The JSON record saved with `step` (config, classes, normalisation, data position, progress)."""
  path = os.path.join(directory, str(step))
  record = files.read_json(os.path.join(path, 'record', 'metadata'))
  if record is None:
    raise CheckpointError(f'checkpoint {path} cannot be read (its record is missing or not JSON)')
  return record
