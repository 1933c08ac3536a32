"""Orbax checkpoints under WORKDIR/checkpoints: async saves, latest N + best, restore onto any mesh.

A checkpoint holds the whole train state (params, optimizer state, BatchNorm
statistics, step, RNG key) and a JSON record of the resolved config and the
data position. Orbax writes each step into a temporary directory and renames
it when complete, so a step that is listed is a step that restores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Optional, TypeVar

import jax
import ml_collections

from flaxtpu.io import files, storage
from flaxtpu.settings.errors import CheckpointError
from flaxtpu.settings.metric_names import best_metric
from flaxtpu.weights.saved import complete_steps as _complete_steps
from flaxtpu.weights.saved import pick_step


@functools.cache
def orbax_checkpoint():
  """`orbax.checkpoint`, imported on first use with flaxtpu's two adjustments below.

  Its import took 1.8 s on a TPU v5e host: a new run needs it only for its first save, so it is
  imported after the first step (`Checkpoints.prepare_in_background`).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top
  # orbax cuts every replicated array into one slice per device to spread the
  # writes ("replica parallel"): one small device op per slice, on the training
  # thread. For classification-sized states that makes save() block for seconds
  # (benchmarks/device/checkpoint_cost.py); one writer per array blocks for milliseconds.
  ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
  if hasattr(asyncio_utils, '_run_sync_via_new_loop'):  # the orbax version this was written for
    asyncio_utils._run_sync_via_new_loop = _run_sync_then_drain  # pylint: disable=protected-access
  return ocp


def _run_sync_then_drain(coroutine):
  """orbax's run_sync loop, closed only once every task on it has finished.

  orbax reads and writes the arrays of a checkpoint as one asyncio.gather of
  TensorStore futures. When one fails (a missing manifest, a full disk), the
  gather raises at once and orbax closed its loop while the other reads were
  still in flight: each of them then completed into the closed loop and
  TensorStore printed a 'RuntimeError: Event loop is closed' traceback (4 in
  an eval, 46 in a resume). Letting them finish first keeps the error and
  drops the noise.
  """
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coroutine)
  finally:
    try:
      if pending := asyncio.all_tasks(loop):
        # Bounded: a read that never ends (a lost peer in a cluster) is cancelled, not waited on.
        loop.run_until_complete(asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True),
                                                 timeout=60))
    except asyncio.TimeoutError:
      pass
    finally:
      asyncio.set_event_loop(None)
      loop.close()



class UnreadableCheckpoint(CheckpointError):
  """A listed checkpoint whose files cannot be read (truncated, corrupted): an earlier one may be."""


class VanishedCheckpoint(UnreadableCheckpoint):
  """A listed checkpoint deleted while it was read: a live run rotated it away (checkpoint.keep)."""


# A live run deletes a rotated step right after saving a newer one; its files go before its directory.
VANISH_GRACE_S = 2.0
MAX_RELISTS = 20


UNREADABLE_SUFFIX = '.unreadable'  # an unreadable step directory is renamed aside, never deleted

T = TypeVar('T')  # what a policy's `read(step)` returns


