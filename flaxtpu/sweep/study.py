"""Optuna studies: `python -m flaxtpu.sweep EXP --workdir=DIR --trials=N` searches instead of enumerating.

The experiment's `get_search(trial)` returns each trial's config overrides,
drawn with Optuna's `trial.suggest_*`; each trial is an ordinary `flaxtpu.main`
run in DIR/<trial name>, started as grid runs are (processes.launch). Optuna owns
the search: its samplers (TPE, random, QMC), pruners (median, successive
halving, Hyperband) and storages (SQLite, PostgreSQL, a journal file).

How a trial reaches the pruner: the trainer reports each evaluation to the
study's storage itself (flaxtpu/loop/pruning.py, given config.search.*), as Optuna's
own integrations do. The storage is the one place every worker already shares,
on one machine or on many SLURM nodes, so nothing else is passed between
processes, and a pruned run stops at its next step with a checkpoint.

A trial's directory name is a user attribute of the trial (`run`). A trial left
RUNNING by a stopped sweep is failed and enqueued again with its parameters and
directory, so the next command resumes it from its checkpoint: no trial is lost
or trained twice. The study only launches processes and reads files: no JAX.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ml_collections

from flaxtpu.io import files
from flaxtpu.settings.errors import UserError, raised_in
from flaxtpu.settings.metric_names import best_metric
from flaxtpu.sweep import Overrides, SweepError, processes, runner

SAMPLERS = ('tpe', 'random', 'qmc')
PRUNERS = ('none', 'median', 'halving', 'hyperband')
STUDY_FILE = 'study.db'
JOURNAL_FILE = 'study.journal'
JOURNAL_PREFIX = 'journal:'
RUN_ATTR = 'run'  # the trial's directory name under DIR
OVERRIDES_ATTR = 'overrides'  # the config overrides get_search returned
CARRIED_ATTR = 'reported'  # an interrupted trial's [step, value] reports, carried to its resumption
ERROR_ATTR = 'error'
SQLITE_LOCK_WAIT_S = 60  # how long a study waits for another process's lock on its SQLite file


def optuna():
  """Optuna, imported when a study is used (grid sweeps never need it), its INFO lines silenced."""
  import optuna as optuna_module  # pylint: disable=g-import-not-at-top
  optuna_module.logging.set_verbosity(optuna_module.logging.WARNING)
  return optuna_module


# --- storages, samplers, pruners -----------------------------------------------------


def default_storage(workdir: str, launcher: str) -> str:
  """DIR/study.db (SQLite) here; on SLURM (or where DIR holds one) a journal file, which Optuna keeps
  safe on a shared disk."""
  journal, database = (os.path.abspath(os.path.join(workdir, name)) for name in (JOURNAL_FILE, STUDY_FILE))
  if launcher == 'slurm' or (os.path.exists(journal) and not os.path.exists(database)):
    return JOURNAL_PREFIX + journal
  return 'sqlite:///' + database


def has_study(workdir: str) -> bool:
  """Whether DIR holds a study in its default storage (so --report reports it without --trials)."""
  return any(os.path.exists(os.path.join(workdir, name)) for name in (STUDY_FILE, JOURNAL_FILE))


def open_storage(url: str):
  """An Optuna storage: `journal:PATH` is a journal file, '' one in memory (a dry run's), anything else a
  database URL for SQLAlchemy."""
  storages = optuna().storages
  if not url:
    return storages.InMemoryStorage()
  if url.startswith(JOURNAL_PREFIX):
    path = url[len(JOURNAL_PREFIX):]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return storages.JournalStorage(storages.journal.JournalFileBackend(path))
  if url.startswith('sqlite:///'):
    os.makedirs(os.path.dirname(os.path.abspath(url[len('sqlite:///'):])), exist_ok=True)
    # Trials in other processes write too: wait for SQLite's lock instead of failing at once.
    return storages.RDBStorage(url, engine_kwargs={'connect_args': {'timeout': SQLITE_LOCK_WAIT_S}})
  return storages.RDBStorage(url)


def make_sampler(name: str, seed: int):
  samplers = optuna().samplers
  return {'tpe': samplers.TPESampler, 'random': samplers.RandomSampler,
          'qmc': samplers.QMCSampler}[name](seed=seed)


def make_pruner(name: str):
  pruners = optuna().pruners
  return {'none': pruners.NopPruner, 'median': pruners.MedianPruner,
          'halving': pruners.SuccessiveHalvingPruner, 'hyperband': pruners.HyperbandPruner}[name]()


def study_name(workdir: str) -> str:
  """A study is named after its directory (several can share one database)."""
  return os.path.basename(os.path.abspath(workdir).rstrip('/'))


def open_study(storage_url: str, name: str, config: ml_collections.ConfigDict, sampler: str, pruner: str,
               seed: int = 0):
  """The study (created where missing), with the sampler and pruner it was started with: a study keeps
  them in its user attributes, and running it on with others is refused. The sampler is seeded with
  `seed` plus the trials the study holds."""
  direction = 'maximize' if config.checkpoint.best_mode == 'max' else 'minimize'
  try:
    study = optuna().create_study(storage=open_storage(storage_url), study_name=name, direction=direction,
                                  sampler=make_sampler(sampler, seed), pruner=make_pruner(pruner),
                                  load_if_exists=True)
  except Exception as error:  # a database that refuses, a URL SQLAlchemy cannot read
    raise SweepError(storage_problem(storage_url, error, 'cannot open the study')) from None
  # A continued study draws on from where it is: a sampler seeded as at its start would draw its first
  # configurations again (TPE's random start-up trials, random, QMC).
  study.sampler = make_sampler(sampler, seed + len(study.get_trials(deepcopy=False)))
  for option, value in (('sampler', sampler), ('pruner', pruner)):
    recorded = study.user_attrs.get(option)
    if recorded is None:
      study.set_user_attr(option, value)
    elif recorded != value:
      raise SweepError(f'the study {name!r} in {storage_url} runs with --{option}={recorded}; pass '
                       f'--{option}={recorded} to continue it (or use another --workdir)')
  return study


def storage_problem(storage_url: str, error: BaseException, what: str = 'failed') -> str:
  """One line for a study storage that failed: locked, damaged, or out of reach, with what to do."""
  text = str(error).strip()
  detail = f'{type(error).__name__}: {text.splitlines()[0] if text else ""}'
  path = storage_url[len('sqlite:///'):] if storage_url.startswith('sqlite:///') else ''
  if path and 'database is locked' in text:
    return (f'{path} is locked by another process (waited {SQLITE_LOCK_WAIT_S:g} s): {what}; close what '
            'holds it (an sqlite3 shell, a study of another host on a shared disk), then run the same '
            'command again')
  if path and ('file is not a database' in text or 'malformed' in text):
    return (f'{path} is not a readable SQLite database ({detail}): {what}; restore it from a copy, or move '
            'it and the trial-* directories beside it aside to start the study afresh')
  if storage_url.startswith(JOURNAL_PREFIX) and isinstance(error, ValueError):
    return (f'{storage_url[len(JOURNAL_PREFIX):]} is not a readable Optuna journal ({detail}): {what}; '
            'restore it from a copy, or move it and the trial-* directories beside it aside to start afresh')
  return f'--storage={storage_url}: {what} ({detail}); check the URL and that the database is reachable'


def is_storage_error(error: BaseException) -> bool:
  """Whether `error` came from the study's storage (SQLAlchemy, Optuna's storage layer), not flaxtpu."""
  kinds = [optuna().exceptions.StorageInternalError]
  with contextlib.suppress(ImportError):
    import sqlalchemy.exc  # pylint: disable=g-import-not-at-top  # optuna's RDB storage brings it
    kinds.append(sqlalchemy.exc.SQLAlchemyError)
  return isinstance(error, tuple(kinds))


def study_pruner(storage_url: str, name: str):
  """The study as a trial's trainer loads it: with the pruner the study was started with."""
  storage = open_storage(storage_url)
  recorded = optuna().load_study(study_name=name, storage=storage).user_attrs.get('pruner', 'none')
  return optuna().load_study(study_name=name, storage=storage, pruner=make_pruner(recorded))


