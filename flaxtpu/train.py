"""The trainer: train state, train/eval steps, and the loop that ties data, model and devices together.

Read top to bottom: the state, the pure step functions, how they are placed
on the devices (jit over a mesh, or pmap), then `train_and_evaluate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import time
from typing import Any, Callable, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils

from flaxtpu import augment, checkpoint, data, metrics, models, optim, parallel
from flaxtpu.config import RunLength, resolved_eval_batch_size, run_length

# --- state and pure steps ---------------------------------------------------


class TrainState(flax.struct.PyTreeNode):
  """Everything that changes during training; all of it goes into a checkpoint."""
  step: jax.Array
  params: Any
  batch_stats: Any  # BatchNorm running statistics ({} for models without BatchNorm)
  opt_state: Any
  rng: jax.Array  # base key: step `s` augments with fold_in(rng, s), so resuming replays it


@dataclasses.dataclass(frozen=True)
class Task:
  """The static parts that the step functions close over."""
  model: nn.Module
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  num_classes: int
  image_shape: tuple[int, int, int]
  augment: ml_collections.ConfigDict
  label_smoothing: float
  mean: Optional[np.ndarray]  # per-channel standardisation; None keeps [0, 1]
  std: Optional[np.ndarray]


def create_task(config: ml_collections.ConfigDict, *, num_classes: int,
                image_shape: tuple[int, int, int], mean: np.ndarray, std: np.ndarray,
                length: RunLength) -> Task:
  """The model, optimizer and preprocessing that a config describes, for data of this shape."""
  model = models.create(
      config.model.name, num_classes=num_classes, dtype=config.dtype, remat=config.model.remat,
      bn_axis_name=parallel.PMAP_AXIS if config.parallelism == 'pmap' else None)
  optimizer, schedule = optim.create_optimizer(config, length)
  standardize = config.dataset.normalize == 'standardize'
  return Task(model=model, optimizer=optimizer, schedule=schedule, num_classes=num_classes,
              image_shape=tuple(image_shape), augment=config.augment,
              label_smoothing=config.label_smoothing,
              mean=np.asarray(mean, np.float32) if standardize else None,
              std=np.asarray(std, np.float32) if standardize else None)


def init_state(task: Task, seed: int) -> TrainState:
  params_key, data_key = jax.random.split(jax.random.PRNGKey(seed))
  variables = task.model.init(params_key, jnp.zeros((1, *task.image_shape)), train=False)
  params = variables['params']
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    batch_stats=variables.get('batch_stats', {}),
                    opt_state=task.optimizer.init(params), rng=data_key)


def _batch_positions(local_size: int, axis_name: Optional[str]) -> jax.Array:
  """Each example's row in the global batch (pmap shards see their offset)."""
  offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * local_size
  return offset + jnp.arange(local_size)


def _mean(x, axis_name: Optional[str]):
  return x if axis_name is None else jax.lax.pmean(x, axis_name)


def train_step(state: TrainState, batch, *, task: Task, axis_name: Optional[str] = None):
  """One optimizer step on a batch of (uint8 images, labels) -> (new state, clu metrics).

  `axis_name` is None under jit (XLA sees the global batch); under pmap it
  names the device axis that gradients and metrics are averaged over.
  """
  images, labels = batch
  key = jax.random.fold_in(state.rng, state.step)
  images = augment.augment_batch(key, images, _batch_positions(len(images), axis_name), task.augment)
  images = augment.normalize(images, task.mean, task.std)
  targets = optax.smooth_labels(jax.nn.one_hot(labels, task.num_classes), task.label_smoothing)

  def loss_fn(params):
    logits, updates = task.model.apply({'params': params, 'batch_stats': state.batch_stats},
                                       images, train=True, mutable=['batch_stats'])
    loss = optax.softmax_cross_entropy(logits, targets).mean()
    return loss, (logits, updates.get('batch_stats', state.batch_stats))

  (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grads = _mean(grads, axis_name)
  updates, opt_state = task.optimizer.update(grads, state.opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            batch_stats=batch_stats, opt_state=opt_state)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  step_metrics = metrics.TrainMetrics.single_from_model_output(
      loss=_mean(loss, axis_name), accuracy=_mean(accuracy, axis_name))
  return new_state, step_metrics


def logits_fn(state: TrainState, images, *, task: Task):
  """Inference: uint8 images -> float32 logits (BatchNorm uses its running statistics)."""
  images = augment.normalize(images, task.mean, task.std)
  return task.model.apply({'params': state.params, 'batch_stats': state.batch_stats}, images,
                          train=False)


def eval_step(state: TrainState, batch, *, task: Task, axis_name: Optional[str] = None):
  """Masked loss and accuracy of a (padded) eval batch, as clu metrics summed over devices."""
  images, labels, mask = batch
  logits = logits_fn(state, images, task=task)
  outputs = dict(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels),
                 accuracy=(jnp.argmax(logits, -1) == labels).astype(jnp.float32), mask=mask)
  if axis_name is None:
    return metrics.EvalMetrics.single_from_model_output(**outputs)
  return metrics.EvalMetrics.gather_from_model_output(axis_name=axis_name, **outputs)


