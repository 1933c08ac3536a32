"""Turn an experiment into runs and run them: names, commands, checks, DIR/sweep.json, processes, progress.

DIR may be a bucket (gs://): runs train there, and sweep.json, results and reports go there through
flaxtpu.io.files. A run's log.txt cannot be appended to in a bucket: it is written locally while the run
runs (--log-dir, by default under ~/.cache/flaxtpu/sweep-logs) and copied to DIR/<run>/log.txt when it
ends.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from flaxtpu.io import files, storage
from flaxtpu.settings.errors import UserError, raised_in
from flaxtpu.sweep import Overrides, Sweep, SweepError
from flaxtpu.validation.config import config_keys, did_you_mean

# Statuses a run moves through; 'interrupted' = the sweep itself was stopped.
PENDING, RUNNING, DONE, FAILED, INTERRUPTED = 'pending', 'running', 'done', 'failed', 'interrupted'

SWEEP_FILE = 'sweep.json'
LOCK_FILE = 'sweep.lock'  # held by the sweep command that runs or submits the runs (flaxtpu.io.lock)
LOG_FILE = 'log.txt'
RESULTS_FILE = 'results.json'
# Heads each attempt in a run's log.txt, so errors are read from the latest attempt only.
LAUNCH_MARKER = '=== flaxtpu.sweep launch'
# Run names become directory names: keep them well under common filesystem limits.
MAX_RUN_NAME_LENGTH = 120
POLL_INTERVAL_S = 0.1


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


def check_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
  """Raise SweepError naming the key if a key is not in `config` or its value has the wrong type."""
  apply_overrides(copy.deepcopy(config), overrides)


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
  """Sets each `{dotted.key: value}` on `config` with ConfigDict's own type check (the one the trainer's
  override applies); SweepError naming the key if it is not in `config` or its value has the wrong type."""
  known_keys = config_keys(config)
  for key, value in overrides.items():
    if key not in known_keys:
      raise SweepError(f'sweep key {key!r} is not a config key{did_you_mean(key, known_keys)}')
    parent_path, _, leaf = key.rpartition('.')
    parent = config
    for part in parent_path.split('.') if parent_path else []:
      parent = parent[part]
    try:
      parent[leaf] = value
    except (TypeError, ValueError) as error:
      raise SweepError(f'sweep key {key!r}: value {value!r} has the wrong type ({error})') from None


def _experiment_error(path: str, error: BaseException, stage: str) -> SweepError:
  """One line for an exception the experiment file raised while `stage` ran: where, what, the fix."""
  return SweepError(f'{raised_in(path, error)} (while {stage}); fix the experiment file (nothing ran)')


def import_experiment(path: str, functions: Sequence[str]) -> Any:
  """Import an experiment file as a module; SweepError unless it defines each of `functions`. An exception
  while it is imported (a syntax error, a NameError, ...) is one SweepError line naming its line."""
  if os.path.isdir(path):
    raise SweepError(f'{path!r} is a folder, not an experiment file; experiment files in it: '
                     f'{files.python_files(path)}')
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
  except SweepError as error:  # sweep.sweep(...) at the top level, given no list
    raise SweepError(f'{path}: {error}') from None
  except Exception as error:  # pylint: disable=broad-except
    raise _experiment_error(path, error, 'importing it') from None
  for function in functions:
    if not callable(getattr(module, function, None)):
      raise SweepError(f'{path}: must define {function}()')
  return module


def base_config(module: Any, path: str) -> ml_collections.ConfigDict:
  """The experiment's `get_config()`, checked to be a config built on flaxtpu's defaults."""
  try:
    config = module.get_config()
  except Exception as error:  # pylint: disable=broad-except
    raise _experiment_error(path, error, 'get_config() built the base config') from None
  if not isinstance(config, ml_collections.ConfigDict):
    returned = 'None (no return statement?)' if config is None else f'a {type(config).__name__}'
    raise SweepError(f'{path}: get_config() returned {returned}, not an ml_collections ConfigDict; return '
                     'flaxtpu.settings.defaults.get_config() with your changes')
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  present = set(config_keys(config))
  if missing := [key for key in config_keys(defaults.get_config()) if key not in present]:
    shown = ', '.join(missing[:3]) + (f' and {len(missing) - 3} more' if len(missing) > 3 else '')
    raise SweepError(f'{path}: get_config() returned a config without the keys {shown}; build it on '
                     'flaxtpu.settings.defaults.get_config()')
  return config


def describe_value(value: Any) -> str:
  text = repr(value)
  return f'a {type(value).__name__} ({text[:60]}{"..." if len(text) > 60 else ""})'


def load_experiment(path: str) -> tuple[ml_collections.ConfigDict, Sweep]:
  """Import an experiment file; return its base config and its runs' overrides, checked against the config.

  Anything the file raises or returns wrong is one SweepError line naming the file (and the run)."""
  module = import_experiment(path, ('get_config', 'get_sweep'))
  config = base_config(module, path)
  try:
    runs_overrides = module.get_sweep()
  except SweepError as error:
    raise SweepError(f'{path}: {error}') from None
  except Exception as error:  # pylint: disable=broad-except
    raise _experiment_error(path, error, 'get_sweep() listed the runs') from None
  if isinstance(runs_overrides, (str, bytes, Mapping)) or not isinstance(runs_overrides, Sequence):
    raise SweepError(f'{path}: get_sweep() returned {describe_value(runs_overrides)}, not a list of '
                     '{config key: value} dicts (one per run)')
  if not runs_overrides:
    raise SweepError(f'{path}: get_sweep() returned no runs')
  for index, overrides in enumerate(runs_overrides):
    if not isinstance(overrides, Mapping):
      raise SweepError(f'{path}: get_sweep() item {index} is {describe_value(overrides)}, not a '
                       '{config key: value} dict')
    bad_keys = [key for key in overrides if not isinstance(key, str)]
    if bad_keys:
      raise SweepError(f'{path}: get_sweep() item {index} has the key {bad_keys[0]!r}, not a dotted config '
                       "key such as 'optimizer.learning_rate'")
  for index, overrides in enumerate(runs_overrides):
    try:
      check_overrides(config, overrides)
    except SweepError as error:
      label = run_label(index, len(runs_overrides), run_name(overrides))
      raise SweepError(f'{path}: {label}: {error}') from None
  return config, [dict(overrides) for overrides in runs_overrides]


def run_label(index: int, count: int, name: str) -> str:
  """'run 3 of 8 (optimizer.learning_rate=0.1,schedule.name=cosine)': a run of a grid, as errors name it
  (`name`: its directory's, which lists its overrides)."""
  return f'run {index + 1} of {count} ({name})'


def with_extra_overrides(config: ml_collections.ConfigDict,
                         extra_overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """A copy of `config` with the command line's `--config.KEY=VALUE` arguments applied as the trainer's
  flags apply them (ml_collections' parsers); a value of the wrong type is one SweepError line."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  argv = ['flaxtpu.sweep', *extra_overrides]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_dict('config', copy.deepcopy(config), flag_values=flag_values, lock_config=True,
                                  sys_argv=argv)
  try:
    flag_values(argv)
  except (flags.Error, TypeError, ValueError, KeyError, AttributeError) as error:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise SweepError(f'{text.removeprefix("flag ")}; fix the value given on the command line') from None
  return flag_values.config


def check_run_config(config: ml_collections.ConfigDict, overrides: Mapping[str, Any], run_workdir: str,
                     resolve_sources: bool = True) -> None:
  """The run's config as its trainer sees it before any work: `config` (the base with the command line's
  overrides) with the run's own, resolved (its init_from source's defaults, as flaxtpu.main resolves them)
  and validated. Raises the UserError (or SweepError) the trainer would stop with.

  `resolve_sources=False` (a dry run): a run whose init_from names a source is not checked, as its
  defaults come from the source's files (a download from the hub)."""
  from flaxtpu.validation import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxtpu.validation import resolution  # pylint: disable=g-import-not-at-top
  trial = copy.deepcopy(config)
  apply_overrides(trial, overrides)
  if trial.init_from.checkpoint and not resolve_sources:
    return
  resolution.resolve(trial, run_workdir, 'train')
  config_lib.validate(trial, 'train')