# --- the experiment's search space ---------------------------------------------------


def load_search(path: str) -> tuple[ml_collections.ConfigDict, Callable[[Any], Overrides]]:
  """An experiment's base config and its `get_search(trial)`."""
  module = runner.import_experiment(path, ('get_config', 'get_search'))
  return runner.base_config(module, path), module.get_search


def trial_label(trial, overrides: Overrides | None = None) -> str:
  """'trial 3 (optimizer.learning_rate=0.01, schedule.name=cosine)': what errors call a trial; before
  get_search returned, the values it had drawn."""
  shown = _params_line(overrides if overrides is not None else dict(trial.params))
  return f'trial {trial.number}' + (f' ({shown})' if shown else '')


def suggest(get_search: Callable[[Any], Overrides], trial, config: ml_collections.ConfigDict,
            path: str, extra_overrides: Sequence[str] = (), workdir: str = '',
            resolve_sources: bool = True) -> Overrides:
  """The overrides `get_search` draws for `trial`, checked as a grid's runs are: the keys and types, then
  the trial's config with the command line's overrides resolved and validated as its trainer will
  (`runner.check_run_config`). Whatever goes wrong, get_search raising included, is one SweepError line
  naming the file and the trial."""
  try:
    overrides = get_search(trial)
  except SweepError as error:
    raise SweepError(f'{path}: get_search: {trial_label(trial)}: {error}') from None
  except Exception as error:  # pylint: disable=broad-except
    raise SweepError(f'{raised_in(path, error)} (while get_search drew {trial_label(trial)}); fix the '
                     'experiment file') from None
  if not isinstance(overrides, dict) or not overrides:
    got = 'an empty dict' if overrides == {} else runner.describe_value(overrides)
    raise SweepError(f'{path}: get_search(trial) must return a non-empty {{config key: value}} dict; for '
                     f'{trial_label(trial)} it returned {got}')
  try:
    runner.check_run_config(runner.with_extra_overrides(config, extra_overrides), overrides,
                            os.path.join(workdir, run_name(trial)) if workdir else '', resolve_sources)
  except (SweepError, UserError) as error:
    raise SweepError(f'{path}: get_search: {trial_label(trial, overrides)}: {error}') from None
  return dict(overrides)