# --- placing the steps on the devices ---------------------------------------


@dataclasses.dataclass
class Placement:
  """How state and batches live on the devices, and the compiled steps that use them.

  Under `jit` the state is global arrays in `state_shardings`; under `pmap` it
  is one copy per local device. `to_saveable`/`from_saveable` convert to and
  from the global layout that checkpoints hold.
  """
  mesh: jax.sharding.Mesh
  parallelism: str
  state_shardings: Any
  abstract_state: Any  # shapes + shardings of the saveable (global) state: a restore target
  train_step: Callable
  eval_step: Callable
  logits: Callable
  put_train_batch: Callable
  put_eval_batch: Callable
  to_saveable: Callable
  from_saveable: Callable


def place(task: Task, mesh: jax.sharding.Mesh, config: ml_collections.ConfigDict) -> Placement:
  """jax.jit over the mesh with explicit shardings, or jax.pmap: the same step functions."""
  abstract_state = jax.eval_shape(functools.partial(init_state, task), config.seed)
  state_shardings = parallel.state_shardings(abstract_state, mesh, config)
  abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                abstract_state, state_shardings)
  replicated = parallel.replicated(mesh)
  if config.parallelism == 'jit':
    batch_sharding = parallel.batch_sharding(mesh)
    return Placement(
        mesh=mesh, parallelism='jit', state_shardings=state_shardings, abstract_state=abstract_state,
        train_step=jax.jit(functools.partial(train_step, task=task),
                           in_shardings=(state_shardings, batch_sharding),
                           out_shardings=(state_shardings, replicated), donate_argnums=0),
        eval_step=jax.jit(functools.partial(eval_step, task=task),
                          in_shardings=(state_shardings, batch_sharding), out_shardings=replicated),
        logits=jax.jit(functools.partial(logits_fn, task=task),
                       in_shardings=(state_shardings, batch_sharding), out_shardings=replicated),
        put_train_batch=functools.partial(parallel.to_global, sharding=batch_sharding),
        put_eval_batch=functools.partial(parallel.to_global, sharding=batch_sharding),
        to_saveable=lambda state: state, from_saveable=lambda state: state)
  axis = parallel.PMAP_AXIS
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # pmap outputs are replicated
  pmapped_eval = jax.pmap(functools.partial(eval_step, task=task, axis_name=axis), axis_name=axis)
  pmapped_logits = jax.pmap(functools.partial(logits_fn, task=task), axis_name=axis)
  return Placement(
      mesh=mesh, parallelism='pmap', state_shardings=state_shardings, abstract_state=abstract_state,
      train_step=jax.pmap(functools.partial(train_step, task=task, axis_name=axis),
                          axis_name=axis, donate_argnums=0),
      eval_step=lambda state, batch: first(pmapped_eval(state, batch)),
      logits=lambda state, images: pmapped_logits(state, images).reshape(-1, task.num_classes),
      put_train_batch=parallel.to_pmap_batch, put_eval_batch=parallel.to_pmap_batch,
      to_saveable=lambda state: parallel.unreplicate_to_mesh(state, mesh),
      from_saveable=parallel.replicate)