def check_runs(path: str, config: ml_collections.ConfigDict, runs: Sequence[Run], workdir: str,
               extra_overrides: Sequence[str] = (), resolve_sources: bool = True) -> None:
  """Every run's config resolved and validated as its trainer will (`check_run_config`) before any starts:
  the first that cannot work is one SweepError line naming the file, the run and the problem."""
  base = with_extra_overrides(config, extra_overrides)
  for index, run in enumerate(runs):
    try:
      check_run_config(base, run.overrides, os.path.join(workdir, run.name), resolve_sources)
    except (SweepError, UserError) as error:
      raise SweepError(f'{path}: {run_label(index, len(runs), run.name)}: {error}') from None


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
      raise SweepError(f'--config.{key}: not a config key{did_you_mean(key, sorted(known_keys))}')
    if key in swept_keys:
      raise SweepError(f'--config.{key}: the experiment sweeps this key; change the sweep, not every run')
    normalised.append(f'--config.{key}={value}')
    index += 1
  return normalised


def check_data_folders(config: ml_collections.ConfigDict, runs_overrides: Sequence[Overrides],
                       extra_overrides: Sequence[str]) -> None:
  """Every run's `dataset.folder` must be a directory: caught before any run starts, not once per run."""
  extra = dict(arg[len('--config.'):].split('=', 1) for arg in extra_overrides)
  for overrides in runs_overrides:
    folder = str(overrides.get('dataset.folder', extra.get('dataset.folder', config.dataset.folder)))
    if folder and not files.isdir(folder):
      raise SweepError(f'dataset.folder={folder!r} is not a directory; pass an image folder laid out as '
                       'split/class/image with --config.dataset.folder=PATH')