def check_search(get_search: Callable[[Any], Overrides], config: ml_collections.ConfigDict,
                 path: str, extra_overrides: Sequence[str] = (), resolve_sources: bool = True) -> None:
  """One draw in a scratch study, so a mistake in get_search is one error line before anything runs (a
  seeded draw: the line names the same values each time)."""
  scratch = optuna().create_study(sampler=optuna().samplers.RandomSampler(seed=0))
  suggest(get_search, scratch.ask(), config, path, extra_overrides, resolve_sources=resolve_sources)


# --- trials ------------------------------------------------------------------------------


def run_name(trial) -> str:
  """DIR/<this>: `trial-007`, or the directory of the interrupted trial this one resumes."""
  return trial.user_attrs.get(RUN_ATTR) or f'trial-{trial.number:03d}'


def latest_trials(study) -> list:
  """One trial per run directory, the latest (a resumed trial replaces the one it resumes), in order."""
  latest = {}
  for trial in study.get_trials(deepcopy=False):
    latest[run_name(trial)] = trial
  return sorted(latest.values(), key=lambda trial: run_name(trial))


def state_name(trial) -> str:
  """'complete', 'pruned', 'failed', 'running' or 'waiting'."""
  name = trial.state.name.lower()
  return 'failed' if name == 'fail' else name


def requeue_interrupted(study) -> list[str]:
  """Trials left RUNNING by a sweep that was stopped: each is failed and enqueued again with its
  parameters, directory and reports, so the next worker resumes it from its checkpoint."""
  trial_state = optuna().trial.TrialState
  requeued = []
  for trial in study.get_trials(deepcopy=False, states=(trial_state.RUNNING,)):
    reported = sorted([step, value] for step, value in trial.intermediate_values.items())
    study.tell(trial.number, state=trial_state.FAIL)
    study.enqueue_trial(trial.params, user_attrs={**trial.user_attrs, RUN_ATTR: run_name(trial),
                                                  CARRIED_ATTR: reported}, skip_if_exists=False)
    requeued.append(run_name(trial))
  return requeued