def create_state(task: Task, placement: Placement, seed: int) -> TrainState:
  """Initialises the state straight into its shardings: no full copy on one device first."""
  state = jax.jit(functools.partial(init_state, task), static_argnums=0,
                  out_shardings=placement.state_shardings)(seed)
  return placement.from_saveable(state)


def compile_train_step(placement: Placement, state: TrainState, batch) -> tuple[Callable, dict]:
  """Compiles the train step ahead of time; returns it with the per-device memory XLA plans."""
  started = time.time()
  compiled = placement.train_step.lower(state, batch).compile()
  analysis = compiled.memory_analysis()
  plan = {'compile_seconds': round(time.time() - started, 3)}
  if analysis is not None:
    plan.update(argument_bytes=int(analysis.argument_size_in_bytes),
                output_bytes=int(analysis.output_size_in_bytes),
                temp_bytes=int(analysis.temp_size_in_bytes),
                alias_bytes=int(analysis.alias_size_in_bytes))
    # Donated state buffers alias outputs: count them once.
    plan['total_bytes'] = (plan['argument_bytes'] + plan['output_bytes'] + plan['temp_bytes']
                           - plan['alias_bytes'])
  return compiled, plan


def compile_on_zeros(config: ml_collections.ConfigDict, *, image_shape: tuple[int, int, int],
                     num_classes: int, num_train_examples: int = 50_000):
  """The config's train step compiled for data of this shape, with a zero batch and no dataset.

  Returns (placement, state, batch, compiled step, memory plan): what
  --mode=plan reports and what the benchmarks time.
  """
  length = run_length(config, num_train_examples)
  zeros = np.zeros(len(image_shape), np.float32)
  task = create_task(config, num_classes=num_classes, image_shape=image_shape, mean=zeros,
                     std=zeros + 1, length=length)
  placement = place(task, parallel.make_mesh(config), config)
  parallel.check_batch_size('batch_size', config.batch_size, config)
  local = jax.process_count()
  images = np.zeros((config.batch_size // local, *image_shape), np.uint8)
  labels = np.zeros((config.batch_size // local,), np.int32)
  state = create_state(task, placement, config.seed)
  batch = placement.put_train_batch((images, labels))
  step, plan = compile_train_step(placement, state, batch)
  return placement, state, batch, step, plan


def plan_memory(config: ml_collections.ConfigDict, *, image_shape: tuple[int, int, int],
                num_classes: int) -> dict:
  """Compiles the train step for this config without training: what --mode=plan reports."""
  placement, _, _, _, plan = compile_on_zeros(config, image_shape=image_shape,
                                              num_classes=num_classes)
  return {'model': config.model.name, 'remat': config.model.remat, 'dtype': config.dtype,
          'batch_size': config.batch_size, 'parallelism': config.parallelism,
          'mesh': dict(placement.mesh.shape), 'image_shape': list(image_shape), **plan}


def evaluate(placement: Placement, state: TrainState, split: data.Split,
             batch_size: int) -> dict[str, float]:
  """Loss and accuracy over every example of `split`, each counted exactly once."""
  totals, one_step_in_flight = None, parallel.one_step_in_flight()
  for batch in data.eval_batches(split, batch_size=batch_size, process_index=jax.process_index(),
                                 process_count=jax.process_count()):
    batch_metrics = placement.eval_step(state, placement.put_eval_batch(tuple(batch)))
    if one_step_in_flight:
      jax.block_until_ready(batch_metrics)
    totals = batch_metrics if totals is None else totals.merge(batch_metrics)
  result = {f'eval_{k}': float(v) for k, v in totals.compute().items()}
  result['num_examples'] = int(totals.loss.count)
  return result


# --- the loop ---------------------------------------------------------------


class StopRequest:
  """While active, SIGTERM/SIGINT ask the loop to finish its step, save, and exit cleanly."""

  def __init__(self):
    self.signal_name = None
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def requested(self, check_all_processes: bool) -> bool:
    """Whether to stop now. With many processes they must agree on the step, so a signal
    is only acted on at steps where `check_all_processes` (a collective) is set."""
    if jax.process_count() == 1:
      return self.signal_name is not None
    if not check_all_processes:
      return False
    flags = multihost_utils.process_allgather(np.array(self.signal_name is not None))
    return bool(np.any(flags))


def checkpoint_record(config: ml_collections.ConfigDict, task: Task, step: int,
                      dataset: data.Dataset) -> dict:
  """What a checkpoint says besides the arrays: what it is, the data position, the config.

  Evaluation and prediction rebuild the model from it without the train split.
  """
  return {**expected_record(config, task), 'class_names': list(dataset.class_names),
          'num_train_examples': len(dataset.train),
          'normalization': {'mean': dataset.mean.tolist(), 'std': dataset.std.tolist()},
          'data_position': {'seed': config.seed, 'next_step': step},
          'config': config.to_dict()}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns results.json."""
  started = time.time()
  is_main = jax.process_index() == 0
  mesh = parallel.make_mesh(config)
  parallel.log_mesh(mesh, config.parallelism)
  eval_batch_size = resolved_eval_batch_size(config)
  parallel.check_batch_size('batch_size', config.batch_size, config)
  parallel.check_batch_size('eval_batch_size', eval_batch_size, config)

  dataset = data.load(config)
  length = run_length(config, len(dataset.train))
  logging.info('data: %d train / %d eval examples of %s, %d classes; %d steps (%d per epoch)',
               len(dataset.train), len(dataset.eval), dataset.image_shape, dataset.num_classes,
               length.total_steps, length.steps_per_epoch)

  task = create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                     mean=dataset.mean, std=dataset.std, length=length)
  placement = place(task, mesh, config)
  state = create_state(task, placement, config.seed)
  checkpoints = checkpoint.Checkpoints(workdir, config)
  first_step, window = 0, []  # window: per-step train metrics since the last log line
  if (latest := checkpoints.latest_step()) is not None:
    saved, record = checkpoints.restore(latest, placement.abstract_state,
                                        expected=expected_record(config, task))
    state = placement.from_saveable(saved)
    first_step = latest
    logging.info('resuming from step %d (%s)', latest, os.path.join(checkpoints.directory,
                                                                    str(latest)))
    if (saved_window := metrics.window_from_json(record.get('train_metrics_window'))) is not None:
      window = [placement.from_saveable(saved_window)]
  if first_step >= length.total_steps and os.path.exists(os.path.join(workdir, 'results.json')):
    logging.info('already trained to step %d; results in %s', first_step, workdir)
    checkpoints.close()
    with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
      return json.load(f)
  if is_main:  # only once the checkpoint has proven to belong to this config
    metrics.write_json(os.path.join(workdir, 'config.json'), config.to_dict())
    metrics.truncate_jsonl(os.path.join(workdir, 'metrics.jsonl'), first_step)
  writer = metrics.create_writer(workdir, is_main_process=is_main)

  batches = data.prefetch(
      placement.put_train_batch(tuple(batch)[:2]) for batch in data.train_batches(
          dataset.train, seed=config.seed, batch_size=config.batch_size, first_step=first_step,
          last_step=length.total_steps, process_index=jax.process_index(),
          process_count=jax.process_count()))
  clock = TrainClock(first_step)
  one_step_in_flight = parallel.one_step_in_flight()
  train_step_fn, memory_plan, time_to_first_step = None, {}, None
  last_train: dict[str, float] = {}
  eval_results: dict[str, float] = {}

  def merged_window():
    merged = metrics.merge_window(window)
    return merged.unreplicate() if placement.parallelism == 'pmap' else merged

  with StopRequest() as stop:
    for step in range(first_step + 1, length.total_steps + 1):
      batch = next(batches)
      if train_step_fn is None:  # compile once, ahead of time, and report its memory plan
        with clock.paused():
          train_step_fn, memory_plan = compile_train_step(placement, state, batch)
        logging.info('compiled train step in %.1fs; per-device memory plan: %s',
                     memory_plan['compile_seconds'], format_plan(memory_plan))
      state, step_metrics = train_step_fn(state, batch)
      if one_step_in_flight or time_to_first_step is None:
        jax.block_until_ready(step_metrics)
      if time_to_first_step is None:
        time_to_first_step = time.time() - started
        logging.info('first step done %.1fs after start (data, init, compile)', time_to_first_step)
      window.append(step_metrics)
      is_last = step == length.total_steps

      if step % config.log_every_steps == 0 or is_last:  # fetching metrics waits for the step
        last_train = {f'train_{k}': float(v) for k, v in merged_window().compute().items()}
        images_per_sec, eta = clock.lap(step, config.batch_size, length.total_steps)
        last_train.update(images_per_sec=images_per_sec, learning_rate=float(task.schedule(step - 1)))
        logging.info('step %d/%d  loss %.4f  accuracy %.4f  %.0f img/s  lr %.3g  ETA %s', step,
                     length.total_steps, last_train['train_loss'], last_train['train_accuracy'],
                     images_per_sec, last_train['learning_rate'], _duration(eta))
        writer.write_scalars(step, last_train)
        writer.flush()
        window = []

      evaluate_now = step % length.eval_every_steps == 0 or is_last
      if evaluate_now:
        with clock.paused(state):
          eval_results = evaluate(placement, state, dataset.eval, eval_batch_size)
        num_examples = eval_results.pop('num_examples')
        logging.info('eval at step %d: loss %.4f  accuracy %.4f  (%d examples)', step,
                     eval_results['eval_loss'], eval_results['eval_accuracy'], num_examples)
        writer.write_scalars(step, eval_results)
        writer.flush()

      stopping = stop.requested(check_all_processes=step % config.log_every_steps == 0)
      if step % length.checkpoint_every_steps == 0 or is_last or stopping:
        with clock.paused(state):
          record = checkpoint_record(config, task, step, dataset)
          record['train_metrics_window'] = metrics.window_to_json(merged_window() if window else None)
          checkpoints.save(step, placement.to_saveable(state), record,
                           metrics=eval_results if evaluate_now else None)
      if stopping:
        checkpoints.wait()
        checkpoints.close()
        writer.close()
        logging.info('stopped by %s at step %d; checkpoint complete in %s; run the same command '
                     'to resume', stop.signal_name, step, checkpoints.directory)
        return {'stopped_at_step': step}

  checkpoints.wait()
  checkpoints.close()
  results = {
      'step': length.total_steps,
      **eval_results,
      'train_loss': last_train.get('train_loss'),
      'train_accuracy': last_train.get('train_accuracy'),
      'train_images_per_sec': clock.images_per_sec(config.batch_size),
      'wall_time_s': time.time() - started,
      'time_to_first_step_s': time_to_first_step,
      'memory_plan': memory_plan,
  }
  if is_main:
    metrics.write_json(os.path.join(workdir, 'results.json'), results)
  writer.close()
  return results


class TrainClock:
  """Times training steps only: compiling, evaluating and saving are paused out."""

  def __init__(self, first_step: int):
    self._lap_start, self._lap_step = time.time(), first_step
    self._train_seconds, self._train_steps = 0.0, 0

  @contextlib.contextmanager
  def paused(self, state=None):
    jax.block_until_ready(state)  # charge the steps already queued to training, not to the pause
    paused_at = time.time()
    yield
    self._lap_start += time.time() - paused_at

  def lap(self, step: int, batch_size: int, total_steps: int) -> tuple[float, float]:
    """Images/s since the last lap and the ETA in seconds."""
    seconds, steps = time.time() - self._lap_start, step - self._lap_step
    self._train_seconds += seconds
    self._train_steps += steps
    self._lap_start, self._lap_step = time.time(), step
    return steps * batch_size / max(seconds, 1e-9), (total_steps - step) * seconds / max(steps, 1)

  def images_per_sec(self, batch_size: int) -> float:
    return self._train_steps * batch_size / max(self._train_seconds, 1e-9)


def expected_record(config: ml_collections.ConfigDict, task: Task) -> dict:
  return {'model': config.model.name, 'num_classes': task.num_classes,
          'image_shape': list(task.image_shape)}


def format_plan(plan: dict) -> str:
  mib = lambda key: f'{plan[key] / 2**20:.1f} MiB'
  if 'total_bytes' not in plan:
    return 'not reported by this backend'
  return (f'arguments {mib("argument_bytes")}, outputs {mib("output_bytes")}, temporaries '
          f'{mib("temp_bytes")}, total {mib("total_bytes")}')


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(int(seconds), 60)
  hours, minutes = divmod(minutes, 60)
  return f'{hours}:{minutes:02d}:{seconds:02d}'
