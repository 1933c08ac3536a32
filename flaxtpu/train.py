"""The training loop: a config and a workdir in; checkpoints, metrics and results.json out.

Read top to bottom: the helpers the loop uses (stopping on a signal, the
clock, what a checkpoint records, where a run starts and how a finished one
is completed), then `train_and_evaluate`. The step
functions and their placement on the devices are in `steps.py`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any, NamedTuple, Optional

import jax
import ml_collections
import numpy as np
from clu import parameter_overview
from jax.experimental import multihost_utils

from flaxtpu import checkpoint, data, files, finetune, lock, metrics, optim, parallel, report, steps, workers
from flaxtpu.config import RunLength, resolved_eval_batch_size, run_length
from flaxtpu.errors import UserError
from flaxtpu.evaluate import evaluate_splits, write_report
from flaxtpu.memory import check_device, check_host
from flaxtpu.signals import StopRequest


def stop_requested(stop: StopRequest, check_all_processes: bool) -> bool:
  """Whether to stop now. With many processes they must agree on the step, so a signal
  is only acted on where `check_all_processes` (a collective every process reaches) is set."""
  if jax.process_count() == 1:
    return stop.signal_name is not None
  if not check_all_processes:
    return False
  flags = multihost_utils.process_allgather(np.array(stop.signal_name is not None))
  return bool(np.any(flags))


class TrainClock:
  """Times training steps apart from compiling, evaluating and saving, and splits a step's time.

  Its totals go into every checkpoint, so a resumed run reports the images/s
  of all its steps, not only of the last attempt. Pauses are timed by kind
  ('eval', 'save'), so the ETA counts the evaluations and saves still to
  come. Within a lap, `input` is the time spent waiting for the next batch
  and `step` the time in the train step and waiting for its results.
  """

  def __init__(self, first_step: int, progress: dict):
    self._lap_start, self._lap_step = time.time(), first_step
    self.train_seconds = progress.get('train_seconds', 0.0)
    self.train_steps = progress.get('train_steps', 0)
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
  def timing(self, part: str):
    """Charges the time inside to `part` ('input' or 'step') of the current lap."""
    started = time.time()
    yield
    self._split[part] += time.time() - started

  def lap(self, step: int, batch_size: int) -> tuple[float, dict[str, float]]:
    """Images/s since the last lap and the share of its time each part took."""
    seconds, steps_done = time.time() - self._lap_start, step - self._lap_step
    self.train_seconds += seconds
    self.train_steps += steps_done
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

  def images_per_sec(self, batch_size: int) -> float:
    return self.train_steps * batch_size / max(self.train_seconds, 1e-9)


class StepProfiler:
  """`profile_steps` steps traced with jax.profiler into WORKDIR/profile, after warm-up steps."""
  WARMUP_STEPS = 5

  def __init__(self, workdir: str, first_step: int, num_steps: int, total_steps: int):
    self.directory = os.path.join(workdir, 'profile')
    start = min(first_step + self.WARMUP_STEPS, max(first_step, total_steps - num_steps))
    self._steps = range(start + 1, min(start + num_steps, total_steps) + 1) if num_steps else range(0)
    self._tracing = False

  def before_step(self, step: int) -> None:
    if self._steps and step == self._steps.start:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self._tracing = True

  def ends_at(self, step: int) -> bool:
    return self._tracing and step == self._steps[-1]

  def stop(self, state) -> None:
    if self._tracing:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self._tracing = False
      logging.info('profile of steps %d-%d in %s: open it with `tensorboard --logdir %s` (Profile '
                   'tab) or the *.trace.json.gz in https://ui.perfetto.dev', self._steps.start,
                   self._steps[-1], self.directory, self.directory)


def log_run_overview(writer, config: ml_collections.ConfigDict, task: steps.Task, placement,
                     state, dataset: data.Dataset, first_step: int) -> None:
  """TensorBoard (and W&B) extras at the start: the config as HParams, the parameter
  table, and the first training images as the train step augments them."""
  writer.write_hparams(metrics.flat_hparams(config.to_dict()))
  overview = parameter_overview.get_parameter_overview(placement.to_saveable(state).params,
                                                       include_stats=False)
  logging.info('parameters:\n%s', overview)
  writer.write_texts(first_step, {'parameters': f'<pre>{overview}</pre>'})
  if jax.process_count() == 1:  # the first local batch is the whole global batch only on one process
    first = next(iter(data.train_batches(dataset, seed=config.seed, batch_size=config.batch_size,
                                         first_step=first_step, last_step=first_step + 1,
                                         alternate_flip=config.augment.alternate_flip)))
    sample = steps.augmented_sample(task, config.seed, first_step, first.images[:16])
    writer.write_images(first_step, {'train_images': sample})


class TrainingDiverged(UserError):
  """The loss became NaN or infinite: the state from that step on is not worth saving."""


def first_non_finite_step(placement: steps.Placement, window: list, last_step: int) -> Optional[int]:
  """The step of the first NaN/Inf loss among the per-step metrics of `window` (ending at `last_step`)."""
  losses = [float(placement.to_host_metrics(step_metrics).compute()['loss']) for step_metrics in window]
  bad = [index for index, loss in enumerate(losses) if not math.isfinite(loss)]
  return last_step - len(window) + 1 + bad[0] if bad else None


def divergence_message(config: ml_collections.ConfigDict, step: int, checkpoints) -> str:
  saved = checkpoints.all_steps()
  last_good = (f'the last good checkpoint, step {max(saved)} in {checkpoints.directory}, is intact: '
               'change the config and run the same command to resume from it' if saved
               else 'no checkpoint was saved before it')
  return (f'the training loss became NaN/Inf at step {step}; likely causes: a learning rate too high '
          f'(optimizer.learning_rate={config.optimizer.learning_rate}: lower it, add warmup or '
          f'optimizer.grad_clip_norm) or a {config.dtype} overflow (try dtype=float32); nothing from that '
          f'step on was saved; {last_good}')


def checkpoint_record(config: ml_collections.ConfigDict, task: steps.Task, step: int,
                      dataset: data.Dataset, progress: dict) -> dict:
  """What a checkpoint says besides the arrays: what it is, the data position, the config,
  and the run's progress (latest metrics, time), from which results.json can be rebuilt.

  Evaluation and prediction rebuild the model from it without the train split.
  """
  return {**checkpoint.expected_record(config, task.num_classes, task.image_shape),
          'class_names': list(dataset.class_names),
          'num_train_examples': len(dataset.train),
          'normalization': {'mean': dataset.mean.tolist(), 'std': dataset.std.tolist()},
          'data_position': {'seed': config.seed, 'next_step': step},
          'progress': progress,
          'config': config.to_dict()}


def final_results(total_steps: int, progress: dict, batch_size: int) -> dict:
  """results.json from the progress of a finished run."""
  train_metrics = progress.get('train', {})
  return {
      'step': total_steps,
      **progress.get('eval', {}),
      'train_loss': train_metrics.get('train_loss'),
      'train_accuracy': train_metrics.get('train_accuracy'),
      'train_images_per_sec': progress.get('train_steps', 0) * batch_size / max(
          progress.get('train_seconds', 0.0), 1e-9),
      'wall_time_s': progress.get('wall_time_s'),
      'time_to_first_step_s': progress.get('time_to_first_step_s'),
      'memory_plan': progress.get('memory_plan', {}),
  }


class Start(NamedTuple):
  """Where a run begins: a fresh state at step 0, or the newest readable checkpoint's."""
  state: Any
  step: int
  window: list  # per-step train metrics since the last log line before the checkpoint
  progress: dict  # the checkpoint's progress record (metrics, time); empty for a fresh run
  initialised_from: Optional[dict]  # what init_from loaded, kept in every checkpoint record of the run


