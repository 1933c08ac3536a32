"""The first step of a run comes sooner: the train step compiles in a thread while the state is initialised
(or restored), and the initialisation's program takes the seed as an input (a seed sweep compiles it once)."""

import collections
import functools
import threading

import jax
import numpy as np

from configs import cifar10_resnet
from flaxtpu.settings import lengths
from flaxtpu.step import parallel, placing, steps


def _placed(**overrides):
  config = cifar10_resnet.get_config()  # crop + flip, Nesterov SGD, warmup + cosine, label smoothing
  config.model.name = 'cnn'
  config.batch_size = 16
  config.update_from_flattened_dict(overrides)
  task = steps.create_task(config, num_classes=10, image_shape=(8, 8, 3), mean=np.zeros(3), std=np.ones(3),
                           length=lengths.run_length(config, 256))
  return config, task, placing.place(task, parallel.make_mesh(config), config)


def _batch(placement, size=16):
  rng = np.random.default_rng(0)
  return placement.put_train_batch((rng.integers(0, 256, (size, 8, 8, 3), np.uint8),
                                    rng.integers(0, 10, (size,), np.int32)))


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_the_step_compiled_ahead_trains_as_the_step_compiled_for_the_state():
  """Compiled from the abstract state and a zero batch in a thread, the step takes the real state and
  batch and gives the loss and parameters of the step compiled for them, bit for bit; a batch of another
  shape is not given it."""
  config, task, placement = _placed()
  ahead = placing.StepAhead.start(task, placement, config.batch_size)
  assert ahead.result_for(_batch(placement, size=8)) is None
  batch = _batch(placement)
  ahead_step, plan = ahead.result_for(batch)
  assert plan['compiled_from'] in ('XLA', 'XLA, no persistent cache', 'persistent cache')
  own_step, _ = placement.compile_train_step(placing.create_state(task, placement, config.seed), batch)
  # Each step donates its state: one fresh state each.
  state_ahead, metrics_ahead = ahead_step(placing.create_state(task, placement, config.seed), batch)
  state_own, metrics_own = own_step(placing.create_state(task, placement, config.seed), batch)
  assert float(metrics_ahead.compute()['loss']) == float(metrics_own.compute()['loss'])
  assert all(np.array_equal(a, b) for a, b in zip(_leaves(state_ahead.params), _leaves(state_own.params)))


def test_the_seed_is_an_input_of_the_initialisation_and_gives_the_values_a_constant_seed_gives():
  """Runs that differ in their seed share the initialisation's program (the persistent cache's key is its
  text), and each seed gives the parameters it gave as a constant."""
  config, task, placement = _placed()
  state = placing.create_state(task, placement, 3)
  constant = jax.jit(functools.partial(steps.init_state, task), static_argnums=0)(3)
  assert all(np.array_equal(a, b) for a, b in zip(_leaves(state.params), _leaves(constant.params)))
  program = lambda seed: jax.jit(functools.partial(steps.init_state, task)).lower(np.int32(seed)).as_text()
  assert program(3) == program(4)
  # A seed beyond int32 still initialises (compiled in as a constant).
  big = placing.create_state(task, placement, 2**40)
  assert [x.shape for x in _leaves(big.params)] == [x.shape for x in _leaves(state.params)]


def test_each_thread_counts_its_own_persistent_cache_events():
  """Two programs compiling side by side (the state's initialisation beside the train step) each report
  where their program came from, not the other's."""
  seen = {}

  def count(name, events):
    placing._cache_events().update(events)
    seen[name] = dict(placing._cache_events())

  threads = [threading.Thread(target=count, args=('init', ['/jax/compilation_cache/cache_misses'])),
             threading.Thread(target=count, args=('step', ['/jax/compilation_cache/cache_hits']))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert seen == {'init': {'/jax/compilation_cache/cache_misses': 1},
                  'step': {'/jax/compilation_cache/cache_hits': 1}}
  assert placing._compiled_from(collections.Counter(seen['step'])) == 'persistent cache'
