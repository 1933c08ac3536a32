"""The training loop: a config and a workdir in; checkpoints, metrics and results.json out.

Read top to bottom: the helpers (stopping on a signal, how a finished run
is completed), then `train_and_evaluate`: data -> model -> restore -> the
loop, whose periodic actions (`_Loop.log`, `_Loop.evaluate`, `_Loop.save`)
are methods of what they share. Where a run starts (a fresh state or its
checkpoint, and what a checkpoint records) is in `start.py`; the train
metrics since the last log line in `window.py`; the step functions and their
placement on the devices in `steps.py` and `placing.py`; the progress record and its clock in
`progress.py`; what reads each evaluation in `early_stopping.py` and
`plateau.py`; a NaN loss in `divergence.py`; the profiler in `profiling.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import time
from typing import Any, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from flaxtpu.augmentation import image_sizes
from flaxtpu.data import loaders, pipeline, sampling, workers
from flaxtpu.data.memory import check_device, check_host
from flaxtpu.data.spec import saved_config
from flaxtpu.evaluation import fewshot
from flaxtpu.evaluation.evaluate import evaluate_splits, report_about, write_report
from flaxtpu.io import (
  files,
  lock,
  metrics,
  tracking,
  writers,
)
from flaxtpu.loop import (
  budget_probe,
  divergence,
  early_stopping,
  time_budget,
)
from flaxtpu.loop.divergence import Diverged, TrainingDiverged
from flaxtpu.loop.profiling import StepProfiler
from flaxtpu.loop.progress import TrainClock
from flaxtpu.loop.pruning import Pruning, log_pruned
from flaxtpu.loop.run_log import log_plan, log_run_overview
from flaxtpu.loop.signals import StopRequest
from flaxtpu.loop.start import Start, checkpoint_record, load_teacher, start_or_resume
from flaxtpu.loop.window import TrainWindow
from flaxtpu.optimizers import (
  optim,
  swa,
)
from flaxtpu.optimizers.plateau import Plateau
from flaxtpu.report import plots
from flaxtpu.settings.lengths import RunLength, resolved_eval_batch_size, run_length
from flaxtpu.settings.metric_names import early_stopping_metric
from flaxtpu.step import (
  bn_recompute,
  compile_plan,
  parallel,
  placing,
  remat_choice,
  steps,
)
from flaxtpu.weights import checkpoint


def stop_requested(stop: StopRequest, check_all_processes: bool) -> bool:
  """Whether to stop now; UserError where the stop is an abort (a lost lease: nothing may be saved).
  With many processes they must agree on the step, so a signal or an abort is only acted on where
  `check_all_processes` (a collective every process reaches) is set."""
  if jax.process_count() == 1:
    stop.raise_if_aborted()
    return stop.signal_name is not None
  if not check_all_processes:
    return False
  flags = multihost_utils.process_allgather(np.array([stop.signal_name is not None,
                                                      stop.abort_reason is not None]))
  if np.any(flags[..., 1]):
    stop.abort(stop.abort_reason or 'process 0 lost the workdir\'s lease; see its error line')
    stop.raise_if_aborted()
  return bool(np.any(flags[..., 0]))


def finish_trained_run(config: ml_collections.ConfigDict, placement: placing.Placement, start: Start,
                       checkpoints: checkpoint.Checkpoints, dataset: pipeline.Dataset, eval_sets: list,
                       length: RunLength, workdir: str, pictures: bool = True) -> dict:
  """A run whose checkpoint is at its last step: what a kill after that save left unwritten
  (results.json, the per-class report and curves) is rebuilt from the checkpoint."""
  checkpoints.close()
  results_path = os.path.join(workdir, 'results.json')
  results = files.read_json(results_path) or start.progress.results(length.total_steps, config.batch_size)
  if jax.process_index() == 0:
    files.write_json(results_path, results)
  if pictures and jax.process_count() == 1 and not files.exists(os.path.join(workdir, 'per_class.csv')):
    _, predictions = evaluate_splits(placement, start.state, eval_sets[:1],
                                     resolved_eval_batch_size(config), report_weights(config),
                                     config.eval.threshold)
    write_pictures(config, predictions, dataset, workdir, start.step)
  logging.info('already trained to step %d; results in %s', start.step, results_path)
  return results


def report_weights(config: ml_collections.ConfigDict) -> str:
  """The weights the per-class report of a finished run shows: 'swa', 'ema' or 'raw'."""
  return swa.weights_name(config.eval)


def write_pictures(config: ml_collections.ConfigDict, predictions, dataset: pipeline.Dataset, workdir: str,
                   step: int) -> None:
  """Pictures of the finished run: per-class report and calibration of the eval split (multilabel:
  and the thresholds that predict uses), curves."""
  write_report(predictions, dataset, workdir, threshold=config.eval.threshold,
               about=report_about(config, step))
  logging.info('curves: %s', plots.write_curves(workdir))


class _Closing(contextlib.ExitStack):
  """What a run must close, closed in reverse order at its end, also when it diverged.

  After an error only with one process (with many, waiting could wait on a
  peer that waits on this one), and then the error that stopped the run stays
  the one reported: a failure to close is dropped.
  """

  def __exit__(self, kind, error, traceback) -> bool:
    if kind is None or issubclass(kind, Diverged):
      return super().__exit__(kind, error, traceback)
    if jax.process_count() == 1:
      with contextlib.suppress(Exception):
        super().__exit__(kind, error, traceback)
    return False


@dataclasses.dataclass
class _Loop:
  """What the loop's periodic actions share: the run's parts, the clock and its progress."""
  config: ml_collections.ConfigDict
  task: steps.Task
  placement: placing.Placement
  dataset: pipeline.Dataset
  eval_sets: list  # (split name, dataset) pairs; the first is the eval split
  length: RunLength
  checkpoints: checkpoint.Checkpoints
  writer: Any
  clock: TrainClock
  start: Start
  window: TrainWindow  # the train metrics since the last log line
  last_log_time: float = dataclasses.field(default_factory=time.time)
  last_save_time: float = dataclasses.field(default_factory=time.time)  # or the loop's start
  predictions: Any = None  # the last evaluation's logits and labels, for the per-class report
  probe: Optional[fewshot.Probe] = None  # eval.fewshot's linear probes, run with every evaluation
  pruning: Optional[Pruning] = None  # a study's trial: each evaluation reported to its pruner
  budget: time_budget.Budget = dataclasses.field(default_factory=time_budget.Budget)  # its one check
  step_ahead: Optional[placing.StepAhead] = None  # the first train step, compiling while the state was made

  def due(self, step: int, every: int) -> bool:
    """Whether an action taken every `every` steps (and after the last) is due after `step`."""
    return step % every == 0 or step == self.length.total_steps

  def log_due(self, step: int) -> bool:
    # Seconds-triggered progress lines need every process to agree on the step: one process only.
    every_secs = self.config.log_every_secs if jax.process_count() == 1 else 0.0
    return self.due(step, self.config.log_every_steps) or bool(
        every_secs and time.time() - self.last_log_time >= every_secs)

  def compile(self, state, batch, size: int = 0):
    """The train step compiled ahead of time for `batch` (resized to `size`: augment.train_sizes); its
    memory plan logged, checked and kept."""
    placement = self.placement if not size else placing.place(
        image_sizes.sized_task(self.task, size), self.placement.mesh, self.config, *self.placement.frozen)
    ahead, self.step_ahead = self.step_ahead, None
    with self.clock.paused('compile', state):
      compiled = ahead.result_for(batch) if ahead is not None and not size else None
      train_step, self.clock.progress.memory_plan = compiled or placement.compile_train_step(state, batch)
    plan = self.clock.progress.memory_plan
    logging.info('compiled train step in %.1fs (from %s); per-device memory plan: %s',
                 plan['compile_seconds'], plan['compiled_from'], compile_plan.format_plan(plan))
    check_device(self.config, plan)
    return train_step

  def log(self, step: int) -> None:
    """The train metrics since the last log line, averaged: to the log, TensorBoard and metrics.jsonl."""
    with self.clock.timing('step'):  # fetching metrics waits for the step
      train = {f'train_{k}': float(v) for k, v in self.window.merged().compute().items()}
    self.raise_if_diverged(step, train['train_loss'])
    images_per_sec, shares = self.clock.lap(step, self.config.batch_size)
    plateau_scale = (self.clock.progress.plateau or {}).get('scale', 1.0)
    train.update(images_per_sec=images_per_sec,
                 learning_rate=float(self.task.schedule(step - 1)) * plateau_scale,
                 input_wait_fraction=shares['input'],
                 **image_sizes.logged(self.config, self.length.total_steps, step,
                                      self.dataset.image_shape[0]))
    self.clock.progress.train = train
    logging.info('step %d/%d (epoch %.2f)  loss %.4f  accuracy %.4f  %.0f img/s  lr %.3g  '
                 '[input %.0f%% step %.0f%% other %.0f%%]  ETA %s', step, self.length.total_steps,
                 step / self.length.steps_per_epoch, train['train_loss'], train['train_accuracy'],
                 images_per_sec, train['learning_rate'], 100 * shares['input'], 100 * shares['step'],
                 100 * shares['other'], files.format_duration(self.clock.eta(step, self.length)))
    self.writer.write_scalars(step, train)
    self.writer.flush()
    self.window.clear(next_step=step + 1)
    self.last_log_time = time.time()

  def evaluate(self, step: int, state):
    """Every eval split: to the log, TensorBoard and metrics.jsonl. Returns `state` (its SWA's BatchNorm
    statistics recomputed, and schedule-free's at x)."""
    # Where early stopping or a study's pruner may end the run, any evaluation may be its last.
    is_last = (step == self.length.total_steps or bool(self.config.early_stopping.metric)
               or self.pruning is not None)
    with self.clock.paused('eval', state):
      state = swa.before_evaluation(self.config, self.task, self.placement, self.dataset, state)
      state = bn_recompute.for_schedule_free(self.config, self.task, self.placement, self.dataset, state)
      # The last evaluation also keeps the logits that the per-class report is made of.
      results, self.predictions = evaluate_splits(self.placement, state, self.eval_sets,
                                                  resolved_eval_batch_size(self.config),
                                                  report_weights(self.config) if is_last else None,
                                                  self.config.eval.threshold)
      if self.probe:
        results.update(self.probe(state))
    num_examples = results.pop('num_examples')
    self.clock.progress.eval = results
    logging.info('eval at step %d: loss %.4f  accuracy %.4f  (%d examples)%s', step,
                 results['eval_loss'], results['eval_accuracy'], num_examples,
                 ''.join(f'  {name} {value:.4f}' for name, value in results.items()
                         if name not in ('eval_loss', 'eval_accuracy')))
    self.writer.write_scalars(step, results)
    self.writer.flush()
    return state

  def after_evaluation(self, step: int, state):
    """The plateau schedule's scale (set in `state`), early stopping and a study's pruner, updated with the
    evaluation."""
    progress, results = self.clock.progress, self.clock.progress.eval
    if self.config.schedule.name == 'plateau':
      plateau = Plateau(self.config)
      before = (progress.plateau or plateau.initial())['scale']
      progress.plateau = plateau.update(progress.plateau or plateau.initial(), results)
      if progress.plateau['scale'] != before:
        logging.info('plateau: %s has not improved for %d evaluations; the learning rate is now %.3g x the '
                     'peak', plateau.metric, self.config.schedule.plateau_patience, progress.plateau['scale'])
        state = state.replace(opt_state=optim.set_plateau_scale(state.opt_state, progress.plateau['scale']))
    metric = early_stopping_metric(self.config)
    if metric:
      early_stopping.update(self.config, progress, step, metric, results)
    if self.pruning and not progress.stopped_early:
      self.pruning.update(progress, step, results)
    return state

  def save_due(self, step: int) -> bool:
    """Whether a periodic checkpoint is due after `step`: every checkpoint_every_steps; the once-an-epoch
    default (-1) at least checkpoint.min_interval_secs apart; the last step always."""
    throttled = self.config.checkpoint_every_steps == -1 and step != self.length.total_steps
    return self.due(step, self.length.checkpoint_every_steps) and not (
        throttled and time.time() - self.last_save_time < self.config.checkpoint.min_interval_secs)

  def save(self, step: int, state, evaluated: bool) -> None:
    """An asynchronous checkpoint of `state` with its record (and the evaluation, for keeping the best)."""
    if self.window:  # never save a diverged state: the steps since the last log line are checked first
      self.raise_if_diverged(step)
    with self.clock.paused('save', state):
      record = checkpoint_record(self.config, self.task, step, self.dataset, self.clock.record().to_json())
      record['train_metrics_window'] = metrics.window_to_json(self.window.merged())
      record['init_from'] = self.start.initialised_from
      self.checkpoints.save(step, self.placement.to_saveable(state), record,
                            metrics=self.clock.progress.eval if evaluated else None)
    self.last_save_time = time.time()

  def raise_if_diverged(self, step: int, mean_loss: Optional[float] = None) -> None:
    """Diverged at the first NaN/Inf loss of the steps since the last log line (whose `mean_loss`,
    when it has been fetched, tells whether any is)."""
    if mean_loss is not None and math.isfinite(mean_loss):
      return
    diverged_at = self.window.first_non_finite_step()
    if diverged_at is not None or mean_loss is not None:
      raise Diverged(step if diverged_at is None else diverged_at)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop: Optional[StopRequest] = None, command_started: Optional[float] = None,
                       dataset: Optional[pipeline.Dataset] = None, pictures: bool = True) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns results.json.

  `config` comes resolved (flaxtpu/validation/resolution.py) and validated, as from the CLI; nothing edits it.
  A SIGTERM/SIGINT at any point ends it cleanly: the state reached is saved
  and `{'stopped_at_step': N}` is returned. The CLI passes the `stop` it
  installed before JAX started; otherwise one is installed here. It also passes
  `command_started` (its process's start), which the time to the first step counts from; without
  it, that time counts from this call. `dataset`: the config's data, when the caller has loaded it
  (`pipeline.load(config)`; the CLI does while the devices start). `pictures=False`: no end-of-run
  pictures (per-class report, calibration, curves), for runs nobody looks at (the audit's fold runs).
  """
  with contextlib.nullcontext(stop) if stop and stop.active else StopRequest() as stop:
    # Process 0 holds the workdir for the run: a second trainer there stops at once.
    # A lease (gs://) that another trainer takes over stops this run at its next step, unsaved.
    holding = lock.WorkdirLock(workdir, on_lost=stop.abort) if jax.process_index() == 0 else None
    with holding or contextlib.nullcontext():
      return _train_and_evaluate(config, workdir, stop, command_started, dataset, pictures)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, stop: StopRequest,
                        command_started: Optional[float], dataset: Optional[pipeline.Dataset],
                        pictures: bool) -> dict:
  started = time.time()
  is_main = jax.process_index() == 0
  mesh = parallel.make_mesh(config)
  parallel.log_mesh(mesh, config.parallelism)

  dataset = dataset or pipeline.load(config)
  # A run's epoch is its sampler's: sampling=shards takes the smallest process's share.
  examples = sampling.examples_per_epoch(dataset, config.batch_size, jax.process_count())
  # model.remat=auto: a copy of the config with the fastest policy that fits, saved in config.json.
  config, _ = remat_choice.resolve(config, image_shape=dataset.image_shape, num_classes=dataset.num_classes,
                                   num_train_examples=examples)
  length = run_length(config, examples)
  check_host(config, dataset.image_shape, streamed=not (dataset.train.cached and dataset.eval.cached))
  eval_sets = [(config.dataset.eval_split, dataset)] + pipeline.load_eval_splits(config, dataset)

  checkpoints = checkpoint.Checkpoints(workdir, config)
  teacher, teacher_variables = load_teacher(config, dataset, mesh, checkpoints)
  budget = time_budget.plan(  # time_budget: the steps that fit, measured, kept, checked once early on
      config, workdir, examples, resuming=checkpoints.latest_step() is not None, started=started,
      probe=lambda: budget_probe.probe(config, dataset, mesh, eval_sets, started, teacher,
                                      teacher_variables))
  length = budget.length or length
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length,
                           class_weights=dataset.class_weights, teacher=teacher, schedule=budget.schedule)
  placement = placing.place(task, mesh, config, teacher_variables)
  log_plan(config, dataset, length, task, placement)
  # The first train step compiles while the state is initialised or restored: under jit it is built
  # from the state's shapes alone, and XLA compiles without the GIL.
  step_ahead = (placing.StepAhead.start(task, placement, config.batch_size)
                if placement.parallelism == 'jit' and not config.augment.train_sizes else None)
  start = start_or_resume(config, task, placement, checkpoints, dataset, length, examples)
  if start.step >= length.total_steps or start.progress.stopped_early:
    return finish_trained_run(config, placement, start, checkpoints, dataset, eval_sets, length, workdir,
                              pictures)
  if is_main:  # only once the checkpoint has proven to belong to this config
    files.write_json(os.path.join(workdir, 'config.json'), saved_config(config, dataset.image_shape[-1]))
    files.truncate_jsonl(os.path.join(workdir, 'metrics.jsonl'), start.step)
  writer = writers.create_writer(workdir, is_main_process=is_main, config=config)
  if is_main:
    log_run_overview(writer, config, task, placement, start.state, dataset, start.step)

  batches = workers.prefetch(
      placement.put_train_batch(tuple(batch)[:2]) for batch in loaders.train_batches(
          dataset, seed=config.seed, batch_size=config.batch_size, first_step=start.step,
          last_step=budget.batches_until(length.total_steps), process_index=jax.process_index(),
          process_count=jax.process_count(), alternate_flip=config.augment.alternate_flip))
  loop = _Loop(config, task, placement, dataset, eval_sets, length, checkpoints, writer,
               TrainClock(start.step, start.progress, started, command_started), start,
               TrainWindow(placement.to_host_metrics, start.step + 1, start.window),
               probe=fewshot.maybe_probe(config, dataset, task, placement), pruning=Pruning.of(config),
               budget=budget, step_ahead=step_ahead)
  profiler = StepProfiler(workdir, start.step, config.profile_steps, length.total_steps)
  try:
    with _Closing() as closing:
      for close in (writer.close, checkpoints.close, checkpoints.wait, batches.close, profiler.stop):
        closing.callback(close)
      step = _train(loop, batches, profiler, stop)
      length = loop.length  # a time budget's check may have re-planned it
  except Diverged as diverged:
    raise TrainingDiverged(divergence.message(config, diverged.step, checkpoints)) from None

  stopped_early = loop.clock.progress.stopped_early
  if step < length.total_steps and not stopped_early:
    saved = (f'checkpoint complete in {checkpoints.directory}' if step > start.step
             else 'nothing new to save')
    logging.info('stopped by %s at step %d; %s; run the same command to resume', stop.signal_name,
                 step, saved)
    return {'stopped_at_step': step}
  results = loop.clock.record().results(length.total_steps, config.batch_size)
  results.update(image_sizes.report(config, length.total_steps))
  if is_main and pictures:
    write_pictures(config, loop.predictions, dataset, workdir, step)
  # A time budget counts to the end of the report.
  results.update(time_budget.report(config, workdir, time.time() - started, step - start.step))
  if is_main:
    files.write_json(os.path.join(workdir, 'results.json'), results)
    tracking.log_results(config, workdir, results)
  if stopped_early and stopped_early.get('pruned'):
    log_pruned(stopped_early)
  elif stopped_early:
    early_stopping.log_stop(config, stopped_early, checkpoints)
  return results


def _train(loop: _Loop, batches, profiler: StepProfiler, stop: StopRequest) -> int:
  """Trains from `loop.start` to the last step or a stop request; returns the step reached."""
  state, length, clock = loop.start.state, loop.length, loop.clock
  # A signal during start-up (data, init, restore) stops before any step: nothing new to save.
  if stop_requested(stop, check_all_processes=True):
    return loop.start.step
  with clock.timing('input'):
    first_batch = next(batches)
  # Once per image size (augment.train_sizes; one size without), ahead of time, when first reached.
  sized = image_sizes.TrainSteps(loop.config, length.total_steps, loop.dataset.image_shape, loop.compile)
  train_step = sized.at(loop.start.step + 1, state, first_batch)
  batches, one_step_in_flight = itertools.chain([first_batch], batches), parallel.one_step_in_flight()

  step, step_metrics = loop.start.step, None
  while step < length.total_steps:  # a time budget's check may change the length
    step += 1
    with clock.timing('input', in_flight=step_metrics):
      batch = next(batches)
    profiler.before_step(step)
    train_step = sized.at(step, state, batch)
    with clock.timing('step'):
      state, step_metrics = train_step(state, batch)
      clock.step_done(step_metrics, wait=one_step_in_flight)
    if step == loop.start.step + 1:  # the first save needs orbax; the first step did not
      loop.checkpoints.prepare_in_background()
    profiler.after_step(step, state, clock)
    loop.window.add(step_metrics)

    if loop.log_due(step):
      loop.log(step)
    evaluated = loop.due(step, length.eval_every_steps)
    if evaluated:
      state = loop.evaluate(step, state)
      state = loop.after_evaluation(step, state)  # the plateau schedule's scale; early stopping
    stopping = stop_requested(stop, check_all_processes=loop.due(step, loop.config.log_every_steps))
    stopping_early = bool(clock.progress.stopped_early)
    if loop.save_due(step) or stopping or stopping_early:
      loop.save(step, state, evaluated)
    if stopping or stopping_early:
      break
    if loop.budget.after_step(step):  # re-planned: a new length, and its schedule's task and train step
      loop.task, loop.placement = loop.budget.rebuilt(loop.dataset, loop.task, loop.placement)
      loop.length = length = loop.budget.length
      sized.compiled.clear()  # compiled again for the new placement at the next step
  profiler.stop(state)
  return step
