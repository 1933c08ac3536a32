"""`time_budget`: a wall-clock budget that sets the run's length, so its schedule ends on time.

The plan. Before training, a probe (budget_probe.py) builds the run's model and optimizer (on a
provisional length) and times each part of a run apart (`timed`): the state's
initialisation, the train step's compile (past XLA's persistent cache: the
run's own, for a new length, finds no copy there), the first evaluation (which
compiles its step) and a second, warm one, a first and a second checkpoint save
(the time the loop waits for: the save is written in the background) and the
second's writing (the run waits for its last one), warm steps (after two
untimed ones; input included, dispatched as the loop dispatches them, their
metrics averaged every log_every_steps, evaluated and saved at the loop's
cadence, the evaluations' and saves' own time taken out: what they cost the
steps around them, such as a checkpoint being written, is the steps'), and the
end's report (per-class files and pictures, curves).
`solve` picks the largest number of steps N whose run fits

    elapsed so far + init + compile + the first evaluation's and first save's extra
    + N x step + evaluations(N) x warm evaluation + saves(N) x warm save
    + the last save's writing + the end report

into TARGET (97.5%) of the budget, counted from the trainer's start
(`train_and_evaluate`): the middle of the 90-105% a run should end in, so that
time drifting either way after the plan stays inside. The run is built for N
steps, so its warmup and decay end at its last step. The plan goes to
WORKDIR/time_budget.json before the first step.

The check. Once, early in a fresh run, `Budget.after_step` compares the loop's
own time with the plan's over a window: from the end of the run's first step
(whose compile is behind it) to the check step, the first warm evaluation
(not the first, which compiles) whose window the plan puts at 10% of the budget
or more (digits evaluates every 0.3 s: one evaluation is too short to time),
or the step at 25% of N where evaluations come later than that. If the window
took more than 2.5% more or less than planned, every measured cost is scaled by
measured/planned and the rest of the run re-planned from the time actually
spent: N changes. The check lets an error stand only where the margin between
TARGET and 100% absorbs it: one left standing runs on through the rest of the
run, and the time drifts after the check too (up to +8% on the 2 shared cores
of docs/recipes.md's runs), so a looser bound misses the band (at 10%, a +9%
window kept left a 5-minute run at 111%). The learning-rate schedule is a
function of N (cosine, linear, one-cycle and exponential decay end at N; so do rsqrt's cooldown,
SWA's start and Lookahead's last sync), so the run is rebuilt for its new N'
and its train step compiled again (that compile is counted in the re-plan; the
evaluation keeps its compiled step). Its learning rate is the first plan's
schedule up to the check step c and, after it, the rest of that schedule
stretched (or squeezed) from c..N onto c..N' (`warped_schedule`): the rate
does not jump at the re-plan, and it still reaches the schedule's end at the
run's last step. The plan file is rewritten with N', c and N, from which a
resumed run rebuilds the same schedule.

A resumed run (one with checkpoints) reads the plan back and keeps its N (the
re-planned one where the check re-planned), so its schedule is the one its
checkpoints were trained on; it is not checked again. At the end the run logs
how close it came, and results.json gets `time_budget_s` and
`time_budget_used` (wall time to the end of the report / budget, this
attempt's).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from flaxtpu.io import files
from flaxtpu.optimizers import optim
from flaxtpu.optimizers.optim_checks import parse_duration
from flaxtpu.settings.errors import ConfigError
from flaxtpu.settings.lengths import run_length
from flaxtpu.step import placing, steps

PLAN_FILE = 'time_budget.json'
TARGET = 0.975  # the plan ends the run at this share of the budget: mid-way in 90-105%, for drift either way
REPLAN_ERROR = 0.025  # the check re-plans where the loop's time is off the plan's by more than this share
CHECK_WINDOW = 0.10  # the check's window: planned to take at least this share of the budget ...
CHECK_BY = 0.25  # ... and to end by this share of the planned steps (a plain step where no evaluation does)
MAX_GROWTH = 4  # a re-plan makes the run at most this many times longer (the batches are read up to it)


def plan_path(workdir: str) -> str:
  return os.path.join(workdir, PLAN_FILE)


def saved_plan(workdir: str) -> Optional[dict]:
  return files.read_json(plan_path(workdir))


# --- the plan ----------------------------------------------------------------------------


def _due(done: int, end: int, every: int, total: int) -> int:
  """How many of the steps done+1..end the loop of a `total`-step run evaluates (or saves) after: every
  `every` steps, and the last."""
  if end <= done:
    return 0
  return end // every - done // every + (1 if end == total and total % every else 0)


def loop_seconds(config: ml_collections.ConfigDict, num_examples: int, measured: dict, done: int,
                 total: int, end: Optional[int] = None) -> tuple[float, int, int]:
  """Seconds for steps done+1..end (the last, `total`, by default) of a run of `total` steps at the
  `measured` warm costs, with the evaluations and saves among them."""
  end = total if end is None else end
  length = run_length(config, num_examples, total_steps=total)
  evaluations = _due(done, end, length.eval_every_steps, total)
  saves = _due(done, end, length.checkpoint_every_steps, total)
  seconds = ((end - done) * measured['step_s'] + evaluations * measured['eval_s']
             + saves * measured['save_s'])
  return seconds, evaluations, saves


def fixed_seconds(measured: dict) -> float:
  """What a run costs besides its steps, evaluations and saves: its state's init, its compile, the
  first evaluation's and first save's extra over a warm one, the wait for its last save to be written,
  and the end's report."""
  return (measured['init_s'] + measured['compile_s'] + measured['eval_first_s'] - measured['eval_s']
          + measured['save_first_s'] - measured['save_s'] + measured['save_write_s'] + measured['end_s'])


