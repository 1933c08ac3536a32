"""A run's progress (latest metrics, time, memory plan) and the clock that keeps it.

As big_vision's `chrono`: the clock writes one `Progress` record as the run
goes, every checkpoint saves it and a resumed run loads it, so results.json
reports the images/s, time to first step and wall time of all the attempts
of a run, not only of the last one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Optional

import jax
import numpy as np

OPTIONAL = ('plateau', 'early_stopping', 'stopped_early')  # left out of the record while empty


@dataclasses.dataclass
class Progress:
  """The 'progress' of a checkpoint record (its JSON layout is what resumed runs read back)."""
  train: dict = dataclasses.field(default_factory=dict)  # the latest logged train metrics
  eval: dict = dataclasses.field(default_factory=dict)  # the latest evaluation's metrics
  train_seconds: float = 0.0  # time in train steps, of every attempt: no compiling, evaluating, saving
  train_steps: int = 0  # the steps those seconds cover
  # of the first attempt, from its command (process start): imports, JAX, data, init, compile, one step
  time_to_first_step_s: Optional[float] = None
  wall_time_s: Optional[float] = None  # of every attempt, from its start to its latest save
  memory_plan: dict = dataclasses.field(default_factory=dict)  # XLA's per-device plan of the train step
  plateau: Optional[dict] = None  # schedule.name=plateau: reduce_on_plateau's state (plateau.Plateau)
  # early_stopping.metric: its best value, the step of it, and the evaluations since without improvement
  early_stopping: dict = dataclasses.field(default_factory=dict)
  # where early stopping (or a study's pruner: 'pruned') ended the run: {step, metric, best, ...}
  stopped_early: Optional[dict] = None

  @classmethod
  def from_json(cls, saved: Optional[dict]) -> Progress:
    """The progress a checkpoint saved; fields it lacks (older checkpoints) take their defaults."""
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in (saved or {}).items() if name in names})

  def to_json(self) -> dict:
    """As a checkpoint record saves it; the fields of plateau and early stopping only where they are used
    (a run without them saves the layout that earlier runs did)."""
    saved = dataclasses.asdict(self)
    return {name: value for name, value in saved.items() if name not in OPTIONAL or value}

  def results(self, total_steps: int, batch_size: int) -> dict:
    """results.json of a run finished with this progress."""
    return {
        'step': self.stopped_early['step'] if self.stopped_early else total_steps,
        **self.eval,
        'train_loss': self.train.get('train_loss'),
        'train_accuracy': self.train.get('train_accuracy'),
        'train_images_per_sec': self.train_steps * batch_size / max(self.train_seconds, 1e-9),
        'wall_time_s': self.wall_time_s,
        'time_to_first_step_s': self.time_to_first_step_s,
        'memory_plan': self.memory_plan,
        **({'stopped_early': self.stopped_early} if self.stopped_early else {}),
        **({'pruned': True} if (self.stopped_early or {}).get('pruned') else {}),
    }


def _ready(outputs: Any) -> bool:
  """Whether a dispatched computation's outputs are all computed (without waiting for them)."""
  return all(leaf.is_ready() for leaf in jax.tree.leaves(outputs) if isinstance(leaf, jax.Array))


def process_start_time(fallback: float) -> float:
  """When this process started (time.time()'s clock), or `fallback` where /proc cannot tell.

  Linux: field 22 of /proc/self/stat (the start in clock ticks after boot) on the boot time that
  /proc/uptime gives to 10 ms; /proc/stat's btime would do too, but it is rounded to the second.
  """
  try:
    with open('/proc/self/stat', encoding='ascii') as f:
      stat = f.read()
    with open('/proc/uptime', encoding='ascii') as f:
      seconds_since_boot = float(f.read().split()[0])
    booted = time.time() - seconds_since_boot
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    start_ticks = int(stat[stat.rindex(')') + 2:].split()[19])
    return booted + start_ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError):
    return fallback