class Checkpoints:
  """Saves and restores train states; one per workdir."""

  def __init__(self, workdir: str, config: ml_collections.ConfigDict, *, read_only: bool = False):
    self.directory = files.absolute(os.path.join(workdir, 'checkpoints'))
    if read_only and not files.isdir(self.directory):
      raise CheckpointError(f'no checkpoints in {self.directory}; train first with the same '
                            '--workdir (or point --workdir at a finished run)')
    self._best_metric = best_metric(config)
    self._keep, self._best_mode = config.checkpoint.keep, config.checkpoint.best_mode
    self._read_only = read_only
    self._made: Optional[Any] = None  # orbax's CheckpointManager, made on first use
    self._making = threading.Lock()
    if jax.process_count() > 1:  # made where every process makes it: orbax's own steps stay in step
      self._make()
    elif not read_only:
      # As orbax's manager would: a run that has started has its checkpoints folder (eval, predict
      # and export tell a trained run from published weights by it).
      files.makedirs(self.directory)

  @property
  def _manager(self):
    return self._make()

  def _make(self):
    """orbax's CheckpointManager, made (and orbax imported) by the first caller."""
    with self._making:
      if self._made is None:
        ocp = orbax_checkpoint()
        policies, metric = ocp.checkpoint_managers, self._best_metric
        preserve = [policies.LatestN(self._keep)]
        if metric:
          # BestN sorts by the metric and keeps the end of the list: ascending for 'max'.
          preserve.append(policies.BestN(get_metric_fn=lambda metrics: metrics[metric],
                                         reverse=self._best_mode == 'min', n=1,
                                         keep_checkpoints_without_metrics=False))
        self._made = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                preservation_policy=policies.AnyPreservationPolicy(preserve),
                best_fn=(lambda metrics: metrics[metric]) if metric else None,
                best_mode=self._best_mode,
                read_only=self._read_only,
                enable_async_checkpointing=True,
            ))
      return self._made

  def prepare(self) -> None:
    """Imports orbax and makes its manager now."""
    self._make()

  def prepare_in_background(self) -> None:
    """Imports orbax and makes its manager in a thread, ahead of the first save (a run calls this once
    its first step is done: until then nothing needs them). Several processes made it already."""
    if self._made is None:
      threading.Thread(target=self._make, name='flaxtpu-checkpoints', daemon=True).start()

  def save(self, step: int, state: Any, record: dict, metrics: Optional[dict] = None) -> None:
    """Starts an asynchronous save; training continues while it is written.

    A save that fails (disk full, permissions) raises CheckpointError, here or
    from the next save()/wait(); orbax renames a step into place only when it
    is complete, so the checkpoints before it stay intact.
    """
    if self._best_metric and metrics is not None and self._best_metric not in metrics:
      metrics = None
    manager, ocp = self._manager, orbax_checkpoint()
    with self._save_errors(step):
      manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       record=ocp.args.JsonSave(record)),
                         metrics=metrics, force=True)
    self._saving_step = step

  def is_saving(self) -> bool:
    """Whether an asynchronous save is still being written."""
    return self._made is not None and self._made.is_saving_in_progress()

  def wait(self) -> None:
    if (made := self._made_so_far()) is None:  # nothing was saved
      return
    with self._save_errors(getattr(self, '_saving_step', None)):
      made.wait_until_finished()

  @contextlib.contextmanager
  def _save_errors(self, step: Optional[int]):
    """A failed save as one CheckpointError naming the step that failed and the one that is intact.

    orbax reports an asynchronous save's failure from the next save() or wait():
    the failed step is then the earlier one, which never became a complete directory.
    """
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      complete = sorted(_complete_steps(self.directory))
      pending = getattr(self, '_saving_step', None)
      failed = pending if pending is not None and pending not in complete else step
      kept = [s for s in complete if s != failed]
      intact = f'checkpoint step {max(kept)} is intact' if kept else 'no earlier checkpoint exists'
      # The fix by the cause: a refusing disk, or a bucket (or its emulator) that stopped answering.
      fix = ('free disk space or fix permissions' if files.storage_error(e) is not None else
             'check the connection to the bucket (or the emulator STORAGE_EMULATOR_HOST names)'
             if storage.is_remote(self.directory) else 'fix the cause')
      raise CheckpointError(
          f'saving checkpoint step {failed} in {self.directory} failed ({files.short_error(e)}); {intact}; '
          f'{fix}, then run the same command to resume') from e

  def close(self) -> None:
    if (made := self._made_so_far()) is not None:  # nothing to close where nothing was made
      made.close()

  def _made_so_far(self):
    """The manager, once a thread making it has (None where none was started)."""
    with self._making:
      return self._made

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    if self._made is None:  # before the manager is made, it would read the same directory: no orbax yet
      return max(_complete_steps(self.directory), default=None)
    return self._made.latest_step()

  def best_step(self) -> Optional[int]:
    return self._manager.best_step()

  def resolve(self, which: str, key: str = 'eval.checkpoint') -> int:
    """'latest' | 'best' | a step number -> a step that exists, or CheckpointError naming config.`key`."""
    return pick_step(self.directory, which, key, self.all_steps(), self.best_step)

  def read_record(self, step: int) -> dict:
    """The JSON record saved with `step` (config, classes, data position, progress)."""
    try:
      ocp = orbax_checkpoint()
      return self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))['record']
    except Exception as e:  # pylint: disable=broad-except
      self._raise_if_vanished(step, e)
      raise UnreadableCheckpoint(f'checkpoint {self._path(step)} cannot be read ({_first_line(e)})') from e

  def restore(self, step: int, target: Any, expected: Optional[dict] = None, *,
              config: Optional[ml_collections.ConfigDict] = None, subset: bool = False) -> tuple[Any, dict]:
    """Restores `step` into the shapes and shardings of `target` (any mesh): (arrays, record).

    `target` is what to read: the whole saved state (every field must match),
    or with `subset` any part of it (a `ModelState` for inference, `{'ema': ...}`,
    a nested dict of some parameters). `expected` holds record fields (model,
    num_classes, image_shape) that must match; a mismatch is reported by name
    instead of as a shape error. When the arrays do not fit, the keys of
    `config` that changed since the checkpoint was written are named.
    """
    path = self._path(step)
    record = self.read_record(step)
    for key, value in (expected or {}).items():
      saved = record.get(key, RECORD_DEFAULTS.get(key))
      if saved != value:
        raise CheckpointError(f'checkpoint {path} has {key}={saved!r} but the config '
                              f'gives {value!r}; use a matching config or another --workdir')
    ocp = orbax_checkpoint()
    try:
      with ocp.PyTreeCheckpointer() as reader:
        arrays = reader.restore(os.path.join(path, 'state'), args=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=subset))
    except Exception as e:  # pylint: disable=broad-except
      self._raise_if_vanished(step, e)  # before blaming the config: a half-deleted step fits nothing
      # Only model and optimizer keys shape the saved arrays (an inference restore reads no optimizer).
      shaping = ('model.', 'ema.decay', 'swa.every', *(() if subset else ('optimizer.',)))
      changed = [change for change in changed_keys(record.get('config', {}), config.to_dict())
                 if change.startswith(shaping)] if config else []
      if changed:
        raise CheckpointError(
            f'checkpoint {path} was written with other settings ({", ".join(changed)}) and its '
            'arrays do not fit this config; train with the original values or use another '
            '--workdir') from e
      raise UnreadableCheckpoint(f'checkpoint {path} cannot be restored ({_first_line(e)})') from e
    logging.info('restored checkpoint step %d from %s', step, path)
    return arrays, record

  def restore_train_state(self, step: int, abstract_state: Any, expected: dict,
                          config: ml_collections.ConfigDict) -> tuple[Any, dict]:
    """The whole train state at `step`: (state, record), read as `restore` reads.

    A run without an EMA (or SWA) also resumes a checkpoint that differs from
    it in the EMA (SWA) only: one written before flaxtpu had it (no `ema` or
    `swa` field), or one of a run that turned it off (read and dropped).
    Every other field is restored strictly: any other difference still fails.
    """
    unused = [name for name in ('ema', 'swa') if getattr(abstract_state, name) == {}]
    try:
      return self.restore(step, abstract_state, expected, config=config)
    except CheckpointError as e:
      if not unused or isinstance(e, VanishedCheckpoint) or not isinstance(e.__cause__, ValueError):
        raise
    fields = {field.name: getattr(abstract_state, field.name) for field in dataclasses.fields(abstract_state)}
    metadata, model = self._metadata(step), {'params': abstract_state.params,
                                             'batch_stats': abstract_state.batch_stats}
    saved_as = {'ema': model, 'swa': {**model, 'count': abstract_state.step}}  # (count: an int32 scalar)
    for name in unused:
      if name not in metadata:
        del fields[name]
      elif metadata[name]:
        fields[name] = saved_as[name]
    arrays, record = self.restore(step, fields, expected, config=config)
    logging.info('checkpoint %s: its %s (or its lack of one) is not used by this run', self._path(step),
                 ' and '.join(name.upper() for name in unused))
    return abstract_state.replace(**{**arrays, **{name: {} for name in unused}}), record

  def restore_newest_readable(self, target: Any, expected: dict, **options) -> tuple[int, Any, dict]:
    """`restore` of the newest readable step: (step, arrays, record); `options` as `newest_readable`."""
    step, (arrays, record) = self.newest_readable(
        lambda step: self.restore(step, target, expected), **options)
    return step, arrays, record

  def restore_which(self, which: str, read: Callable[[int], T]) -> tuple[int, T]:
    """'latest' | 'best' | a step number -> (step, `read(step)`).

    'latest' falls back past unreadable steps (newest_readable); a 'best' step
    that a live run replaced and deleted while it was read is looked up again;
    a named step that was deleted is an error.
    """
    if which == 'latest':
      return self.newest_readable(read)
    for _ in range(MAX_RELISTS):
      step = self.resolve(which)
      try:
        return step, read(step)
      except VanishedCheckpoint as e:
        if which != 'best':
          raise CheckpointError(f'{e}; evaluate a step it still keeps (saved steps: '
                                f'{_complete_steps(self.directory)}) or latest') from e
        self._manager.reload()
    raise CheckpointError(f'the best checkpoint in {self.directory} was replaced faster than it could be '
                          f'read ({MAX_RELISTS} tries); evaluate it once the run has finished')

  def newest_readable(self, read: Callable[[int], T], newest: Optional[int] = None,
                      set_aside: bool = False) -> tuple[int, T]:
    """(step, `read(step)`) of the newest step (at most `newest`) that `read` can read.

    An unreadable step (truncated or corrupted files: `read` raised
    UnreadableCheckpoint) is named in the log and the next older one is tried.
    With `set_aside` (training), the unreadable steps are renamed
    STEP.unreadable once a readable one is found, so the run can save those
    step numbers again; nothing is ever deleted. A checkpoint from another
    config is an error, not a reason to fall back. A step that a live run
    deletes while it is read (rotation) is no damage: the steps are listed
    again and the newest is read.
    """
    unreadable: list[tuple[int, Exception]] = []  # the damaged steps, across listings
    for _ in range(MAX_RELISTS):
      try:
        return self._newest_listed(read, newest, set_aside, unreadable)
      except VanishedCheckpoint as e:  # a live run rotated it away: its newer steps are on disk now
        logging.info('%s; listing the checkpoints again', e)
        self._manager.reload()
    raise CheckpointError(f'the checkpoints in {self.directory} were deleted faster than they could be '
                          f'read ({MAX_RELISTS} tries); save less often (checkpoint_every_steps) or keep '
                          'more (checkpoint.keep)')

  def _newest_listed(self, read: Callable[[int], T], newest: Optional[int], set_aside: bool,
                     unreadable: list) -> tuple[int, T]:
    """newest_readable over one listing."""
    damaged = {s for s, _ in unreadable}
    candidates = sorted((s for s in self.all_steps() if (newest is None or s <= newest) and s not in damaged),
                        reverse=True)
    for step in candidates:
      try:
        result = read(step)
      except VanishedCheckpoint:
        raise
      except UnreadableCheckpoint as e:
        logging.warning('%s; falling back to an earlier checkpoint', e)
        unreadable.append((step, e))
        continue
      if unreadable:
        logging.warning('restored step %d, the newest readable checkpoint (unreadable: %s)', step,
                        ', '.join(str(s) for s, _ in unreadable))
        if set_aside:
          self._set_aside([s for s, _ in unreadable])
      return step, result
    if unreadable:
      steps = ', '.join(str(s) for s, _ in unreadable)
      raise CheckpointError(f'no checkpoint in {self.directory} can be read (steps {steps}; newest: '
                            f'{unreadable[0][1]}); nothing was deleted; restore the files or use '
                            'another --workdir')
    raise CheckpointError(f'no complete checkpoint in {self.directory}; train first with the same '
                          '--workdir')

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _raise_if_vanished(self, step: int, error: Exception) -> None:
    """VanishedCheckpoint if `step` failed to read because it was deleted meanwhile, not damaged.

    A live trainer deletes a rotated step only after a newer one is complete:
    then a still present directory is given a moment to go. Without a newer
    step the directory is looked at once.
    """
    path = self._path(step)
    newer = any(s > step for s in _complete_steps(self.directory))
    deadline = time.monotonic() + (VANISH_GRACE_S if newer else 0.0)
    while files.isdir(path):
      if time.monotonic() >= deadline:
        return
      time.sleep(0.05)
    raise VanishedCheckpoint(f'checkpoint {path} was deleted while it was read ({_first_line(error)}): '
                             'the run in this workdir keeps only its newest checkpoint.keep steps') from error

  def _metadata(self, step: int):
    """The saved state's tree of array metadata (shapes, dtypes), read without the arrays."""
    path = os.path.join(self._path(step), 'state')
    from etils import epath  # pylint: disable=g-import-not-at-top  # orbax's path type, with orbax
    handler = orbax_checkpoint().PyTreeCheckpointHandler()
    try:
      return handler.metadata(epath.Path(path))
    except Exception as e:  # pylint: disable=broad-except
      raise UnreadableCheckpoint(f'checkpoint {path} cannot be read ({_first_line(e)})') from e
    finally:
      handler.close()

  def array_shapes(self, step: int, collections: tuple[str, ...]) -> dict[str, dict[str, tuple]]:
    """{collection: {'/'-joined array path: shape}} of the state saved at `step`, read from metadata only."""
    metadata = self._metadata(step)
    shapes = {}
    for collection in collections:
      leaves = jax.tree_util.tree_leaves_with_path(metadata[collection]) if collection in metadata else []
      shapes[collection] = {'/'.join(str(key.key) for key in keys): tuple(leaf.shape)
                            for keys, leaf in leaves}
    return shapes

  def _set_aside(self, steps: list[int]) -> None:
    if jax.process_index() == 0:
      for step in steps:
        path = self._path(step)
        files.rename(path, path + UNREADABLE_SUFFIX)
        logging.warning('renamed unreadable checkpoint %s to %s', path, path + UNREADABLE_SUFFIX)
    self._manager.reload()