def foreign_runs(study, workdir: str) -> list[str]:
  """The trial-NNN directories in DIR that no trial of `study` names: left by a study whose database
  was since replaced or emptied. A new trial of that number would resume (or report) that run as its
  own."""
  known = {run_name(trial) for trial in study.get_trials(deepcopy=False)}
  try:
    names = os.listdir(workdir)
  except OSError:
    return []
  return sorted(name for name in names if re.fullmatch(r'trial-\d+', name) and name not in known
                and os.path.isdir(os.path.join(workdir, name)))


def budget_left(study, trials: int) -> bool:
  """Whether a worker may take another trial: one is waiting, or fewer than `trials` runs exist."""
  waiting = study.get_trials(deepcopy=False, states=(optuna().trial.TrialState.WAITING,))
  return bool(waiting) or len(latest_trials(study)) < trials


def trial_command(experiment: str, workdir: str, name: str, overrides: Overrides,
                  extra_overrides: Sequence[str]) -> list[str]:
  """The `flaxtpu.main` command of a trial without its study: what reproduces it alone."""
  return [sys.executable, '-m', 'flaxtpu.main', f'--config={experiment}',
          f'--workdir={os.path.join(workdir, name)}',
          *[f'--config.{key}={runner.format_value(value)}' for key, value in overrides.items()],
          *extra_overrides]


def claim(study, get_search, config, experiment: str, workdir: str, storage_url: str,
          extra_overrides: Sequence[str]) -> tuple[Any, runner.Run]:
  """Ask the study for a trial (a waiting one first) and make its run, which reports to the study."""
  trial = study.ask()
  for step, value in trial.user_attrs.get(CARRIED_ATTR, []):
    trial.report(value, int(step))
  try:
    overrides = suggest(get_search, trial, config, experiment, extra_overrides, workdir)
  except Exception:
    study.tell(trial, state=optuna().trial.TrialState.FAIL)
    raise
  name = run_name(trial)
  trial.set_user_attr(RUN_ATTR, name)
  trial.set_user_attr(OVERRIDES_ATTR, overrides)
  command = trial_command(experiment, workdir, name, overrides, extra_overrides) + [
      f'--config.search.storage={storage_url}', f'--config.search.study={study.study_name}',
      f'--config.search.trial={trial.number}']
  return trial, runner.Run(name=name, overrides=overrides, command=command)


def tell(study, trial, run: runner.Run, workdir: str, metric: str) -> None:
  """After its process ended: the trial complete with its metric, pruned, or failed with its error.
  A trial whose trainer was stopped by a signal (no results, exit 0) stays RUNNING, to be resumed."""
  trial_state = optuna().trial.TrialState
  results = files.read_json(os.path.join(workdir, run.name, runner.RESULTS_FILE)) or {}
  if run.status == runner.DONE and results.get('pruned'):
    study.tell(trial, state=trial_state.PRUNED)
  elif run.status == runner.DONE and isinstance(results.get(metric), (int, float)):
    study.tell(trial, float(results[metric]))
  elif run.returncode == 0 and not results:
    run.status = runner.INTERRUPTED
  else:
    trial.set_user_attr(ERROR_ATTR, run.error or f'results.json has no {metric}')
    study.tell(trial, state=trial_state.FAIL)


