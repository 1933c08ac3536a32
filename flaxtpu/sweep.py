"""Define config sweeps, run them locally one process per run, tabulate and plot the results.

An experiment file (`experiments/*.py`) is itself a config file: `get_config()`
returns the base config and `get_sweep()` returns the runs as a list of
override dicts `{dotted.config.key: value}`, built with `sweep`, `product`,
`zip_` and `chain` from this module:

    def get_sweep():
      return sweep.product(
          sweep.sweep('optimizer.learning_rate', [0.05, 0.1, 0.2]),
          sweep.sweep('schedule.name', ['cosine', 'onecycle']))

Run it (each run is a normal `python -m flaxtpu.main` process in
`DIR/<run name>`; re-running skips finished runs and resumes the others):

    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/lr [--parallel=N]
    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/lr --dry-run
    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/lr --report

This module only launches processes and reads files: it must never import JAX
(experiment files import it, and `flaxtpu.main` loads experiment files before
JAX starts).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import difflib
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ml_collections

from flaxtpu import config as config_lib  # no JAX inside

Overrides = dict[str, Any]
Sweep = list[Overrides]

# Statuses a run moves through; 'interrupted' = the sweep itself was stopped.
PENDING, RUNNING, DONE, FAILED, INTERRUPTED = 'pending', 'running', 'done', 'failed', 'interrupted'

SWEEP_FILE = 'sweep.json'
LOG_FILE = 'log.txt'
RESULTS_FILE = 'results.json'
METRICS_FILE = 'metrics.jsonl'
PLOTS_DIR = 'plots'
# Heads each attempt in a run's log.txt, so errors are read from the latest attempt only.
LAUNCH_MARKER = '=== flaxtpu.sweep launch'
# Run names become directory names: keep them well under common filesystem limits.
MAX_RUN_NAME_LENGTH = 120
POLL_INTERVAL_S = 0.1


class SweepError(Exception):
  """A mistake in an experiment file or on the command line, reported as one `error:` line."""


# --- defining sweeps ---------------------------------------------------------


def sweep(key: str, values: Iterable[Any]) -> Sweep:
  """One run per value of a single config key: `sweep('seed', [0, 1])` -> `[{'seed': 0}, {'seed': 1}]`."""
  if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
    raise SweepError(f'sweep({key!r}, ...) needs a list of values, got {values!r}')
  return [{key: value} for value in values]


def _merge(parts: Sequence[Mapping[str, Any]], combinator: str) -> Overrides:
  merged: Overrides = {}
  for part in parts:
    for key, value in part.items():
      # Two factors setting one key would silently make one of them a no-op.
      if key in merged:
        raise SweepError(f'{combinator}: config key {key!r} is set by more than one of its sweeps')
      merged[key] = value
  return merged


def product(*sweeps: Sequence[Mapping[str, Any]]) -> Sweep:
  """Every combination of the given sweeps; the first sweep varies slowest (like `itertools.product`)."""
  return [_merge(parts, 'product') for parts in itertools.product(*sweeps)]


def zip_(*sweeps: Sequence[Mapping[str, Any]]) -> Sweep:
  """The i-th runs of equally long sweeps merged into one run each (like `zip`, but lengths must match)."""
  lengths = [len(one_sweep) for one_sweep in sweeps]
  if len(set(lengths)) > 1:
    raise SweepError(f'zip_: sweeps have different lengths {lengths}')
  return [_merge(parts, 'zip_') for parts in zip(*sweeps)]


def chain(*sweeps: Sequence[Mapping[str, Any]]) -> Sweep:
  """The runs of each sweep one after the other."""
  return [dict(overrides) for one_sweep in sweeps for overrides in one_sweep]


# --- run names and commands ----------------------------------------------------


def format_value(value: Any) -> str:
  """A config value as `--config.KEY=` text that ml_collections parses back to the same value."""
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, float):
    return repr(value)  # Shortest text that round-trips (0.1, not 0.10000000000000001).
  return str(value)


def run_name(overrides: Mapping[str, Any]) -> str:
  """A readable, filesystem-safe directory name: `optimizer.learning_rate=0.1,schedule.name=cosine`."""
  if not overrides:
    return 'base'
  name = ','.join(f'{key}={format_value(value)}' for key, value in overrides.items())
  name = re.sub(r'[^A-Za-z0-9._,=+-]', '_', name)
  if len(name) > MAX_RUN_NAME_LENGTH:
    # A hash of the full name keeps truncated names distinct.
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    name = f'{name[:MAX_RUN_NAME_LENGTH - 9]}-{digest}'
  return name


@dataclasses.dataclass
class Run:
  """One run of a sweep: its overrides, directory name and the trainer command that runs it."""

  name: str
  overrides: Overrides
  command: list[str]
  status: str = PENDING
  error: str = ''
  returncode: int | None = None
  wall_time_s: float | None = None


def make_runs(experiment_path: str, workdir: str, runs_overrides: Sequence[Overrides],
              extra_overrides: Sequence[str] = ()) -> list[Run]:
  """The runs of a sweep with their `flaxtpu.main` commands; `extra_overrides` go to every run."""
  runs, names = [], set()
  seen_overrides: list[Overrides] = []
  for overrides in runs_overrides:
    if overrides in seen_overrides:
      raise SweepError(f'the sweep lists the run {run_name(overrides)!r} more than once')
    seen_overrides.append(overrides)
    name = run_name(overrides)
    # Different values can sanitise to the same name (e.g. 'a/b' and 'a_b').
    base_name, counter = name, 2
    while name in names:
      name, counter = f'{base_name}-{counter}', counter + 1
    names.add(name)
    command = [sys.executable, '-m', 'flaxtpu.main', f'--config={experiment_path}',
               f'--workdir={os.path.join(workdir, name)}']
    command += [f'--config.{key}={format_value(value)}' for key, value in overrides.items()]
    command += list(extra_overrides)
    runs.append(Run(name=name, overrides=dict(overrides), command=command))
  return runs


# --- loading and checking an experiment ----------------------------------------


def config_keys(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  """Every leaf key of a config as a dotted path."""
  keys = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      keys += config_keys(value, f'{prefix}{key}.')
    else:
      keys.append(f'{prefix}{key}')
  return keys


def _did_you_mean(key: str, known_keys: Sequence[str]) -> str:
  """' (did you mean 'x'?)' for the closest known key; `lr` matches `learning_rate`."""
  parent, _, leaf = key.rpartition('.')
  abbreviated = [known for known in known_keys if known.rpartition('.')[0] == parent
                 and ''.join(word[0] for word in known.rpartition('.')[2].split('_')) == leaf]
  close = abbreviated or difflib.get_close_matches(key, known_keys, n=1)
  return f' (did you mean {close[0]!r}?)' if close else ''


def check_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
  """Raise SweepError naming the key if a key is not in `config` or its value has the wrong type."""
  known_keys = config_keys(config)
  scratch = copy.deepcopy(config)
  for key, value in overrides.items():
    if key not in known_keys:
      raise SweepError(f'sweep key {key!r} is not a config key{_did_you_mean(key, known_keys)}')
    parent_path, _, leaf = key.rpartition('.')
    parent = scratch
    for part in parent_path.split('.') if parent_path else []:
      parent = parent[part]
    try:
      # ConfigDict's own type check: the same one the trainer's override applies.
      parent[leaf] = value
    except TypeError as error:
      raise SweepError(f'sweep key {key!r}: value {value!r} has the wrong type ({error})') from None


def load_experiment(path: str) -> tuple[ml_collections.ConfigDict, Sweep]:
  """Import an experiment file; return its base config and its runs' overrides, checked against the config."""
  if not os.path.isfile(path):
    raise SweepError(f'experiment file {path!r} does not exist')
  # Experiments import recipes (`from configs import ...`): make the repo root
  # (the file's grandparent, as flaxtpu.main does) and the working dir importable.
  for import_root in (os.path.dirname(os.path.dirname(os.path.abspath(path))), os.getcwd()):
    if import_root not in sys.path:
      sys.path.insert(0, import_root)
  spec = importlib.util.spec_from_file_location('flaxtpu_experiment', path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    for function in ('get_config', 'get_sweep'):
      if not callable(getattr(module, function, None)):
        raise SweepError(f'must define {function}()')
    config = module.get_config()
    runs_overrides = module.get_sweep()
  except SweepError as error:
    raise SweepError(f'{path}: {error}') from None
  if not isinstance(runs_overrides, Sequence) or not all(isinstance(o, Mapping) for o in runs_overrides):
    raise SweepError(f'{path}: get_sweep() must return a list of {{config key: value}} dicts')
  if not runs_overrides:
    raise SweepError(f'{path}: get_sweep() returned no runs')
  for overrides in runs_overrides:
    try:
      check_overrides(config, overrides)
    except SweepError as error:
      raise SweepError(f'{path}: {error}') from None
  return config, [dict(overrides) for overrides in runs_overrides]


def parse_extra_overrides(config: ml_collections.ConfigDict, args: Sequence[str],
                          swept_keys: set[str]) -> list[str]:
  """Normalise `--config.KEY=VALUE` / `--config.KEY VALUE` arguments, checking that each key exists."""
  known_keys = set(config_keys(config))
  normalised, index = [], 0
  while index < len(args):
    arg = args[index]
    if not arg.startswith('--config.'):
      raise SweepError(f'unexpected argument {arg!r} (sweep options: --workdir, --parallel, --dry-run, '
                       '--report, --config.KEY=VALUE)')
    if '=' in arg:
      key, value = arg[len('--config.'):].split('=', 1)
    elif index + 1 < len(args):
      key, value = arg[len('--config.'):], args[index + 1]
      index += 1
    else:
      raise SweepError(f'{arg} needs a value: {arg}=VALUE')
    if key not in known_keys:
      raise SweepError(f'--config.{key}: not a config key{_did_you_mean(key, sorted(known_keys))}')
    if key in swept_keys:
      raise SweepError(f'--config.{key}: the experiment sweeps this key; change the sweep, not every run')
    normalised.append(f'--config.{key}={value}')
    index += 1
  return normalised


# --- the sweep record -----------------------------------------------------------


def _write_json_atomically(path: str, content: Any) -> None:
  # A crash mid-write must not leave a half-written sweep.json behind.
  temporary = f'{path}.tmp'
  with open(temporary, 'w') as f:
    json.dump(content, f, indent=2)
  os.replace(temporary, path)


def write_sweep_record(workdir: str, experiment_path: str, runs: Sequence[Run],
                       extra_overrides: Sequence[str]) -> None:
  """Write DIR/sweep.json: every run's name, overrides, command and status."""
  _write_json_atomically(os.path.join(workdir, SWEEP_FILE), {
      'experiment': experiment_path,
      'extra_overrides': list(extra_overrides),
      'runs': [dataclasses.asdict(run) for run in runs],
  })


def read_sweep_record(workdir: str) -> dict[str, Any]:
  """DIR/sweep.json as a dict ({} when there is none or it cannot be read)."""
  try:
    with open(os.path.join(workdir, SWEEP_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def error_line(log_path: str) -> str:
  """The trainer's `error: ...` line from the last attempt in a run's log, else its last non-empty line."""
  try:
    with open(log_path, errors='replace') as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return ''
  launches = [index for index, line in enumerate(lines) if line.startswith(LAUNCH_MARKER)]
  if launches:
    lines = lines[launches[-1] + 1:]
  error_lines = [line for line in lines if line.startswith('error: ')]
  if error_lines:
    return error_lines[-1]
  return lines[-1] if lines else ''


# --- running ---------------------------------------------------------------------


def _format_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f'{hours}h{minutes:02d}m' if hours else f'{minutes}m{seconds:02d}s'


def progress_line(runs: Sequence[Run], started: Mapping[str, float], parallel: int,
                  finished_durations: Sequence[float], elapsed_s: float) -> str:
  """`done/running/failed/pending` counts and an ETA from the mean duration of finished runs."""
  counts = {status: sum(run.status == status for run in runs) for status in (DONE, RUNNING, FAILED, PENDING)}
  line = (f'[sweep] {counts[DONE]}/{len(runs)} done, {counts[RUNNING]} running, {counts[FAILED]} failed, '
          f'{counts[PENDING]} pending, elapsed {_format_duration(elapsed_s)}')
  if counts[RUNNING] + counts[PENDING] == 0:
    return line
  if not finished_durations:
    return line + ', ETA unknown until a run finishes'
  mean_s = sum(finished_durations) / len(finished_durations)
  now = time.monotonic()
  remaining_s = counts[PENDING] * mean_s + sum(
      max(mean_s - (now - started[run.name]), 0.0) for run in runs if run.status == RUNNING)
  return line + f', ETA {_format_duration(remaining_s / max(parallel, 1))}'


def _child_environment() -> dict[str, str]:
  environment = dict(os.environ)
  # The runs must import this same flaxtpu (and configs/) wherever the sweep is started from.
  repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  environment['PYTHONPATH'] = os.pathsep.join(
      [repo_root] + ([environment['PYTHONPATH']] if environment.get('PYTHONPATH') else []))
  environment['PYTHONUNBUFFERED'] = '1'  # log.txt shows progress as it happens.
  return environment


def _launch(run: Run, workdir: str, environment: Mapping[str, str]) -> tuple[subprocess.Popen, Any]:
  """Start one run's trainer, its output going to DIR/<run>/log.txt; returns the process and the open log."""
  run_dir = os.path.join(workdir, run.name)
  os.makedirs(run_dir, exist_ok=True)
  # Appending keeps the log of earlier, interrupted attempts of this run.
  log = open(os.path.join(run_dir, LOG_FILE), 'a')
  log.write(f'{LAUNCH_MARKER} {time.strftime("%Y-%m-%d %H:%M:%S")}: {shlex.join(run.command)}\n')
  log.flush()
  process = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(environment))
  return process, log


def _record_exit(run: Run, returncode: int, wall_time_s: float, workdir: str) -> None:
  """Set a finished run's status: done only on exit status 0 with a results.json, else failed + its error."""
  run_dir = os.path.join(workdir, run.name)
  run.returncode, run.wall_time_s = returncode, round(wall_time_s, 1)
  if returncode == 0 and os.path.exists(os.path.join(run_dir, RESULTS_FILE)):
    run.status, run.error = DONE, ''
  elif returncode == 0:
    run.status, run.error = FAILED, f'exited 0 but wrote no {RESULTS_FILE}'
  else:
    run.status = FAILED
    run.error = error_line(os.path.join(run_dir, LOG_FILE)) or f'exit status {returncode}'


def run_sweep(experiment_path: str, workdir: str, runs: list[Run], parallel: int,
              extra_overrides: Sequence[str]) -> list[Run]:
  """Run every unfinished run, at most `parallel` at once, keeping DIR/sweep.json current; returns `runs`."""
  os.makedirs(workdir, exist_ok=True)
  previous = read_sweep_record(workdir)
  if previous and previous.get('extra_overrides', []) != list(extra_overrides):
    print(f'[sweep] warning: command-line overrides changed from {previous.get("extra_overrides")} to '
          f'{list(extra_overrides)}; finished runs keep their old results', flush=True)
  previous_runs = {entry.get('name'): entry for entry in previous.get('runs', [])}
  finished_durations: list[float] = []
  for run in runs:
    if os.path.exists(os.path.join(workdir, run.name, RESULTS_FILE)):
      run.status = DONE
      # Keep what the sweep that finished this run measured; it also seeds the ETA.
      earlier = previous_runs.get(run.name, {})
      run.returncode, run.wall_time_s = earlier.get('returncode'), earlier.get('wall_time_s')
      if run.wall_time_s:
        finished_durations.append(run.wall_time_s)
  pending = [run for run in runs if run.status != DONE]
  if len(pending) < len(runs):
    print(f'[sweep] {len(runs) - len(pending)} run(s) already finished, skipping them', flush=True)

  environment = _child_environment()
  sweep_start = time.monotonic()
  started: dict[str, float] = {}
  processes: dict[str, tuple[subprocess.Popen, Any]] = {}

  def report_progress() -> None:
    write_sweep_record(workdir, experiment_path, runs, extra_overrides)
    elapsed_s = time.monotonic() - sweep_start
    print(progress_line(runs, started, parallel, finished_durations, elapsed_s), flush=True)

  write_sweep_record(workdir, experiment_path, runs, extra_overrides)
  try:
    while pending or processes:
      while pending and len(processes) < parallel:
        run = pending.pop(0)
        processes[run.name] = _launch(run, workdir, environment)
        started[run.name] = time.monotonic()
        run.status = RUNNING
        print(f'[sweep] start {run.name} (log: {os.path.join(workdir, run.name, LOG_FILE)})', flush=True)
        report_progress()
      time.sleep(POLL_INTERVAL_S)
      for run in runs:
        if run.name not in processes or processes[run.name][0].poll() is None:
          continue
        process, log = processes.pop(run.name)
        log.close()
        _record_exit(run, process.returncode, time.monotonic() - started[run.name], workdir)
        if run.status == DONE:
          finished_durations.append(run.wall_time_s)
          print(f'[sweep] done {run.name} in {_format_duration(run.wall_time_s)}', flush=True)
        else:
          print(f'[sweep] FAILED {run.name} (exit {run.returncode}): {run.error}', flush=True)
        report_progress()
  except KeyboardInterrupt:
    # Stop only the runs this sweep started; a re-run resumes them from their checkpoints.
    for process, _ in processes.values():
      process.terminate()
    for run in runs:
      if run.name in processes:
        process, log = processes[run.name]
        try:
          process.wait(timeout=30)
        except subprocess.TimeoutExpired:
          process.kill()
          process.wait()
        log.close()
        run.status, run.returncode = INTERRUPTED, process.returncode
    write_sweep_record(workdir, experiment_path, runs, extra_overrides)
    raise
  return runs


# --- results -------------------------------------------------------------------------


REPORT_COLUMNS = ('eval_accuracy', 'best_eval_accuracy', 'eval_loss', 'train_loss', 'step',
                  'train_images_per_sec', 'wall_time_s')


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """The records of a run's metrics.jsonl (a torn last line from an interrupted run is skipped)."""
  records = []
  try:
    with open(os.path.join(run_dir, METRICS_FILE)) as f:
      for line in f:
        try:
          record = json.loads(line)
        except ValueError:
          continue
        if isinstance(record, dict):
          records.append(record)
  except OSError:
    pass
  return records


def metric_curve(records: Sequence[Mapping[str, Any]], metric: str) -> tuple[list[float], list[float]]:
  """(steps, values) of one metric from metrics.jsonl records, in step order."""
  points = sorted((record['step'], record[metric]) for record in records
                  if metric in record and 'step' in record and record[metric] is not None)
  return [step for step, _ in points], [value for _, value in points]


def collect_results(workdir: str, runs: Sequence[Run],
                    config: ml_collections.ConfigDict | None = None) -> list[dict[str, Any]]:
  """One row per run (swept values, results.json numbers, best eval accuracy, status, error), best first.

  A key that some runs sweep and others leave alone shows the base `config`'s value for the latter.
  """
  base_values = {key: config_lib.get(config, key) for key in _swept_keys(runs)} if config is not None else {}
  recorded = {entry['name']: entry for entry in read_sweep_record(workdir).get('runs', [])}
  rows = []
  for order, run in enumerate(runs):
    run_dir = os.path.join(workdir, run.name)
    results: dict[str, Any] = {}
    try:
      with open(os.path.join(run_dir, RESULTS_FILE)) as f:
        results = json.load(f)
    except (OSError, ValueError):
      pass
    _, eval_accuracies = metric_curve(read_metrics(run_dir), 'eval_accuracy')
    if 'eval_accuracy' in results:
      eval_accuracies.append(results['eval_accuracy'])
    if results:
      status, error = DONE, ''
    else:
      # Status of a run without results: what the last sweep saw, or what its directory shows.
      default_status = 'incomplete' if os.path.isdir(run_dir) else PENDING
      status = recorded.get(run.name, {}).get('status', default_status)
      if status in (DONE, RUNNING):
        status = 'incomplete'
      error = recorded.get(run.name, {}).get('error', '')
    row = {'run': run.name, **base_values, **run.overrides}
    row.update({column: results.get(column) for column in REPORT_COLUMNS})
    row['best_eval_accuracy'] = max(eval_accuracies) if eval_accuracies else None
    row.update(status=status, error=error, _order=order)
    rows.append(row)
  # Best final accuracy first; runs without one keep sweep order at the end.
  rows.sort(key=lambda row: (row['eval_accuracy'] is None, -(row['eval_accuracy'] or 0.0), row['_order']))
  for row in rows:
    del row['_order']
  return rows


def _swept_keys(runs: Sequence[Run]) -> list[str]:
  keys: list[str] = []
  for run in runs:
    keys += [key for key in run.overrides if key not in keys]
  return keys


ROUNDED_COLUMNS = ('eval_accuracy', 'best_eval_accuracy', 'eval_loss', 'train_loss')


def _markdown_cell(column: str, value: Any) -> str:
  if value is None:
    return '-'
  if isinstance(value, float) and column in ROUNDED_COLUMNS:
    return f'{value:.4f}'
  if column in ('train_images_per_sec', 'wall_time_s') and isinstance(value, (int, float)):
    return f'{value:.0f}'
  return format_value(value).replace('|', '\\|')


def write_tables(workdir: str, runs: Sequence[Run], rows: Sequence[Mapping[str, Any]], title: str) -> None:
  """DIR/results.csv (exact numbers) and DIR/results.md (rounded; failed runs' errors below the table)."""
  keys = _swept_keys(runs)
  columns = ['run'] + keys + list(REPORT_COLUMNS) + ['status', 'error']
  with open(os.path.join(workdir, 'results.csv'), 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(columns)
    for row in rows:
      writer.writerow(['' if row.get(column) is None else
                       (repr(row[column]) if isinstance(row[column], float) else row[column])
                       for column in columns])
  headers = {'eval_accuracy': 'eval acc', 'best_eval_accuracy': 'best eval acc', 'eval_loss': 'eval loss',
             'train_loss': 'train loss', 'step': 'steps', 'train_images_per_sec': 'images/s',
             'wall_time_s': 'wall s', 'status': 'status'}
  table_columns = keys + list(REPORT_COLUMNS) + ['status']
  lines = [f'# {title}', '', '| ' + ' | '.join(headers.get(c, c) for c in table_columns) + ' |',
           '|' + '|'.join('---' for _ in table_columns) + '|']
  for row in rows:
    lines.append('| ' + ' | '.join(_markdown_cell(c, row.get(c)) for c in table_columns) + ' |')
  errors = [row for row in rows if row['error']]
  if errors:
    lines += ['', 'Errors:', '']
    lines += [f'- `{row["run"]}`: {row["error"]}' for row in errors]
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def write_plots(workdir: str, runs: Sequence[Run], rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """DIR/plots/*.png: eval accuracy and train loss curves, and final eval accuracy against each swept key."""
  import matplotlib  # Imported here: the runner and the experiment files never need it.
  matplotlib.use('Agg')
  from matplotlib import pyplot

  plots_dir = os.path.join(workdir, PLOTS_DIR)
  os.makedirs(plots_dir, exist_ok=True)
  written = []

  def save(figure, axes, name: str, legend_entries: int) -> None:
    if 0 < legend_entries <= 12:
      axes.legend(fontsize=6)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = os.path.join(plots_dir, name)
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
    written.append(path)

  for metric, label in (('eval_accuracy', 'eval accuracy'), ('train_loss', 'train loss')):
    figure, axes = pyplot.subplots(figsize=(6, 4))
    plotted = 0
    for run in runs:
      steps, values = metric_curve(read_metrics(os.path.join(workdir, run.name)), metric)
      if steps:
        axes.plot(steps, values, marker='.' if len(steps) < 30 else None, label=run.name)
        plotted += 1
    if not plotted:
      pyplot.close(figure)
      continue
    axes.set(xlabel='step', ylabel=label, title=f'{label} per run')
    save(figure, axes, f'{metric}.png', plotted)

  finished = [row for row in rows if row['eval_accuracy'] is not None]
  keys = _swept_keys(runs)
  for key in keys:
    values = [row.get(key) for row in finished]
    if len({format_value(value) for value in values}) < 2:
      continue
    numeric = all(_is_number(value) for value in values)
    if not numeric:
      # Categorical axis: values in order of first appearance.
      categories = list(dict.fromkeys(format_value(value) for value in values))
    # One line per combination of the other swept keys, so lr x schedule reads as one curve per schedule.
    other_keys = [other for other in keys if other != key
                  and len({format_value(row.get(other)) for row in finished}) > 1]
    groups: dict[str, list[tuple[float, float]]] = {}
    for row in finished:
      group = ','.join(f'{other}={format_value(row.get(other))}' for other in other_keys if other in row)
      x = row[key] if numeric else categories.index(format_value(row[key]))
      groups.setdefault(group, []).append((x, row['eval_accuracy']))
    figure, axes = pyplot.subplots(figsize=(6, 4))
    for group, points in groups.items():
      points.sort()
      axes.plot([x for x, _ in points], [y for _, y in points], marker='o', label=group or None)
    if numeric and min(values) > 0 and max(values) / min(values) >= 10:
      axes.set_xscale('log')
    if not numeric:
      axes.set_xticks(range(len(categories)), categories, rotation=20, fontsize=7)
    axes.set(xlabel=key, ylabel='final eval accuracy', title=f'final eval accuracy vs {key}')
    save(figure, axes, f'eval_accuracy_vs_{re.sub(r"[^A-Za-z0-9._-]", "_", key)}.png',
         len(groups) if any(groups) else 0)
  return written


def write_report(experiment_path: str, workdir: str, runs: Sequence[Run],
                 config: ml_collections.ConfigDict | None = None) -> list[dict[str, Any]]:
  """Write DIR/results.md, DIR/results.csv and DIR/plots/*.png; returns the table rows, best first."""
  rows = collect_results(workdir, runs, config)
  os.makedirs(workdir, exist_ok=True)
  write_tables(workdir, runs, rows, title=f'{experiment_path} ({len(runs)} runs)')
  write_plots(workdir, runs, rows)
  return rows


# --- command line ------------------------------------------------------------------


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(
      prog='python -m flaxtpu.sweep', description=__doc__.split('\n\n')[0],
      epilog='Extra --config.KEY=VALUE arguments are passed to every run.')
  parser.add_argument('experiment', help='experiment file defining get_config() and get_sweep()')
  parser.add_argument('--workdir', required=True, help='sweep directory; each run goes to WORKDIR/<run name>')
  parser.add_argument('--parallel', type=int, default=1, help='runs at once (each is a full trainer process)')
  parser.add_argument('--dry-run', action='store_true', help='print the commands, one per line; run nothing')
  parser.add_argument('--report', action='store_true', help='only (re)write the results table and plots')
  # --config.* overrides are split off first: argparse would take them for abbreviations.
  config_args, other_args, index = [], [], 0
  while index < len(argv):
    arg = argv[index]
    if arg.startswith('--config.'):
      config_args.append(arg)
      if '=' not in arg and index + 1 < len(argv):
        config_args.append(argv[index + 1])
        index += 1
    else:
      other_args.append(arg)
    index += 1
  return parser.parse_args(other_args), config_args


def _raise_keyboard_interrupt(signal_number: int, frame: Any) -> None:
  raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
  """The `python -m flaxtpu.sweep` CLI; returns the exit status (0 only if every run finished)."""
  args, config_args = _parse_args(sys.argv[1:] if argv is None else argv)
  try:
    if args.parallel < 1:
      raise SweepError(f'--parallel={args.parallel}: must be at least 1')
    config, runs_overrides = load_experiment(args.experiment)
    swept_keys = {key for overrides in runs_overrides for key in overrides}
    extra_overrides = parse_extra_overrides(config, config_args, swept_keys)
    runs = make_runs(args.experiment, args.workdir, runs_overrides, extra_overrides)
  except SweepError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  except Exception as error:  # A bug in the experiment file: say so in one line, then show where.
    print(f'error: loading {args.experiment} failed: {type(error).__name__}: {error}', file=sys.stderr)
    traceback.print_exc()
    return 2

  if args.dry_run:
    for run in runs:
      print(shlex.join(run.command))
    return 0
  if args.report:
    write_report(args.experiment, args.workdir, runs, config)
    print(f'[sweep] wrote {os.path.join(args.workdir, "results.md")}, results.csv, {PLOTS_DIR}/', flush=True)
    return 0

  print(f'[sweep] {len(runs)} runs of {args.experiment} in {args.workdir}, {args.parallel} at a time',
        flush=True)
  # A scheduler or `kill` stopping the sweep gets the same clean stop as Ctrl-C.
  signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
  try:
    run_sweep(args.experiment, args.workdir, runs, args.parallel, extra_overrides)
  except KeyboardInterrupt:
    print('[sweep] interrupted; run the same command again to resume', file=sys.stderr)
    write_report(args.experiment, args.workdir, runs, config)
    return 130
  rows = write_report(args.experiment, args.workdir, runs, config)
  print(f'[sweep] results: {os.path.join(args.workdir, "results.md")}', flush=True)
  best = rows[0] if rows and rows[0]['eval_accuracy'] is not None else None
  if best:
    print(f'[sweep] best: {best["run"]} eval_accuracy={best["eval_accuracy"]:.4f}', flush=True)
  failed = [run.name for run in runs if run.status != DONE]
  if failed:
    print(f'error: {len(failed)} of {len(runs)} runs failed: {", ".join(failed)}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  # Run the imported `flaxtpu.sweep`, not this `__main__` copy: experiment files import
  # flaxtpu.sweep, and its SweepError must be the class main() catches.
  from flaxtpu import sweep as sweep_module
  sys.exit(sweep_module.main())
