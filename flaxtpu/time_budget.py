"""`time_budget`: a wall-clock budget that sets the run's length, so its schedule ends on time.

Before training, a probe builds the run's model and optimizer (on a provisional
length), compiles its train step, times a few steps after compilation (input
included), one evaluation and one checkpoint save, and solves for the number
of steps N that fits

    elapsed so far + a second compile + N x step + evaluations(N) x eval + saves(N) x save + the end report

into the budget, counted from the trainer's start (`train_and_evaluate`). The
run is then built for N steps, so its warmup and decay run their whole course
and end at the last step. The plan goes to WORKDIR/time_budget.json before the
first step; a resumed run (one with checkpoints) reads it back and keeps N, so
its schedule is the one its checkpoints were trained on. At the end the run
logs how close it came and results.json gets `time_budget_s` and
`time_budget_used` (wall time / budget, this attempt's).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Optional

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from flaxtpu import files, steps
from flaxtpu.data import loaders
from flaxtpu.errors import ConfigError
from flaxtpu.evaluate import evaluate_splits
from flaxtpu.lengths import RunLength, resolved_eval_batch_size, run_length
from flaxtpu.optim_checks import parse_duration

PLAN_FILE = 'time_budget.json'
PROBE_STEPS = 12  # timed steps after two warm ones (fewer where they would take over 3% of the budget)
PROBE_LENGTH = 1_000_000  # the provisional length the probe's optimizer is built for (its steps are dropped)


def plan_path(workdir: str) -> str:
  return os.path.join(workdir, PLAN_FILE)


def saved_plan(workdir: str) -> Optional[dict]:
  return files.read_json(plan_path(workdir))


def planned_length(config: ml_collections.ConfigDict, workdir: str, num_examples: int, resuming: bool,
                   probe) -> Optional[RunLength]:
  """The run's length under its budget (None without one): the saved plan's when `resuming`, else a new
  plan from `probe()` (-> the measured seconds), written to WORKDIR/time_budget.json."""
  if not config.time_budget:
    return None
  budget = parse_duration(config.time_budget)
  if resuming:
    plan = saved_plan(workdir)
    if not plan:
      raise ConfigError(f'config.time_budget={config.time_budget!r}: the run in {workdir} started without a '
                        f'budget ({PLAN_FILE} is missing), so its schedule is not a budget\'s; drop '
                        '--config.time_budget or use another --workdir')
    logging.info('time budget: resuming the plan of %d steps (%s)', plan['steps'], plan_path(workdir))
    return run_length(config, num_examples, total_steps=plan['steps'])
  measured = probe()
  plan = solve(config, num_examples, budget, measured)
  logging.info('time budget %s: %d steps (%.3fs each), %d evaluations (%.1fs each), %d saves (%.1fs each), '
               'compile %.1fs, %.1fs already spent: the schedule ends at step %d', config.time_budget,
               plan['steps'], measured['step_s'], plan['evaluations'], measured['eval_s'], plan['saves'],
               measured['save_s'], measured['compile_s'], measured['elapsed_s'], plan['steps'])
  if jax.process_index() == 0:
    files.write_json(plan_path(workdir), plan)
  return run_length(config, num_examples, total_steps=plan['steps'])


def solve(config: ml_collections.ConfigDict, num_examples: int, budget: float, measured: dict) -> dict:
  """The largest N (a multiple of accumulate_steps) whose run fits the budget, with its counts."""
  left = budget - measured['elapsed_s'] - measured['compile_s'] - measured['end_s']

  def cost(total: int) -> tuple[float, int, int]:
    length = run_length(config, num_examples, total_steps=total)
    evaluations = -(-total // length.eval_every_steps)
    saves = -(-total // length.checkpoint_every_steps)
    return total * measured['step_s'] + evaluations * measured['eval_s'] + saves * measured['save_s'], \
        evaluations, saves

  accumulate = config.optimizer.accumulate_steps
  most = int(left / max(measured['step_s'], 1e-9)) // accumulate * accumulate
  low, high = accumulate, max(accumulate, most)
  while high - low > accumulate:  # cost grows with N: bisect on multiples of accumulate_steps
    middle = (low + high) // 2 // accumulate * accumulate
    low, high = (middle, high) if cost(middle)[0] <= left else (low, middle)
  steps_n = high if cost(high)[0] <= left else low
  seconds, evaluations, saves = cost(steps_n)
  if seconds > left:
    logging.warning('time budget %s is shorter than one step with its evaluation and save; training %d '
                    'steps anyway', config.time_budget, steps_n)
  return {'budget': config.time_budget, 'budget_s': budget, 'steps': steps_n, 'evaluations': evaluations,
          'saves': saves, 'planned_s': round(measured['elapsed_s'] + measured['compile_s'] + seconds
                                             + measured['end_s'], 3),
          'measured': {key: round(value, 4) for key, value in measured.items()}}


def probe(config: ml_collections.ConfigDict, dataset, mesh, eval_sets: list, started: float,
          teacher=None, teacher_variables=None) -> dict:
  """Seconds per train step (after compilation), per evaluation, per save; the compile; time so far."""
  budget = parse_duration(config.time_budget)
  length = run_length(config, len(dataset.train), total_steps=PROBE_LENGTH)
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length,
                           class_weights=dataset.class_weights, teacher=teacher)
  placement = steps.place(task, mesh, config, teacher_variables)
  state = steps.create_state(task, placement, config.seed)
  batches = (placement.put_train_batch(tuple(batch)[:2]) for batch in loaders.train_batches(
      dataset, seed=config.seed, batch_size=config.batch_size, first_step=0, last_step=PROBE_STEPS + 2,
      process_index=jax.process_index(), process_count=jax.process_count(),
      alternate_flip=config.augment.alternate_flip))
  first = next(batches)
  compile_started = time.time()
  train_step, _ = placement.compile_train_step(state, first)
  compile_s = time.time() - compile_started
  for _ in range(2):  # warm: the first runs of a compiled step are slower
    state, step_metrics = train_step(state, next(batches) if _ else first)
  jax.block_until_ready(step_metrics)
  times, timed_started = [], time.time()
  for batch in batches:
    step_started = time.time()
    state, step_metrics = train_step(state, batch)
    jax.block_until_ready(step_metrics)
    times.append(time.time() - step_started)
    if time.time() - timed_started > 0.03 * budget and len(times) >= 3:
      break
  eval_started = time.time()
  evaluate_splits(placement, state, eval_sets, resolved_eval_batch_size(config))
  eval_s = time.time() - eval_started
  save_s = _time_save(placement.to_saveable(state))
  return {'step_s': float(np.mean(times)), 'eval_s': eval_s, 'save_s': save_s, 'compile_s': compile_s,
          'end_s': eval_s + 1.0,  # the end's report (per-class files, curves): about one more evaluation
          'elapsed_s': time.time() - started}


def _time_save(state) -> float:
  """Seconds to write `state` with orbax (what a checkpoint writes; its record aside)."""
  with tempfile.TemporaryDirectory(prefix='flaxtpu-budget-') as directory:
    started = time.time()
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(os.path.join(directory, 'state'), state)
      checkpointer.wait_until_finished()
    return time.time() - started


def report(config: ml_collections.ConfigDict, workdir: str, wall_time_s: float, steps_done: int) -> dict:
  """The end's line (how close the run came to its budget) and results.json's keys; {} without a budget."""
  if not config.time_budget:
    return {}
  budget = parse_duration(config.time_budget)
  plan = saved_plan(workdir) or {}
  logging.info('time budget %s: %d steps in %.1fs, %.1f%% of the budget (planned %.1fs)', config.time_budget,
               steps_done, wall_time_s, 100 * wall_time_s / budget, plan.get('planned_s', float('nan')))
  return {'time_budget_s': budget, 'time_budget_used': round(wall_time_s / budget, 4)}