@contextlib.contextmanager
def only_sweep_here(workdir: str) -> Iterator[None]:
  """One local command per study directory: a second would re-queue the first's running trials."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, '.study.lock')
  try:
    lock = open(path, 'w')  # pylint: disable=consider-using-with  # closed by the with below
  except OSError as error:
    raise SweepError(f'{path} cannot be opened as the study\'s lock file ({error.strerror}); move it aside, '
                     'then run the same command again') from None
  with lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise SweepError(f'another python -m flaxtpu.sweep runs the study in {workdir}; wait for it (or add '
                       'workers with --parallel or --launcher=slurm)') from None
    yield


def run_trials(study, get_search, config, experiment: str, workdir: str, storage_url: str, trials: int,
               parallel: int, extra_overrides: Sequence[str], log_dir: str = '',
               environment: dict[str, str] | None = None) -> int:
  """Take trials from the study until it holds `trials` runs, `parallel` at once; returns the failures.
  The study's other workers (SLURM tasks) take trials from the same storage meanwhile."""
  metric = best_metric(config) or 'eval_accuracy'
  if foreign := foreign_runs(study, workdir):
    raise SweepError(f'{os.path.join(workdir, foreign[0])} holds a run that study {study.study_name!r} in '
                     f'{storage_url} does not know ({len(foreign)} such trial-* directories; was its '
                     'database replaced or emptied?): a new trial would take it over; restore the database, '
                     'or move the trial-* directories aside')
  environment = {**processes.child_environment(), **(environment or {})}
  free_devices = processes.device_groups(parallel)
  running: dict[str, tuple[Any, runner.Run, subprocess.Popen, Any, float, dict]] = {}
  failures = 0
  try:
    while True:
      while len(running) < parallel and budget_left(study, trials):
        trial, run = claim(study, get_search, config, experiment, workdir, storage_url, extra_overrides)
        devices = free_devices.pop()
        process, log = processes.launch(run, workdir, {**environment, **devices}, log_dir)
        running[run.name] = (trial, run, process, log, time.monotonic(), devices)
        print(f'[sweep] start {run.name} (trial {trial.number}): {_params_line(run.overrides)}', flush=True)
      if not running:
        return failures
      time.sleep(processes.POLL_INTERVAL_S)
      for name, (trial, run, process, log, started, devices) in list(running.items()):
        if process.poll() is None:
          continue
        del running[name]
        log.close()
        free_devices.append(devices)
        processes.copy_log(workdir, name, log_dir)
        processes.record_exit(run, process.returncode, time.monotonic() - started, workdir, log_dir)
        tell(study, trial, run, workdir, metric)
        failures += run.status == runner.FAILED
        print(f'[sweep] {name}: {_outcome(study, trial, run, workdir)}', flush=True)
  except BaseException:  # Ctrl-C, SIGTERM, or a trial whose draws get_search got wrong
    # The trials stay RUNNING in the study; the next command resumes them from their checkpoints.
    processes.stop_runs(workdir, log_dir, {run.name: (process, log)
                                        for _, run, process, log, _, _ in running.values()})
    raise


def _params_line(overrides: Overrides) -> str:
  return ', '.join(f'{key}={runner.format_value(value)}' for key, value in overrides.items())


def _outcome(study, trial, run: runner.Run, workdir: str) -> str:
  frozen = study.get_trials(deepcopy=False)[trial.number]
  results = files.read_json(os.path.join(workdir, run.name, runner.RESULTS_FILE)) or {}
  if run.status == runner.INTERRUPTED:
    return 'stopped before its end (resumed by the next command)'
  if run.status == runner.FAILED:
    return f'FAILED (exit {run.returncode}): {run.error}'
  steps = results.get('step')
  return f'{state_name(frozen)} at step {steps}, value {frozen.value:.4f}' if frozen.value is not None else (
      f'{state_name(frozen)} at step {steps}')


# --- what would run ---------------------------------------------------------------------------


def preview(study, get_search, config, experiment: str, workdir: str, trials: int,
            extra_overrides: Sequence[str]) -> list[str]:
  """The commands the next trials would run, drawn in an in-memory copy of the study: exact for the
  random and QMC samplers; TPE's later trials depend on results that a dry run does not have."""
  copy = optuna().create_study(directions=study.directions, sampler=study.sampler)
  copy.add_trials(study.get_trials())
  requeue_interrupted(copy)
  lines = []
  while budget_left(copy, trials):
    trial = copy.ask()
    overrides = suggest(get_search, trial, config, experiment, extra_overrides, workdir,
                        resolve_sources=False)
    name = run_name(trial)
    trial.set_user_attr(RUN_ATTR, name)
    copy.tell(trial, state=optuna().trial.TrialState.PRUNED)  # a placeholder: nothing ran
    lines.append(shlex.join(trial_command(experiment, workdir, name, overrides, extra_overrides)))
  return lines


