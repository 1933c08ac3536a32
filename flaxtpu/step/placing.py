"""How the steps and the state are placed on the devices: `Placement`, the one place that knows whether they
run as `jax.jit` over a mesh or as `jax.pmap`, with the ahead-of-time compile of the train step (in a thread,
`StepAhead`, while the state is made; `compile_plan.py` compiles it on zeros for `--mode=plan` and the
benchmarks), and the state initialised straight into its shardings.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from flaxtpu.augmentation import augment
from flaxtpu.optimizers import step_inputs
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size
from flaxtpu.step import parallel
from flaxtpu.step.steps import (
  ModelState,
  Task,
  TrainState,
  eval_step,
  init_model,
  init_state,
  logits_fn,
  train_step,
)


@dataclasses.dataclass
class Placement:
  """How state and batches live on the devices, and the compiled steps that use them.

  Every difference between `jit` and `pmap` lives here. Under `jit` the state
  is global arrays in `state_shardings`; under `pmap` it is one copy per local
  device. `to_saveable`/`from_saveable` convert to and from the global layout
  that checkpoints hold; `to_host_metrics` turns what a step returns into one
  clu collection.
  """
  mesh: jax.sharding.Mesh
  parallelism: str
  state_shardings: Any
  abstract_state: Any  # shapes + shardings of the saveable (global) state: a restore target
  train_step: Optional['TrainStep']  # None for an inference task
  eval_step: Callable
  logits: Callable
  put_train_batch: Callable
  put_eval_batch: Callable
  to_saveable: Callable
  from_saveable: Callable
  to_host_metrics: Callable
  frozen: tuple = ()  # what every train step takes after (state, batch), never changed: a teacher's weights

  def compile_train_step(self, state, batch) -> tuple[Callable, dict]:
    """Compiles the train step ahead of time; returns it, called as (state, batch), with the
    per-device memory XLA plans. `state` may be `abstract_state` (under jit: shapes and shardings are
    all the program is built from)."""
    started, events_before = time.time(), _cache_events().copy()
    compiled = self.train_step.lower(state, batch, *self.frozen).compile()
    plan = {'compile_seconds': round(time.time() - started, 3), **_memory_plan(compiled),
            'compiled_from': _compiled_from(_cache_events() - events_before)}
    numbers, frozen = self.train_step.numbers, self.frozen
    return CompiledTrainStep(compiled, numbers, frozen), plan



@dataclasses.dataclass(frozen=True)
class StepAhead:
  """A train step compiling in a thread for the abstract state and a zero batch (under jit, where shapes
  and shardings are all its program is built from), while the caller initialises or restores the state."""
  batch_avals: Any  # the shapes, dtypes and shardings it is compiled for
  future: concurrent.futures.Future  # of what `Placement.compile_train_step` returns

  @classmethod
  def start(cls, task: Task, placement: Placement, batch_size: int) -> StepAhead:
    assert placement.parallelism == 'jit', 'pmap lowers its step for the arrays of a state'
    batch, future = zero_batch(task, placement, batch_size), concurrent.futures.Future()

    def compile_step() -> None:
      try:
        future.set_result(placement.compile_train_step(placement.abstract_state, batch))
      except BaseException as e:  # pylint: disable=broad-except  # raised where the result is taken
        future.set_exception(e)
    # Not a daemon: a run that stops (or fails) before its first step has saved what it had, then the
    # interpreter waits for XLA here instead of tearing it down mid-compile (an abort, not exit 0).
    threading.Thread(target=compile_step, name='flaxtpu-compile-step').start()
    return cls(_avals(batch), future)

  def result_for(self, batch) -> Optional[tuple[Callable, dict]]:
    """The compiled step and its plan; None where `batch` is not what it was compiled for."""
    return self.future.result() if _avals(batch) == self.batch_avals else None


def _avals(tree) -> list:
  return [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(tree)]


@dataclasses.dataclass(frozen=True)
class CompiledTrainStep:
  """The train step compiled ahead of time, called as (state, batch); XLA's analyses of it (cost_analysis,
  memory_analysis, as_text) are its program's."""
  compiled: Any  # jax.stages.Compiled, taking (state, batch, numbers, *frozen)
  numbers: dict
  frozen: tuple

  def __call__(self, state, batch):
    return self.compiled(state, batch, self.numbers, *self.frozen)

  def __getattr__(self, name: str):
    return getattr(self.compiled, name)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The placed train step with the run's numbers (step_inputs.py) bound to its third argument: called and
  lowered as (state, batch, *frozen), one program for any learning rate, decay or run length."""
  program: Any  # jax.jit or jax.pmap of `train_step`, called as (state, batch, numbers, *frozen)
  numbers: dict  # the task's numbers, placed as the program takes them ({}: compiled in as constants)

  def __call__(self, state, batch, *frozen):
    return self.program(state, batch, self.numbers, *frozen)

  def lower(self, state, batch, *frozen):
    return self.program.lower(state, batch, self.numbers, *frozen)


# jax.monitoring's persistent-cache events since start-up, counted for the thread that compiled (programs
# compile side by side: the state's initialisation beside the train step): whether a compile loaded its
# program or built it.
_CACHE_EVENTS = threading.local()


def _cache_events() -> collections.Counter:
  if not hasattr(_CACHE_EVENTS, 'counts'):
    _CACHE_EVENTS.counts = collections.Counter()
  return _CACHE_EVENTS.counts


def _count_cache_event(event: str, **_) -> None:
  if event.startswith('/jax/compilation_cache/'):
    _cache_events().update([event])


jax.monitoring.register_event_listener(_count_cache_event)


def _compiled_from(events: collections.Counter) -> str:
  """'persistent cache' (XLA's program loaded, not compiled), 'XLA' (compiled, and saved where the cache is
  on) or 'XLA, no persistent cache'."""
  if events['/jax/compilation_cache/cache_hits'] and not events['/jax/compilation_cache/cache_misses']:
    return 'persistent cache'
  return 'XLA' if jax.config.jax_compilation_cache_dir else 'XLA, no persistent cache'


def _memory_plan(compiled) -> dict:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  plan = dict(argument_bytes=int(analysis.argument_size_in_bytes),
              output_bytes=int(analysis.output_size_in_bytes),
              temp_bytes=int(analysis.temp_size_in_bytes),
              alias_bytes=int(analysis.alias_size_in_bytes))
  # Donated state buffers alias outputs: count them once.
  plan['total_bytes'] = (plan['argument_bytes'] + plan['output_bytes'] + plan['temp_bytes']
                         - plan['alias_bytes'])
  return plan


def place(task: Task, mesh: jax.sharding.Mesh, config: ml_collections.ConfigDict,
          teacher_variables: Optional[ModelState] = None) -> Placement:
  """jax.jit over the mesh with explicit shardings, or jax.pmap: the same step functions.

  A task without an optimizer places a `ModelState` (inference); with one, a
  `TrainState`. Both batch sizes are checked against the devices here, once.
  A distilling task's `teacher_variables` (already laid out as `place` lays
  out a model: global arrays under jit, replicated under pmap) become the
  train step's third argument, in the shardings they have.
  """
  parallel.check_batch_size('batch_size', config.batch_size)
  parallel.check_batch_size('eval_batch_size', resolved_eval_batch_size(config))
  per_device = config.batch_size // jax.device_count()
  if task.optimizer and augment.mixes(config.augment) and config.parallelism == 'pmap' and per_device % 2:
    raise UserError(f'config.batch_size={config.batch_size} gives {per_device} examples per device, and pmap '
                    'mixes (mixup/CutMix) pairs on one device: use a multiple of '
                    f'{2 * jax.device_count()} or parallelism=jit')
  init = init_state if task.optimizer else init_model
  abstract_state = jax.eval_shape(functools.partial(init, task), config.seed)
  state_shardings = parallel.state_shardings(abstract_state, mesh, config)
  abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                abstract_state, state_shardings)
  replicated = parallel.replicated(mesh)
  frozen = () if teacher_variables is None else (teacher_variables,)
  numbers = step_inputs.as_arrays(task.numbers or {})
  if config.parallelism == 'jit':
    batch_sharding = parallel.batch_sharding(mesh)
    put_batch = functools.partial(parallel.to_global, sharding=batch_sharding)
    frozen_shardings = tuple(jax.tree.map(lambda x: x.sharding, f) for f in frozen)
    program = jax.jit(functools.partial(train_step, task=task),
                      in_shardings=(state_shardings, batch_sharding, replicated, *frozen_shardings),
                      out_shardings=(state_shardings, replicated), donate_argnums=0)
    placed = jax.tree.map(lambda x: jax.make_array_from_callback((), replicated, lambda _: x), numbers)
    return Placement(
        mesh=mesh, parallelism='jit', state_shardings=state_shardings, abstract_state=abstract_state,
        train_step=TrainStep(program, placed) if task.optimizer else None,
        eval_step=jax.jit(functools.partial(eval_step, task=task),
                          in_shardings=(state_shardings, batch_sharding),
                          out_shardings=(replicated, batch_sharding)),
        logits=jax.jit(functools.partial(logits_fn, task=task),
                       in_shardings=(state_shardings, batch_sharding), out_shardings=replicated),
        put_train_batch=put_batch, put_eval_batch=put_batch,
        to_saveable=lambda state: state, from_saveable=lambda state: state,
        to_host_metrics=lambda collection: collection, frozen=frozen)
  axis = parallel.PMAP_AXIS
  pmapped_eval = jax.pmap(functools.partial(eval_step, task=task, axis_name=axis), axis_name=axis)
  pmapped_logits = jax.pmap(functools.partial(logits_fn, task=task), axis_name=axis)
  return Placement(
      mesh=mesh, parallelism='pmap', state_shardings=state_shardings, abstract_state=abstract_state,
      train_step=TrainStep(
          jax.pmap(functools.partial(train_step, task=task, axis_name=axis), axis_name=axis,
                   donate_argnums=0),
          parallel.replicate(jax.tree.map(jnp.asarray, numbers))) if task.optimizer else None,
      eval_step=lambda state, batch: _first_metrics(*pmapped_eval(state, batch)),
      logits=lambda state, images: pmapped_logits(state, images).reshape(-1, task.num_classes),
      put_train_batch=parallel.to_pmap_batch, put_eval_batch=parallel.to_pmap_batch,
      to_saveable=lambda state: parallel.unreplicate_to_mesh(state, mesh),
      from_saveable=parallel.replicate,
      to_host_metrics=lambda collection: collection.unreplicate(), frozen=frozen)


def _first_metrics(batch_metrics, logits):
  """A pmapped eval step's metrics are replicated (device 0's copy will do); its logits stay per device."""
  return jax.tree.map(lambda x: x[0], batch_metrics), logits


def create_state(task: Task, placement: Placement, seed: int, fitted: Optional[dict] = None) -> TrainState:
  """Initialises the state straight into its shardings: no full copy on one device first. The seed is
  an input, not a constant: runs that differ in it share one program (a seed sweep compiles it once)."""
  traced = -2**31 <= seed < 2**31  # PRNGKey takes an int32 array as it takes the int
  state = jax.jit(functools.partial(init_state, task), static_argnums=() if traced else 0,
                  out_shardings=placement.state_shardings)(np.int32(seed) if traced else seed, fitted)
  return placement.from_saveable(state)


def zero_batch(task: Task, placement: Placement, batch_size: int):
  """A batch of zeros as the train step takes it (this process's rows, placed): what a step is compiled
  for before its data is read."""
  local_batch_size = batch_size // jax.process_count()
  images = np.zeros((local_batch_size, *task.image_shape), np.uint8)
  labels = (np.zeros((local_batch_size, task.num_classes), np.uint8) if task.multilabel
            else np.zeros((local_batch_size,), np.int32))
  return placement.put_train_batch((images, labels))