def start_or_resume(config: ml_collections.ConfigDict, task: steps.Task, placement: steps.Placement,
                    checkpoints: checkpoint.Checkpoints, dataset: data.Dataset) -> Start:
  """The state to train from: the newest readable checkpoint's when there is one, else a fresh one
  (fitted to the train images, then loaded from `init_from`, where the config asks)."""
  if checkpoints.latest_step() is None:
    fitted = None  # parameters set from the train images (a whitening stem)
    if steps.fits_to_data(task):
      sample = np.stack(data.train_sample(dataset, steps.DATA_FIT_IMAGES))
      fitted = steps.fit_to_data(task, sample)
      logging.info('fitted %s to %d train images', ', '.join(fitted), len(sample))
      if any(task.param_groups.label(name) != optim.FROZEN for name in fitted):
        logging.warning('%s will train (and decay) from its fitted value; airbench freezes it: '
                        "--config.optimizer.freeze='^stem/kernel$' (as configs/cifar10_fast.py)",
                        ', '.join(fitted))
    state, initialised_from = steps.create_state(task, placement, config.seed, fitted), None
    if config.init_from.checkpoint:
      state, initialised_from = finetune.init_from(config, task, placement, state, dataset.class_names)
    return Start(state, 0, [], {}, initialised_from)

  # A resumed run continues from its own checkpoint, never from init_from again.
  expected = checkpoint.expected_record(config, task.num_classes, task.image_shape)
  latest, (saved, record) = checkpoints.newest_readable(
      lambda step: checkpoints.restore_train_state(step, placement.abstract_state, expected, config),
      set_aside=True)
  saved_accumulation = record.get('config', {}).get('optimizer', {}).get('accumulate_steps', 1)
  if saved_accumulation != config.optimizer.accumulate_steps:
    # Same arrays, other meaning: the optimizer's update count and the schedule assume the old k.
    raise checkpoint.CheckpointError(
        f'checkpoint step {latest} in {checkpoints.directory} was trained with optimizer.accumulate_steps='
        f'{saved_accumulation}, and its optimizer state counts updates of that many batches; resume with '
        f'--config.optimizer.accumulate_steps={saved_accumulation} or use another --workdir')
  logging.info('resuming from step %d (%s)', latest, os.path.join(checkpoints.directory, str(latest)))
  saved_window = metrics.window_from_json(record.get('train_metrics_window'))
  window = [placement.from_saveable(saved_window)] if saved_window is not None else []
  return Start(placement.from_saveable(saved), latest, window, record.get('progress', {}),
               record.get('init_from'))


