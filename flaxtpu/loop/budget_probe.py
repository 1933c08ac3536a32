"""The time budget's probe: the run's model and optimizer built on a provisional length, and each part of a
run timed apart (`timed`), for `time_budget.plan` to solve its number of steps from (time_budget.py's
docstring says what is timed and why)."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Callable

import jax
import ml_collections

from flaxtpu.data import loaders, workers
from flaxtpu.evaluation.evaluate import evaluate_splits, report_about, write_report
from flaxtpu.loop import signals
from flaxtpu.loop.window import TrainWindow
from flaxtpu.optimizers import swa
from flaxtpu.optimizers.optim_checks import parse_duration
from flaxtpu.settings.lengths import resolved_eval_batch_size, run_length
from flaxtpu.step import parallel, placing, steps
from flaxtpu.weights import checkpoint

PROBE_STEPS = 12  # timed warm steps at least (fewer where they would take over 3% of the budget) ...
PROBE_SHARE = 0.01  # ... and more, up to PROBE_MAX_STEPS, while they take under 1% of the budget
PROBE_MAX_STEPS = 200
PROBE_LENGTH = 1_000_000  # the provisional length the probe's optimizer is built for (its steps are dropped)


@dataclasses.dataclass
class Parts:
  """What the probe times, each a call: `timed` runs them in order."""
  init: Callable[[], None]  # the state's initialisation
  compile: Callable[[], None]  # the train step's
  step: Callable[[], None]  # dispatches one train step
  wait: Callable[[], None]  # until the steps dispatched are done
  evaluate: Callable[[], None]  # every eval split
  save: Callable[[int], None]  # starts one checkpoint save (of a step number), as the loop does
  written: Callable[[], None]  # until the save started is written
  report: Callable[[], None]  # the end's report and curves


def timed(parts: Parts, budget: float, started: float, clock: Callable[[], float] = time.time,
          eval_every: int = 0, save_every: int = 0, stopping: Callable[[], bool] = lambda: False) -> dict:
  """Seconds of each part apart: the init and compile; the first evaluation and a warm one; the first
  save and a warm one (the time the loop waits for: a save is written in the background) and the warm
  one's writing; warm steps (two untimed first), at the loop's cadence: evaluated every `eval_every`
  and saved every `save_every` steps (0: never), those evaluations' and saves' own time taken out,
  so what they cost the steps around them (a checkpoint written beside them) counts as the steps';
  the end report; the time since `started`. Once `stopping()` (a SIGTERM), the steps end and the report
  is not timed: the run stops before its first step, and a run without a checkpoint probes again."""

  def seconds(call, *args) -> float:
    began = clock()
    call(*args)
    return clock() - began

  init_s = seconds(parts.init)
  compile_s = seconds(parts.compile)
  for _ in range(2):  # warm: the first runs of a compiled step are slower
    parts.step()
    parts.wait()
  eval_first_s, eval_s = seconds(parts.evaluate), seconds(parts.evaluate)
  save_first_s = seconds(parts.save, 1)
  parts.written()
  save_s, save_write_s = seconds(parts.save, 2), seconds(parts.written)
  began, count, aside, saved = clock(), 0, 0.0, 2
  while count < PROBE_MAX_STEPS:
    parts.step()
    count += 1
    if eval_every and count % eval_every == 0:
      parts.wait()
      aside += seconds(parts.evaluate)
    if save_every and count % save_every == 0:
      parts.wait()
      saved += 1
      aside += seconds(parts.save, saved)
    if stopping():
      break
    spent = clock() - began
    if (count >= 3 and spent > 0.03 * budget) or (count >= PROBE_STEPS and spent > PROBE_SHARE * budget):
      break
  parts.wait()
  step_s = (clock() - began - aside) / count
  parts.written()
  end_s = 0.0 if stopping() else seconds(parts.report)
  return {'step_s': step_s, 'steps_timed': count, 'eval_first_s': eval_first_s, 'eval_s': eval_s,
          'save_first_s': save_first_s, 'save_s': save_s, 'save_write_s': save_write_s, 'init_s': init_s,
          'compile_s': compile_s, 'end_s': end_s, 'elapsed_s': clock() - started}


def probe(config: ml_collections.ConfigDict, dataset, mesh, eval_sets: list, started: float,
          teacher=None, teacher_variables=None) -> dict:
  """The run's parts timed (`timed`) on its model, optimizer, data and eval splits."""
  budget = parse_duration(config.time_budget)
  length = run_length(config, len(dataset.train), total_steps=PROBE_LENGTH)
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length,
                           class_weights=dataset.class_weights, teacher=teacher)
  placement = placing.place(task, mesh, config, teacher_variables)
  batches = workers.prefetch(placement.put_train_batch(tuple(batch)[:2]) for batch in loaders.train_batches(
      dataset, seed=config.seed, batch_size=config.batch_size, first_step=0,
      last_step=PROBE_MAX_STEPS + 2, process_index=jax.process_index(), process_count=jax.process_count(),
      alternate_flip=config.augment.alternate_flip))
  live: dict = {}  # the state, the compiled step, the last step's metrics, the evaluation's predictions
  window = TrainWindow(placement.to_host_metrics, first_step=1)  # the step metrics since the last 'log line'
  one_step_in_flight = parallel.one_step_in_flight()

  def init():
    live['state'] = jax.block_until_ready(placing.create_state(task, placement, config.seed))

  def compile_step():  # uncached, as the run's will be: its length is new, XLA's persistent cache has no copy
    live['batch'] = next(batches)
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update('jax_enable_compilation_cache', False)
    try:
      live['step'], _ = placement.compile_train_step(live['state'], live['batch'])
    finally:
      jax.config.update('jax_enable_compilation_cache', enabled)

  def step():  # as the loop steps: its metrics fetched and averaged every log_every_steps
    live['state'], live['metrics'] = live['step'](live['state'], live.pop('batch', None) or next(batches))
    if one_step_in_flight:
      jax.block_until_ready(live['metrics'])
    window.add(live['metrics'])
    if window.steps_added == config.log_every_steps:
      _ = {name: float(value) for name, value in window.merged().compute().items()}
      window.clear(next_step=1)

  def evaluate():  # as the loop evaluates; keeping the logits, as its last evaluation does
    state = swa.before_evaluation(config, task, placement, dataset, live['state'])
    from flaxtpu.step import bn_recompute  # pylint: disable=g-import-not-at-top
    state = bn_recompute.for_schedule_free(config, task, placement, dataset, state)
    _, live['predictions'] = evaluate_splits(placement, state, eval_sets, resolved_eval_batch_size(config),
                                             'raw', config.eval.threshold)

  with tempfile.TemporaryDirectory(prefix='flaxtpu-budget-') as directory:
    saves = checkpoint.Checkpoints(os.path.join(directory, 'run'), config)
    saves.prepare()  # as the run's saves find it: orbax imported, its manager made

    def save(step_number: int):
      saves.save(step_number, placement.to_saveable(live['state']), {'time_budget_probe': True})

    def report():  # what the run's end writes: the per-class report and pictures, the curves
      from flaxtpu.report import plots  # pylint: disable=g-import-not-at-top
      report_dir = os.path.join(directory, 'report')
      if live.get('predictions') is not None:
        write_report(live['predictions'], dataset, report_dir, threshold=config.eval.threshold,
                     about=report_about(config, 0))
      os.makedirs(report_dir, exist_ok=True)
      with open(os.path.join(report_dir, plots.METRICS_FILE), 'w') as f:
        for row in range(1, 3):
          f.write(json.dumps({'step': row, 'train_loss': 1.0 / row, 'train_accuracy': 0.5, 'eval_loss': 1.0,
                              'eval_accuracy': 0.5, 'learning_rate': 0.1, 'images_per_sec': 100.0}) + '\n')
      plots.write_curves(report_dir)

    try:
      measured = timed(Parts(init=init, compile=compile_step, step=step,
                             wait=lambda: jax.block_until_ready(live.get('metrics')), evaluate=evaluate,
                             save=save, written=saves.wait, report=report), budget, started,
                     eval_every=length.eval_every_steps, save_every=length.checkpoint_every_steps,
                     stopping=signals.requested)
    finally:
      saves.close()
      batches.close()
  return measured