class TrainClock:
  """Times training steps apart from compiling, evaluating and saving, and splits a step's time.

  It writes the time into the run's `Progress`. Pauses are timed by kind
  ('eval', 'save'), so the ETA counts the evaluations and saves still to
  come. Within a lap, `input` is the time spent waiting for the next batch
  once the devices had run out of work, and `step` the time in the train step
  and waiting for its results (or for a batch while the last step still ran).
  """

  def __init__(self, first_step: int, progress: Progress, started: Optional[float] = None,
               command_started: Optional[float] = None):
    self.progress = progress
    self._started = time.time() if started is None else started  # this attempt's start
    # The command's start (`process_start_time`), which the time to the first step counts from.
    self._command_started = self._started if command_started is None else command_started
    self._first_step_done = False  # of this attempt
    self._wall_time_before = progress.wall_time_s or 0.0  # of the attempts before this one
    self._lap_start, self._lap_step = time.time(), first_step
    self.seconds_per_step = 0.0
    self._pauses: dict[str, list[float]] = {}
    self._split = {'input': 0.0, 'step': 0.0}

  @contextlib.contextmanager
  def paused(self, kind: str = '', state=None):
    jax.block_until_ready(state)  # charge the steps already queued to training, not to the pause
    paused_at = time.time()
    yield
    seconds = time.time() - paused_at
    self._lap_start += seconds
    self._pauses.setdefault(kind, []).append(seconds)

  @contextlib.contextmanager
  def timing(self, part: str, in_flight: Any = None):
    """Charges the time inside to `part` ('input' or 'step') of the current lap.

    Waiting for input while the step dispatched before (`in_flight`, its outputs) still runs on the
    devices is charged to 'step': the next step could not have started sooner. Only a wait that
    outlasts that step counts as input (all of it: an upper bound of the devices' idle time).
    """
    started = time.time()
    yield
    if part == 'input' and in_flight is not None and not _ready(in_flight):
      part = 'step'
    self._split[part] += time.time() - started

  def step_done(self, step_metrics: Any, wait: bool) -> None:
    """After a train step is dispatched: waits for it where `wait` (and for the first, to time it)."""
    first = not self._first_step_done
    if wait or first:
      jax.block_until_ready(step_metrics)
    if first:  # every attempt logs its start-up; the record keeps the first attempt's
      self._first_step_done, now = True, time.time()
      logging.info('first step done %.1f s after the command (%.1f s after training started: model, '
                   'restore, compile; the data too unless read before)', now - self._command_started,
                   now - self._started)
      if self.progress.time_to_first_step_s is None:
        self.progress.time_to_first_step_s = now - self._command_started

  def lap(self, step: int, batch_size: int) -> tuple[float, dict[str, float]]:
    """Images/s since the last lap and the share of its time each part took."""
    seconds, steps_done = time.time() - self._lap_start, step - self._lap_step
    self.progress.train_seconds += seconds
    self.progress.train_steps += steps_done
    self.seconds_per_step = seconds / max(steps_done, 1)
    shares = {part: spent / max(seconds, 1e-9) for part, spent in self._split.items()}
    shares['other'] = max(0.0, 1.0 - sum(shares.values()))
    self._lap_start, self._lap_step = time.time(), step
    self._split = dict.fromkeys(self._split, 0.0)
    return steps_done * batch_size / max(seconds, 1e-9), shares

  def eta(self, step: int, length) -> float:
    """Seconds left: the train steps, and the evaluations and saves they still pass."""

    def still_to_come(every: int) -> int:  # multiples of `every` after `step`, plus the final one
      total = length.total_steps
      return total // every - step // every + (1 if total % every and step < total else 0)

    mean = lambda kind: float(np.mean(self._pauses[kind])) if self._pauses.get(kind) else 0.0
    return ((length.total_steps - step) * self.seconds_per_step
            + still_to_come(length.eval_every_steps) * mean('eval')
            + still_to_come(length.checkpoint_every_steps) * mean('save'))

  def record(self) -> Progress:
    """The progress now, its wall time brought up to date (for a checkpoint or results.json)."""
    self.progress.wall_time_s = self._wall_time_before + time.time() - self._started
    return self.progress
