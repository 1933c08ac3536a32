"""`config.profile_steps`: a few train steps traced with jax.profiler into WORKDIR/profile."""

from __future__ import annotations

import logging
import os

import jax

from flaxtpu.io import files
from flaxtpu.loop.progress import TrainClock


class StepProfiler:
  """`profile_steps` steps traced with jax.profiler into WORKDIR/profile, after warm-up steps."""
  WARMUP_STEPS = 5

  def __init__(self, workdir: str, first_step: int, num_steps: int, total_steps: int):
    self.directory = os.path.join(workdir, 'profile')
    self._trace_dir = files.LocalStage(self.directory)  # on gs://: traced locally, uploaded at the end
    start = min(first_step + self.WARMUP_STEPS, max(first_step, total_steps - num_steps))
    self._steps = range(start + 1, min(start + num_steps, total_steps) + 1) if num_steps else range(0)
    self._tracing = False

  def before_step(self, step: int) -> None:
    if self._steps and step == self._steps.start:
      jax.profiler.start_trace(self._trace_dir.local, create_perfetto_trace=True)
      self._tracing = True

  def after_step(self, step: int, state, clock: TrainClock) -> None:
    if self._tracing and step == self._steps[-1]:
      with clock.paused('profile'):  # writing the trace is not training time
        self.stop(state)

  def stop(self, state=None) -> None:
    """Ends the trace once the steps queued for `state` have run (where one is in progress)."""
    if self._tracing:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self._trace_dir.publish()
      self._tracing = False
      logging.info('profile of steps %d-%d in %s: open it with `tensorboard --logdir %s` (Profile '
                   'tab) or the *.trace.json.gz in https://ui.perfetto.dev', self._steps.start,
                   self._steps[-1], self.directory, self.directory)