# --- devices: each parallel run gets its own accelerators --------------------------


def device_groups(parallel: int) -> list[dict[str, str]]:
  """The environment that gives each of `parallel` concurrent runs its own devices.

  On CPU every run shares the cores. On a GPU host the GPUs are split evenly
  (CUDA_VISIBLE_DEVICES); JAX would otherwise have every run grab all of them.
  TPU chips cannot be shared by processes this way, so --parallel > 1 is refused.
  """
  if parallel == 1:
    return [{}]
  if glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'):
    raise SweepError(f'--parallel={parallel} on a TPU host: each run needs every TPU chip; use --parallel=1')
  gpus = visible_gpus()
  if not gpus:
    return [{} for _ in range(parallel)]
  if len(gpus) < parallel:
    raise SweepError(f'--parallel={parallel} but this host has {len(gpus)} GPU(s); runs cannot share a '
                     f'GPU: use --parallel={len(gpus)} or fewer')
  per_run = len(gpus) // parallel
  return [{'CUDA_VISIBLE_DEVICES': ','.join(gpus[i * per_run:(i + 1) * per_run])} for i in range(parallel)]


def visible_gpus() -> list[str]:
  """GPU indices this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
  if 'CUDA_VISIBLE_DEVICES' in os.environ:
    return [gpu for gpu in os.environ['CUDA_VISIBLE_DEVICES'].split(',') if gpu.strip()]
  if not shutil.which('nvidia-smi'):
    return []
  listing = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True, check=False).stdout
  return [str(index) for index, line in enumerate(listing.splitlines()) if line.startswith('GPU ')]


# --- the sweep record -----------------------------------------------------------


def write_sweep_record(workdir: str, experiment_path: str, runs: Sequence[Run],
                       extra_overrides: Sequence[str]) -> None:
  """Write DIR/sweep.json: every run's name, overrides, command and status."""
  files.write_json(os.path.join(workdir, SWEEP_FILE), {
      'experiment': experiment_path,
      'extra_overrides': list(extra_overrides),
      'runs': [dataclasses.asdict(run) for run in runs],
  })


def read_sweep_record(workdir: str) -> dict[str, Any]:
  """DIR/sweep.json as a dict ({} when there is none or it cannot be read)."""
  return files.read_json(os.path.join(workdir, SWEEP_FILE)) or {}


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


# --- logs ------------------------------------------------------------------------

LOCAL_LOGS = os.path.join('~', '.cache', 'flaxtpu', 'sweep-logs')