def finish_trained_run(config: ml_collections.ConfigDict, placement: steps.Placement, start: Start,
                       checkpoints: checkpoint.Checkpoints, dataset: data.Dataset, eval_sets: list,
                       length: RunLength, workdir: str, report_weights: str) -> dict:
  """A run whose checkpoint is at its last step: what a kill after that save left unwritten
  (results.json, the per-class report and curves) is rebuilt from the checkpoint."""
  checkpoints.close()
  results_path = os.path.join(workdir, 'results.json')
  results = files.read_json(results_path) or final_results(length.total_steps, start.progress,
                                                           config.batch_size)
  if jax.process_index() == 0:
    files.write_json(results_path, results)
  if jax.process_count() == 1 and not os.path.exists(os.path.join(workdir, 'per_class.csv')):
    _, predictions = evaluate_splits(placement, start.state, eval_sets[:1],
                                     resolved_eval_batch_size(config), report_weights)
    write_pictures(predictions, dataset, workdir)
  logging.info('already trained to step %d; results in %s', start.step, results_path)
  return results


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop: Optional[StopRequest] = None) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns results.json.

  A SIGTERM/SIGINT at any point ends it cleanly: the state reached is saved
  and `{'stopped_at_step': N}` is returned. The CLI passes the `stop` it
  installed before JAX started; otherwise one is installed here.
  """
  with contextlib.nullcontext(stop) if stop and stop.active else StopRequest() as stop:
    # Process 0 holds the workdir for the run: a second trainer there stops at once.
    with lock.WorkdirLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext():
      return _train_and_evaluate(config, workdir, stop)


def write_pictures(predictions, dataset: data.Dataset, workdir: str) -> None:
  """Pictures of the finished run: per-class report and calibration of the eval split, curves."""
  write_report(predictions, dataset, workdir)
  logging.info('curves: %s', report.write_curves(workdir))


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, stop: StopRequest) -> dict:
  started = time.time()
  is_main = jax.process_index() == 0
  mesh = parallel.make_mesh(config)
  parallel.log_mesh(mesh, config.parallelism)

  finetune.apply_source_defaults(config, workdir)  # the source's preprocessing, before the data is read
  dataset = data.load(config)
  length = run_length(config, len(dataset.train))
  check_host(config, dataset.image_shape, streamed=not (dataset.train.cached and dataset.eval.cached))
  logging.info('data: %d train / %d eval examples of %s, %d classes; %d steps (%d per epoch)',
               len(dataset.train), len(dataset.eval), dataset.image_shape, dataset.num_classes,
               length.total_steps, length.steps_per_epoch)
  if length.accumulate_steps > 1:
    logging.info('gradient accumulation: %d batches of %d per update (an effective batch of %d); '
                 '%d updates', length.accumulate_steps, config.batch_size,
                 length.accumulate_steps * config.batch_size, length.total_updates)
  eval_sets = [(config.dataset.eval_split, dataset)] + data.load_eval_splits(config, dataset)
  report_weights = 'ema' if config.eval.ema else 'raw'  # the weights the per-class report shows

  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length)
  placement = steps.place(task, mesh, config)
  if task.param_groups:  # a pattern that matches nothing is a typo: stop before any work
    logging.info('optimizer: %s', optim.describe_groups(task.param_groups.check(
        placement.abstract_state.params)))
    for pattern, epochs in task.param_groups.freeze_after:
      logging.info('optimizer: parameters matching %r stop changing after %g epochs', pattern, epochs)
  checkpoints = checkpoint.Checkpoints(workdir, config)
  start = start_or_resume(config, task, placement, checkpoints, dataset)
  if start.step >= length.total_steps:
    return finish_trained_run(config, placement, start, checkpoints, dataset, eval_sets, length, workdir,
                              report_weights)
  state, first_step, window, progress, initialised_from = start
  if is_main:  # only once the checkpoint has proven to belong to this config
    files.write_json(os.path.join(workdir, 'config.json'), config.to_dict())
    files.truncate_jsonl(os.path.join(workdir, 'metrics.jsonl'), first_step)
  writer = metrics.create_writer(workdir, is_main_process=is_main, config=config)
  if is_main:
    log_run_overview(writer, config, task, placement, state, dataset, first_step)

  batches = workers.prefetch(
      placement.put_train_batch(tuple(batch)[:2]) for batch in data.train_batches(
          dataset, seed=config.seed, batch_size=config.batch_size, first_step=first_step,
          last_step=length.total_steps, process_index=jax.process_index(),
          process_count=jax.process_count(), alternate_flip=config.augment.alternate_flip))
  clock = TrainClock(first_step, progress)
  previous_wall_time = progress.get('wall_time_s') or 0.0
  one_step_in_flight = parallel.one_step_in_flight()
  eval_batch_size = resolved_eval_batch_size(config)
  train_step_fn = None
  time_to_first_step = progress.get('time_to_first_step_s')
  last_train, eval_results = progress.get('train', {}), progress.get('eval', {})
  merged_window = lambda: placement.to_host_metrics(metrics.merge_window(window))

  def current_progress() -> dict:
    return {'train': last_train, 'eval': eval_results, 'train_seconds': clock.train_seconds,
            'train_steps': clock.train_steps, 'time_to_first_step_s': time_to_first_step,
            'wall_time_s': previous_wall_time + time.time() - started, 'memory_plan': memory_plan}

  step, memory_plan, diverged_at = first_step, progress.get('memory_plan', {}), None
  predictions = None  # the last evaluation's logits and labels, for the per-class report
  profiler = StepProfiler(workdir, first_step, config.profile_steps, length.total_steps)
  # Seconds-triggered progress lines need every process to agree on the step: one process only.
  log_every_secs = config.log_every_secs if jax.process_count() == 1 else 0.0
  last_log_time = time.time()
  # A signal during start-up (data, init, restore) stops before any step: nothing new to save.
  stopping = stop_requested(stop, check_all_processes=True)

  def close_run() -> None:
    profiler.stop(state)
    batches.close()
    checkpoints.wait()
    checkpoints.close()
    writer.close()

  try:
    while step < length.total_steps and not stopping:
      step += 1
      with clock.timing('input'):
        batch = next(batches)
      if train_step_fn is None:  # compile once, ahead of time, and report its memory plan
        with clock.paused('compile'):
          train_step_fn, memory_plan = placement.compile_train_step(state, batch)
        logging.info('compiled train step in %.1fs; per-device memory plan: %s',
                     memory_plan['compile_seconds'], steps.format_plan(memory_plan))
        check_device(config, memory_plan)
      profiler.before_step(step)
      with clock.timing('step'):
        state, step_metrics = train_step_fn(state, batch)
        if one_step_in_flight or time_to_first_step is None:
          jax.block_until_ready(step_metrics)
      if profiler.ends_at(step):
        with clock.paused('profile'):  # writing the trace is not training time
          profiler.stop(state)
      if time_to_first_step is None:
        time_to_first_step = time.time() - started
        logging.info('first step done %.1fs after start (data, init, compile)', time_to_first_step)
      window.append(step_metrics)
      is_last = step == length.total_steps

      log_now = (step % config.log_every_steps == 0 or is_last
                 or (log_every_secs and time.time() - last_log_time >= log_every_secs))
      if log_now:  # fetching metrics waits for the step
        with clock.timing('step'):
          last_train = {f'train_{k}': float(v) for k, v in merged_window().compute().items()}
        if not math.isfinite(last_train['train_loss']):
          diverged_at = first_non_finite_step(placement, window, step)
          break
        images_per_sec, shares = clock.lap(step, config.batch_size)
        last_train.update(images_per_sec=images_per_sec, learning_rate=float(task.schedule(step - 1)),
                          input_wait_fraction=shares['input'])
        logging.info('step %d/%d (epoch %.2f)  loss %.4f  accuracy %.4f  %.0f img/s  lr %.3g  '
                     '[input %.0f%% step %.0f%% other %.0f%%]  ETA %s', step, length.total_steps,
                     step / length.steps_per_epoch, last_train['train_loss'],
                     last_train['train_accuracy'], images_per_sec, last_train['learning_rate'],
                     100 * shares['input'], 100 * shares['step'], 100 * shares['other'],
                     files.format_duration(clock.eta(step, length)))
        writer.write_scalars(step, last_train)
        writer.flush()
        window, last_log_time = [], time.time()

      evaluate_now = step % length.eval_every_steps == 0 or is_last
      if evaluate_now:
        with clock.paused('eval', state):
          # The last evaluation also keeps the logits that the per-class report below is made of.
          eval_results, predictions = evaluate_splits(placement, state, eval_sets, eval_batch_size,
                                                      report_weights if is_last else None)
        num_examples = eval_results.pop('num_examples')
        logging.info('eval at step %d: loss %.4f  accuracy %.4f  (%d examples)%s', step,
                     eval_results['eval_loss'], eval_results['eval_accuracy'], num_examples,
                     ''.join(f'  {name} {value:.4f}' for name, value in eval_results.items()
                             if name not in ('eval_loss', 'eval_accuracy')))
        writer.write_scalars(step, eval_results)
        writer.flush()

      stopping = stop_requested(stop, check_all_processes=step % config.log_every_steps == 0)
      if step % length.checkpoint_every_steps == 0 or is_last or stopping:
        # Never save a diverged state: the steps since the last log line are checked first.
        if window and (diverged_at := first_non_finite_step(placement, window, step)) is not None:
          break
        with clock.paused('save', state):
          record = checkpoint_record(config, task, step, dataset, current_progress())
          record['train_metrics_window'] = metrics.window_to_json(merged_window() if window else None)
          record['init_from'] = initialised_from
          checkpoints.save(step, placement.to_saveable(state), record,
                           metrics=eval_results if evaluate_now else None)

  except Exception:
    # A bad image or a failed save mid-run: the save in flight completes and the input workers stop
    # (one process only: with many, waiting could wait on a peer that waits on this one). The error
    # that stopped the run stays the one reported.
    if jax.process_count() == 1:
      with contextlib.suppress(Exception):
        close_run()
    raise
  close_run()
  if diverged_at is not None:
    raise TrainingDiverged(divergence_message(config, diverged_at, checkpoints))
  if step < length.total_steps:
    saved = (f'checkpoint complete in {checkpoints.directory}' if step > first_step
             else 'nothing new to save')
    logging.info('stopped by %s at step %d; %s; run the same command to resume', stop.signal_name,
                 step, saved)
    return {'stopped_at_step': step}
  results = final_results(length.total_steps, current_progress(), config.batch_size)
  if is_main:
    files.write_json(os.path.join(workdir, 'results.json'), results)
    write_pictures(predictions, dataset, workdir)
  return results