def most_steps(config: ml_collections.ConfigDict, num_examples: int, measured: dict, done: int,
               seconds_left: float) -> int:
  """The largest total N (a multiple of accumulate_steps, above `done`) whose steps done+1..N fit in
  `seconds_left`; the smallest such N where none fits."""
  accumulate = config.optimizer.accumulate_steps
  low = (done // accumulate + 1) * accumulate
  high = max(low, (done + int(max(seconds_left, 0.0) / max(measured['step_s'], 1e-9))) // accumulate
             * accumulate)
  fits = lambda total: loop_seconds(config, num_examples, measured, done, total)[0] <= seconds_left
  while high - low > accumulate:  # the cost grows with N: bisect on multiples of accumulate_steps
    middle = (low + high) // 2 // accumulate * accumulate
    low, high = (middle, high) if fits(middle) else (low, middle)
  return high if fits(high) else low


def solve(config: ml_collections.ConfigDict, num_examples: int, budget: float, measured: dict) -> dict:
  """The plan: the largest N that fits the budget, its counts, and the step the run checks it at."""
  left = TARGET * budget - measured['elapsed_s'] - fixed_seconds(measured)
  steps_n = most_steps(config, num_examples, measured, 0, left)
  seconds, evaluations, saves = loop_seconds(config, num_examples, measured, 0, steps_n)
  if seconds > left:
    logging.warning('time budget %s is shorter than the start-up and one step with its evaluation and '
                    'save; training %d steps anyway', config.time_budget, steps_n)
  plan = {'budget': config.time_budget, 'budget_s': budget, 'steps': steps_n, 'evaluations': evaluations,
          'saves': saves, 'planned_s': round(TARGET * budget - left + seconds, 3),
          'measured': {key: round(value, 4) for key, value in measured.items()}}
  plan['check'] = check_point(config, num_examples, plan, measured)
  return plan


def window_seconds(config: ml_collections.ConfigDict, num_examples: int, measured: dict, total: int,
                   end: int) -> float:
  """The plan's time for the check's window of a run of `total` steps: steps 2..end (the first step
  compiles), the first evaluation and first save cold."""
  seconds, evaluations, saves = loop_seconds(config, num_examples, measured, 1, total, end)
  length = run_length(config, num_examples, total_steps=total)
  if evaluations and length.eval_every_steps > 1:
    seconds += measured['eval_first_s'] - measured['eval_s']
  if saves and length.checkpoint_every_steps > 1:
    seconds += measured['save_first_s'] - measured['save_s']
  return seconds


def check_point(config: ml_collections.ConfigDict, num_examples: int, plan: dict,
                measured: dict) -> Optional[dict]:
  """Where the run checks its plan: {'step', 'planned_s'} (the window's planned seconds); None where
  the run is too short for a window."""
  total = plan['steps']
  last = int(CHECK_BY * total)
  if last < 2:
    return None
  every = run_length(config, num_examples, total_steps=total).eval_every_steps
  warm = range(2 * every, last + 1, every)  # the warm evaluations within CHECK_BY of the steps
  long_enough = lambda end: (window_seconds(config, num_examples, measured, total, end)
                             >= CHECK_WINDOW * plan['budget_s'])
  step = last
  if warm and long_enough(warm[-1]):  # the first that is: the window grows with its end
    low, high = 0, len(warm) - 1
    while low < high:
      middle = (low + high) // 2
      low, high = (low, middle) if long_enough(warm[middle]) else (middle + 1, high)
    step = warm[low]
  return {'step': step, 'planned_s': round(window_seconds(config, num_examples, measured, total, step), 4)}


def warped_schedule(config: ml_collections.ConfigDict, num_examples: int, first_steps: int, at_step: int,
                    steps_n: int) -> Callable:
  """The learning rate (of the update count) of a run planned for `first_steps` and re-planned after
  `at_step` to `steps_n`: the first plan's schedule up to `at_step`, the rest of it mapped linearly from
  at_step..first_steps onto at_step..steps_n."""
  first = run_length(config, num_examples, total_steps=first_steps)
  base = optim.learning_rate_schedule(config, first)
  at = at_step // first.accumulate_steps
  stretch = (first.total_updates - at) / max(steps_n // first.accumulate_steps - at, 1)

  def schedule(update):
    update = jnp.asarray(update, jnp.float32)
    return base(jnp.where(update <= at, update, at + (update - at) * stretch))

  return schedule


def _agreed(values: list[int]) -> list[int]:
  """Process 0's `values` on every process: each one times its own probe and loop, and all must train
  the same steps."""
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return [int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int64))]