def log_directory(workdir: str, log_dir: str = '') -> str:
  """The local directory that holds each run's log.txt while it runs (as LOG_DIR/<run>/log.txt):
  `log_dir`, else DIR itself, or for a bucket a directory named after it under LOCAL_LOGS."""
  if log_dir:
    return log_dir
  if not storage.is_remote(workdir):
    return workdir
  return os.path.join(os.path.expanduser(LOCAL_LOGS), workdir.replace('://', os.sep, 1).rstrip('/'))


def log_path(workdir: str, name: str, log_dir: str = '') -> str:
  return os.path.join(log_directory(workdir, log_dir), name, LOG_FILE)


def copy_log(workdir: str, name: str, log_dir: str = '') -> None:
  """A bucket sweep's run log, copied (whole) from where it was written to DIR/<run>/log.txt."""
  local, kept = log_path(workdir, name, log_dir), os.path.join(workdir, name, LOG_FILE)
  if local != kept and os.path.exists(local):
    with open(local, 'rb') as f:
      content = f.read()
    files.makedirs(os.path.dirname(kept))
    with files.open_file(kept, 'wb') as f:
      f.write(content)


# --- running ---------------------------------------------------------------------


def progress_line(runs: Sequence[Run], started: Mapping[str, float], parallel: int,
                  finished_durations: Sequence[float], elapsed_s: float) -> str:
  """`done/running/failed/pending` counts and an ETA from the mean duration of finished runs."""
  counts = {status: sum(run.status == status for run in runs) for status in (DONE, RUNNING, FAILED, PENDING)}
  line = (f'[sweep] {counts[DONE]}/{len(runs)} done, {counts[RUNNING]} running, {counts[FAILED]} failed, '
          f'{counts[PENDING]} pending, elapsed {files.format_duration(elapsed_s)}')
  if counts[RUNNING] + counts[PENDING] == 0:
    return line
  if not finished_durations:
    return line + ', ETA unknown until a run finishes'
  mean_s = sum(finished_durations) / len(finished_durations)
  now = time.monotonic()
  remaining_s = counts[PENDING] * mean_s + sum(
      max(mean_s - (now - started[run.name]), 0.0) for run in runs if run.status == RUNNING)
  # Nearest second: format_duration cuts, and a live clock puts a 75 s estimate at 74.99... s.
  return line + f', ETA {files.format_duration(round(remaining_s / max(parallel, 1)))}'


def repo_root() -> str:
  """The directory holding flaxtpu/ (two levels above this file)."""
  return os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))


def child_environment() -> dict[str, str]:
  environment = dict(os.environ)
  # The runs must import this same flaxtpu (and configs/) wherever the sweep is started from:
  # put it first on their path.
  environment['PYTHONPATH'] = os.pathsep.join(
      [repo_root()] + ([environment['PYTHONPATH']] if environment.get('PYTHONPATH') else []))
  environment['PYTHONUNBUFFERED'] = '1'  # log.txt shows progress as it happens.
  return environment


def launch(run: Run, workdir: str, environment: Mapping[str, str],
            log_dir: str = '') -> tuple[subprocess.Popen, Any]:
  """Start one run's trainer, its output going to its log.txt; returns the process and the open log."""
  path = log_path(workdir, run.name, log_dir)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  kept = os.path.join(workdir, run.name, LOG_FILE)
  if path != kept and not os.path.exists(path) and files.exists(kept):
    with open(path, 'wb') as f:  # started elsewhere before: its earlier attempts stay in the log
      f.write(files.open_bytes(kept))
  # Appending keeps the log of earlier, interrupted attempts of this run.
  log = open(path, 'a')
  log.write(f'{LAUNCH_MARKER} {time.strftime("%Y-%m-%d %H:%M:%S")}: {shlex.join(run.command)}\n')
  log.flush()
  process = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(environment))
  return process, log


