"""Turn an experiment into runs: names, commands, checks, DIR/sweep.json (processes.py runs them).

DIR may be a bucket (gs://): runs train there, and sweep.json, results and reports go there through
flaxtpu.io.files.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from flaxtpu.io import files
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