# --- the run's side: the plan made or read back, checked once ---------------------------------


class Budget:
  """A run's time budget: its `length` (None without a budget) and its one check (`after_step`)."""

  def __init__(self, config: Optional[ml_collections.ConfigDict] = None, workdir: str = '',
               num_examples: int = 0, plan: Optional[dict] = None, started: float = 0.0,
               checked: bool = False, clock: Callable[[], float] = time.time):
    self.config, self.workdir, self.num_examples, self.plan = config, workdir, num_examples, plan
    self.started, self._clock = started, clock
    self.length = run_length(config, num_examples, total_steps=plan['steps']) if plan else None
    self.schedule = None  # the learning rate of a re-planned run (None: the config's, for `length`)
    replanned = (plan or {}).get('check') or {}
    if 'steps_before' in replanned:
      self.schedule = warped_schedule(config, num_examples, replanned['steps_before'], replanned['step'],
                                      plan['steps'])
    # The one check, in a fresh run only: a resumed one keeps the steps its checkpoints were trained for.
    self._check = None if checked or not plan else plan.get('check')
    self._window_started: Optional[float] = None

  def batches_until(self, total_steps: int) -> int:
    """The last step whose batch the run may read: a fresh run's re-plan may lengthen it."""
    return total_steps * MAX_GROWTH if self._check else total_steps

  def after_step(self, step: int) -> bool:
    """Called after each step of the loop (its evaluation and save done). At the check step, whether
    the loop's time was off the plan's by more than REPLAN_ERROR: the run is then re-planned, `length`
    and `schedule` are its new ones, and `rebuilt` gives its task and placement."""
    if not self._check:
      return False
    if step == 1:
      self._window_started = self._clock()
      return False
    if step != self._check['step'] or self._window_started is None:
      return False
    now, check = self._clock(), self._check
    self._check = None
    ratio = (now - self._window_started) / max(check['planned_s'], 1e-9)
    new_steps = self.replanned_steps(step, ratio, now - self.started) if jax.process_index() == 0 else 0
    new_steps = _agreed([new_steps])[0]
    if not new_steps:
      return False
    self.schedule = warped_schedule(self.config, self.num_examples, self.length.total_steps, step, new_steps)
    self.length = run_length(self.config, self.num_examples, total_steps=new_steps)
    return True

  def rebuilt(self, dataset, task: steps.Task, placement: placing.Placement
              ) -> tuple[steps.Task, placing.Placement]:
    """The task of the re-planned run (its optimizer on `schedule`, for `length`) and its placement, whose
    train step compiles at its first call; the evaluation keeps its compiled step."""
    new_task = steps.create_task(self.config, num_classes=task.num_classes, image_shape=task.image_shape,
                                 mean=dataset.mean, std=dataset.std, length=self.length,
                                 class_weights=dataset.class_weights, teacher=task.teacher,
                                 schedule=self.schedule)
    new_placement = placing.place(new_task, placement.mesh, self.config, *placement.frozen)
    return new_task, dataclasses.replace(new_placement, eval_step=placement.eval_step,
                                         logits=placement.logits)

  def replanned_steps(self, step: int, ratio: float, elapsed: float) -> int:
    """The check's decision (process 0's): the new N, or 0 to keep the plan's; logged and written to the
    plan file."""
    plan, measured, budget = self.plan, self.plan['measured'], self.plan['budget_s']
    check = {**plan['check'], 'measured_s': round(ratio * plan['check']['planned_s'], 4),
             'error': round(ratio - 1, 4), 'elapsed_s': round(elapsed, 3)}
    seen = (f'time budget: steps 2-{step} took {check["measured_s"]:.2f}s, the plan said '
            f'{check["planned_s"]:.2f}s ({100 * (ratio - 1):+.0f}%)')
    new_steps = 0
    if abs(ratio - 1) <= REPLAN_ERROR:
      logging.info('%s: within %g%%, the plan of %d steps stands', seen, 100 * REPLAN_ERROR, plan['steps'])
    else:
      scaled = {key: value * ratio for key, value in measured.items() if key.endswith('_s')}
      # The train step compiles again; the last save's writing and the report end the run.
      left = TARGET * budget - elapsed - scaled['compile_s'] - scaled['save_write_s'] - scaled['end_s']
      new_steps = min(most_steps(self.config, self.num_examples, scaled, step, left),
                      MAX_GROWTH * plan['steps'])
      seconds, evaluations, saves = loop_seconds(self.config, self.num_examples, scaled, step, new_steps)
      planned_s = round(TARGET * budget - left + seconds, 3)
      logging.info('%s: re-planned at %.1fs with every cost x%.2f: %d steps instead of %d (%d evaluations '
                   'and %d saves still to come), to end at %.1fs', seen, elapsed, ratio, new_steps,
                   plan['steps'], evaluations, saves, planned_s)
      if new_steps == plan['steps']:
        new_steps = 0
      else:
        check.update(steps_before=plan['steps'], planned_s_before=plan['planned_s'])
        plan.update(steps=new_steps, planned_s=planned_s,
                    evaluations=evaluations + _due(0, step, self.length.eval_every_steps, new_steps),
                    saves=saves + _due(0, step, self.length.checkpoint_every_steps, new_steps))
    plan['check'] = check
    files.write_json(plan_path(self.workdir), plan)
    return new_steps