def warn_experimental() -> None:
  """Optuna marks its matplotlib plots experimental: that is its warning, not the user's."""
  warnings.filterwarnings('ignore', category=optuna().exceptions.ExperimentalWarning)


# --- reports -------------------------------------------------------------------------------


def report_runs(study, experiment: str, workdir: str, extra_overrides: Sequence[str]) -> list[runner.Run]:
  """The study's trials as the runs of a sweep report (the latest trial of each directory)."""
  waiting = optuna().trial.TrialState.WAITING
  return [runner.Run(name=run_name(trial), overrides=dict(trial.user_attrs.get(OVERRIDES_ATTR, {})),
                     command=trial_command(experiment, workdir, run_name(trial),
                                           trial.user_attrs.get(OVERRIDES_ATTR, {}), extra_overrides),
                     status=state_name(trial), error=trial.user_attrs.get(ERROR_ATTR, ''))
          for trial in latest_trials(study) if trial.state != waiting]


def summary_lines(study, runs: Sequence[runner.Run], workdir: str, metric: str) -> list[str]:
  """The trials' states, the steps they trained against as many full runs, and the best trial's command."""
  counts = {state: sum(run.status == state for run in runs) for state in ('complete', 'pruned', 'failed')}
  steps = {run.name: (files.read_json(os.path.join(workdir, run.name, runner.RESULTS_FILE)) or {}).get('step')
           for run in runs}
  trained = sum(step or 0 for step in steps.values())
  full = max((steps[run.name] or 0 for run in runs if run.status == 'complete'), default=0)
  lines = [f'{len(runs)} trials: {counts["complete"]} complete, {counts["pruned"]} pruned, '
           f'{counts["failed"]} failed, {len(runs) - sum(counts.values())} unfinished.']
  if full:
    lines.append(f'Steps trained: {trained} ({trained / (full * len(runs)):.0%} of {len(runs)} full runs of '
                 f'{full} steps).')
  complete = [trial for trial in latest_trials(study) if state_name(trial) == 'complete']
  if complete:
    best = study.best_trial
    command = next(run.command for run in runs if run.name == run_name(best))
    lines += ['', f'Best trial: `{run_name(best)}` (trial {best.number}, {metric} {best.value:.4f}). '
              'To train it again alone:', '', '    ' + shlex.join(['python', *command[1:]])]
  return lines


def write_study_plots(study, workdir: str) -> list[str]:
  """DIR/plots/optimization_history.png and param_importances.png, drawn by Optuna with matplotlib."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  warn_experimental()
  visualization = optuna().visualization.matplotlib
  written = []
  for name, plot in (('optimization_history', visualization.plot_optimization_history),
                     ('param_importances', visualization.plot_param_importances)):
    try:
      axes = plot(study)
    except (ValueError, RuntimeError) as error:  # importances need two complete trials that differ
      print(f'[sweep] no {name}.png: {error}', flush=True)
      continue
    figure = axes.figure
    figure.set_size_inches(7, 4.5)
    figure.tight_layout()
    path = os.path.join(workdir, 'plots', f'{name}.png')
    files.makedirs(os.path.dirname(path))
    files.atomic_write(path, lambda temporary, figure=figure: figure.savefig(temporary, dpi=80, format='png'))
    pyplot.close(figure)
    written.append(path)
  return written


def write_report(study, experiment: str, workdir: str, config: ml_collections.ConfigDict,
                 extra_overrides: Sequence[str]) -> list[str]:
  """DIR/results.md and results.csv with each trial's state and steps, the grid report's plots, Optuna's
  history and importances; returns the summary lines."""
  from flaxtpu.sweep import report  # pylint: disable=g-import-not-at-top
  runs = report_runs(study, experiment, workdir, extra_overrides)
  lines = summary_lines(study, runs, workdir, best_metric(config) or 'eval_accuracy')
  report.write_report(experiment, workdir, runs, config, statuses={run.name: run.status for run in runs},
                      notes=lines, title=f'{experiment}: study {study.study_name} ({len(runs)} trials)')
  write_study_plots(study, workdir)
  return lines
