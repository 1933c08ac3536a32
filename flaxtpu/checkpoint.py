"""Orbax checkpoints under WORKDIR/checkpoints: async saves, latest N + best, restore onto any mesh.

A checkpoint holds the whole train state (params, optimizer state, BatchNorm
statistics, step, RNG key) and a JSON record of the resolved config and the
data position. Orbax writes each step into a temporary directory and renames
it when complete, so a step that is listed is a step that restores.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import jax
import ml_collections
import orbax.checkpoint as ocp

from flaxtpu.errors import UserError

policies = ocp.checkpoint_managers

# orbax cuts every replicated array into one slice per device to spread the
# writes ("replica parallel"): one small device op per slice, on the training
# thread. For classification-sized states that makes save() block for seconds
# (benchmarks/checkpoint_cost.py); one writer per array blocks for milliseconds.
ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)


class CheckpointError(UserError):
  """A checkpoint that is missing, incomplete, or from another model."""


class Checkpoints:
  """Saves and restores train states; one per workdir."""

  def __init__(self, workdir: str, config: ml_collections.ConfigDict, *, read_only: bool = False):
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints'))
    preserve = [policies.LatestN(config.checkpoint.keep)]
    metric = config.checkpoint.best_metric
    if metric:
      # BestN sorts by the metric and keeps the end of the list: ascending for 'max'.
      preserve.append(policies.BestN(get_metric_fn=lambda metrics: metrics[metric],
                                     reverse=config.checkpoint.best_mode == 'min', n=1,
                                     keep_checkpoints_without_metrics=False))
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f'no checkpoints in {self.directory}; train first with the same '
                            '--workdir (or point --workdir at a finished run)')
    self._best_metric = metric
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(preserve),
            best_fn=(lambda metrics: metrics[metric]) if metric else None,
            best_mode=config.checkpoint.best_mode,
            read_only=read_only,
            enable_async_checkpointing=True,
        ))

  def save(self, step: int, state: Any, record: dict, metrics: Optional[dict] = None) -> None:
    """Starts an asynchronous save; training continues while it is written."""
    if self._best_metric and metrics is not None and self._best_metric not in metrics:
      metrics = None
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     record=ocp.args.JsonSave(record)),
                       metrics=metrics, force=True)

  def is_saving(self) -> bool:
    """Whether an asynchronous save is still being written."""
    return self._manager.is_saving_in_progress()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def best_step(self) -> Optional[int]:
    return self._manager.best_step()

  def resolve(self, which: str) -> int:
    """'latest' | 'best' | a step number -> a step that exists, or CheckpointError."""
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f'no complete checkpoint in {self.directory}; train first with the '
                            'same --workdir')
    if which == 'latest':
      return max(steps)
    if which == 'best':
      best = self.best_step()
      if best is None:
        raise CheckpointError(f'no checkpoint in {self.directory} has metrics to pick the best '
                              'from; use --config.eval.checkpoint=latest')
      return best
    if not which.isdigit() or int(which) not in steps:
      raise CheckpointError(f'config.eval.checkpoint={which!r} is not a saved step in '
                            f'{self.directory}; saved steps: {steps} (or latest, best)')
    return int(which)

  def read_record(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))['record']

  def restore(self, step: int, abstract_state: Any, expected: dict,
              config: Optional[ml_collections.ConfigDict] = None,
              partial: bool = False) -> tuple[Any, dict]:
    """Restores `step` into the shapes and shardings of `abstract_state` (any mesh).

    `expected` holds record fields (model, num_classes, image_shape) that must
    match; a mismatch is reported by name instead of as a shape error. When
    the arrays do not fit, the config keys that changed since the checkpoint
    was written are named. `partial` restores only the fields of
    `abstract_state` (a `ModelState` for inference: no optimizer needed).
    """
    path = os.path.join(self.directory, str(step))
    try:
      record = self.read_record(step)
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'checkpoint {path} cannot be read ({_first_line(e)}); delete it to '
                            'fall back to an earlier one') from e
    for key, value in expected.items():
      if record.get(key) != value:
        raise CheckpointError(f'checkpoint {path} has {key}={record.get(key)!r} but the config '
                              f'gives {value!r}; use a matching config or another --workdir')
    try:
      state = self._restore_state(path, step, abstract_state, partial)
    except Exception as e:  # pylint: disable=broad-except
      # Only model and optimizer keys shape the saved arrays (an inference restore reads no optimizer).
      shaping = ('model.',) if partial else ('model.', 'optimizer.')
      changed = [change for change in changed_keys(record.get('config', {}), config.to_dict())
                 if change.startswith(shaping)] if config else []
      if changed:
        raise CheckpointError(
            f'checkpoint {path} was written with other settings ({", ".join(changed)}) and its '
            'arrays do not fit this config; train with the original values or use another '
            '--workdir') from e
      raise CheckpointError(f'checkpoint {path} cannot be restored ({_first_line(e)}); delete it '
                            'to fall back to an earlier one') from e
    logging.info('restored checkpoint step %d from %s', step, path)
    return state, record

  def _restore_state(self, path: str, step: int, abstract_state: Any, partial: bool) -> Any:
    if not partial:
      return self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))['state']
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
    with ocp.PyTreeCheckpointer() as reader:
      return reader.restore(os.path.join(path, 'state'), args=ocp.args.PyTreeRestore(
          abstract_state, restore_args=restore_args, partial_restore=True))


def expected_record(config: ml_collections.ConfigDict, num_classes: int,
                    image_shape: tuple[int, ...]) -> dict:
  """The record fields a checkpoint must match to restore into this config's model."""
  return {'model': config.model.name, 'num_classes': num_classes, 'image_shape': list(image_shape)}


def changed_keys(saved: dict, current: dict, prefix: str = '') -> list[str]:
  """`key=old -> new` for every leaf that differs between two config dicts."""
  changes = []
  for key in sorted(set(saved) | set(current)):
    old, new = saved.get(key), current.get(key)
    if isinstance(old, dict) and isinstance(new, dict):
      changes += changed_keys(old, new, f'{prefix}{key}.')
    elif old != new:
      changes.append(f'{prefix}{key}={old!r} -> {new!r}')
  return changes


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return f'{type(error).__name__}: {text.splitlines()[0]}' if text else type(error).__name__