def _plan_problem(saved: Optional[dict]) -> str:
  """What keeps a saved plan from rebuilding its run's schedule ('' where nothing does)."""
  count = lambda value: type(value) is int and value > 0  # pylint: disable=unidiomatic-typecheck  # no bool
  check = (saved or {}).get('check')
  if saved is None or not count(saved.get('steps')) or not isinstance(check, (dict, type(None))):
    return 'it is cut off or edited: no planned number of steps'
  if check and 'steps_before' in check and not (count(check['steps_before']) and count(check.get('step'))):
    return 'its re-plan lacks the step it was made at or the steps planned before it'
  return ''


def plan(config: ml_collections.ConfigDict, workdir: str, num_examples: int, resuming: bool,
         started: float, probe: Callable[[], dict]) -> Budget:
  """The run's budget: without `config.time_budget` one that does nothing (length None); when
  `resuming`, the saved plan's; else a new plan from `probe()` (-> the measured seconds), written to
  WORKDIR/time_budget.json."""
  if not config.time_budget:
    return Budget()
  budget = parse_duration(config.time_budget)
  if resuming:
    saved = saved_plan(workdir)
    if saved is None and not files.exists(plan_path(workdir)):
      raise ConfigError(f'config.time_budget={config.time_budget!r}: the run in {workdir} started without a '
                        f'budget ({PLAN_FILE} is missing), so its schedule is not a budget\'s; drop '
                        '--config.time_budget or use another --workdir')
    if problem := _plan_problem(saved):
      raise ConfigError(f'config.time_budget={config.time_budget!r}: {plan_path(workdir)} cannot be read '
                        f'back ({problem}); it holds the length the checkpoints in {workdir} were trained '
                        'for: restore it from a copy, or train afresh in another --workdir')
    logging.info('time budget: resuming the plan of %d steps (%s)', saved['steps'], plan_path(workdir))
    return Budget(config, workdir, num_examples, saved, started, checked=True)
  measured = probe()
  made = solve(config, num_examples, budget, measured)
  check = made['check'] or {}
  made['steps'], check_step = _agreed([made['steps'], check.get('step', 0)])
  made['check'] = {**check, 'step': check_step} if check_step else None
  logging.info('time budget %s: %d steps (%.4fs each), %d evaluations (%.3fs each, the first %.3fs), '
               '%d saves (%.3fs each, the first %.3fs), init %.1fs, compile %.1fs, end report %.1fs, '
               '%.1fs already spent: the schedule ends at step %d, planned to end at %.1fs; checked at '
               'step %s', config.time_budget, made['steps'], measured['step_s'], made['evaluations'],
               measured['eval_s'], measured['eval_first_s'], made['saves'], measured['save_s'],
               measured['save_first_s'], measured['init_s'], measured['compile_s'], measured['end_s'],
               measured['elapsed_s'], made['steps'], made['planned_s'], check.get('step', 'none'))
  if jax.process_index() == 0:
    files.write_json(plan_path(workdir), made)
  return Budget(config, workdir, num_examples, made, started)


# --- the probe -----------------------------------------------------------------------------------


def report(config: ml_collections.ConfigDict, workdir: str, wall_time_s: float, steps_done: int) -> dict:
  """The end's line (how close the run came to its budget) and results.json's keys; {} without a budget."""
  if not config.time_budget:
    return {}
  budget = parse_duration(config.time_budget)
  plan = saved_plan(workdir) or {}
  logging.info('time budget %s: %d steps in %.1fs, %.1f%% of the budget (planned %.1fs)', config.time_budget,
               steps_done, wall_time_s, 100 * wall_time_s / budget, plan.get('planned_s', math.nan))
  return {'time_budget_s': budget, 'time_budget_used': round(wall_time_s / budget, 4)}