# What a record written before a field existed meant by its absence.
RECORD_DEFAULTS = {'task': 'multiclass'}


def expected_record(config: ml_collections.ConfigDict, num_classes: int,
                    image_shape: tuple[int, ...]) -> dict:
  """The record fields a checkpoint must match to restore into this config's model: the same arrays
  (model, classes, image shape) and the same meaning of its logits (`task`: softmax or sigmoids)."""
  return {'model': config.model.name, 'num_classes': num_classes, 'image_shape': list(image_shape),
          'task': config.task}


def changed_keys(saved: dict, current: dict) -> list[str]:
  """`key=old -> new` for every leaf that differs between two config dicts (`changed_values`)."""
  return [f'{key}={old!r} -> {new!r}' for key, (old, new) in changed_values(saved, current).items()]


def changed_values(saved: dict, current: dict, prefix: str = '',
                   defaults: Optional[dict] = None) -> dict[str, tuple]:
  """{key: (saved value, current value)} of every leaf that differs between two config dicts.

  A key the saved config lacks was added to flaxtpu after it was written: the
  run had its default, so it is a change only where the current value differs
  from the default.
  """
  if defaults is None:
    from flaxtpu.settings import defaults as defaults_module  # pylint: disable=g-import-not-at-top
    defaults = defaults_module.get_config().to_dict()
  changes = {}
  for key in sorted(set(saved) | set(current)):
    if key not in saved and key not in defaults:
      continue
    old, new = saved.get(key, defaults.get(key)), current.get(key)
    if isinstance(old, dict) and isinstance(new, dict):
      changes.update(changed_values(old, new, f'{prefix}{key}.', defaults.get(key) or {}))
    elif isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):  # JSON keeps tuples as lists
      if list(old) != list(new):
        changes[f'{prefix}{key}'] = (old, new)
    elif old != new:
      changes[f'{prefix}{key}'] = (old, new)
  return changes


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return f'{type(error).__name__}: {text.splitlines()[0]}' if text else type(error).__name__