def record_exit(run: Run, returncode: int, wall_time_s: float, workdir: str, log_dir: str = '') -> None:
  """Set a finished run's status: done only on exit status 0 with a results.json, else failed + its error."""
  run_dir = os.path.join(workdir, run.name)
  run.returncode, run.wall_time_s = returncode, round(wall_time_s, 1)
  if returncode == 0 and files.exists(os.path.join(run_dir, RESULTS_FILE)):
    run.status, run.error = DONE, ''
  elif returncode == 0:
    run.status, run.error = FAILED, f'exited 0 but wrote no {RESULTS_FILE}'
  else:
    run.status = FAILED
    run.error = error_line(log_path(workdir, run.name, log_dir)) or f'exit status {returncode}'


def run_sweep(experiment_path: str, workdir: str, runs: list[Run], parallel: int,
              extra_overrides: Sequence[str], log_dir: str = '') -> list[Run]:
  """Run every unfinished run, at most `parallel` at once, keeping DIR/sweep.json current; returns `runs`.
  Logs go to LOG_DIR/<run>/log.txt (`log_directory`), and are copied to a bucket DIR as each run ends."""
  files.makedirs(workdir)
  previous = read_sweep_record(workdir)
  if previous and previous.get('extra_overrides', []) != list(extra_overrides):
    print(f'[sweep] warning: command-line overrides changed from {previous.get("extra_overrides")} to '
          f'{list(extra_overrides)}; finished runs keep their old results', flush=True)
  previous_runs = {entry.get('name'): entry for entry in previous.get('runs', [])}
  finished_durations: list[float] = []
  for run in runs:
    if files.exists(os.path.join(workdir, run.name, RESULTS_FILE)):
      run.status = DONE
      # Keep what the sweep that finished this run measured; it also seeds the ETA.
      earlier = previous_runs.get(run.name, {})
      run.returncode, run.wall_time_s = earlier.get('returncode'), earlier.get('wall_time_s')
      if run.wall_time_s:
        finished_durations.append(run.wall_time_s)
  pending = [run for run in runs if run.status != DONE]
  if len(pending) < len(runs):
    print(f'[sweep] {len(runs) - len(pending)} run(s) already finished, skipping them', flush=True)

  environment = child_environment()
  free_devices = device_groups(parallel)  # one group per slot, returned when its run ends
  devices_of: dict[str, dict[str, str]] = {}
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
        devices_of[run.name] = free_devices.pop()
        processes[run.name] = launch(run, workdir, {**environment, **devices_of[run.name]}, log_dir)
        started[run.name] = time.monotonic()
        run.status = RUNNING
        print(f'[sweep] start {run.name} (log: {log_path(workdir, run.name, log_dir)})', flush=True)
        report_progress()
      time.sleep(POLL_INTERVAL_S)
      for run in runs:
        if run.name not in processes or processes[run.name][0].poll() is None:
          continue
        process, log = processes.pop(run.name)
        log.close()
        free_devices.append(devices_of.pop(run.name))
        copy_log(workdir, run.name, log_dir)
        record_exit(run, process.returncode, time.monotonic() - started[run.name], workdir, log_dir)
        if run.status == DONE:
          finished_durations.append(run.wall_time_s)
          print(f'[sweep] done {run.name} in {files.format_duration(run.wall_time_s)}', flush=True)
        else:
          print(f'[sweep] FAILED {run.name} (exit {run.returncode}): {run.error}', flush=True)
        report_progress()
  except KeyboardInterrupt:
    # Stop only the runs this sweep started; a re-run resumes them from their checkpoints.
    exits = stop_runs(workdir, log_dir, processes)
    for run in runs:
      if run.name in exits:
        run.status, run.returncode = INTERRUPTED, exits[run.name]
    write_sweep_record(workdir, experiment_path, runs, extra_overrides)
    raise
  return runs


def stop_runs(workdir: str, log_dir: str, processes: dict, grace_s: float = 30) -> dict[str, int]:
  """SIGTERM to every run in `processes` ({name: (process, log file)}), so each saves a checkpoint; the
  ones still alive after `grace_s` are killed. Their logs are closed and copied; returns {name: exit}."""
  for process, _ in processes.values():
    process.terminate()
  exits = {}
  for name, (process, log) in processes.items():
    try:
      process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
    log.close()
    copy_log(workdir, name, log_dir)
    exits[name] = process.returncode
  return exits
