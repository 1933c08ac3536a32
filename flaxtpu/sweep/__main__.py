"""The `python -m flaxtpu.sweep` command line: check an experiment, then print, run or report its runs."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from flaxtpu import sweep
from flaxtpu.io import files, lock, storage, tracking
from flaxtpu.sweep import processes, report, runner, slurm
from flaxtpu.sweep import study as studies


def _at_least_one(text: str) -> int:
  """--trials=N's N: a whole number of at least 1 (without the flag there is no study)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a whole number') from None
  if value < 1:
    raise argparse.ArgumentTypeError(f'{value}: a study runs at least 1 trial')
  return value


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(
      prog='python -m flaxtpu.sweep', description=sweep.__doc__.split('\n\n')[0],
      epilog='Extra --config.KEY=VALUE arguments are passed to every run.')
  parser.add_argument('experiment', help='experiment file defining get_config() and get_sweep() (or, with '
                      '--trials, get_search(trial))')
  parser.add_argument('--workdir', required=True, help='sweep directory (or gs://bucket/path); each run goes '
                      'to WORKDIR/<run name>')
  parser.add_argument('--log-dir', default='', help='local directory for the runs\' log.txt while they run '
                      '(default: WORKDIR, or for a gs:// WORKDIR ~/.cache/flaxtpu/sweep-logs/...; copied '
                      'to WORKDIR/<run>/log.txt as each run ends)')
  parser.add_argument('--parallel', type=int, default=None,
                      help='runs at once (each is a full trainer process); local default 1, slurm: no limit')
  parser.add_argument('--dry-run', action='store_true', help='print the commands, one per line; run nothing')
  parser.add_argument('--report', action='store_true', help='only (re)write the results table and plots')
  parser.add_argument('--launcher', choices=('local', 'slurm'), default='local',
                      help='local: run here; slurm: submit the runs as one SLURM job array')
  search = parser.add_argument_group('--trials=N', 'an Optuna study over get_search(trial) instead of a grid')
  search.add_argument('--trials', type=_at_least_one, default=0, help='run the study until it holds N trials')
  search.add_argument('--sampler', choices=studies.SAMPLERS, default=None, help='how trials are drawn '
                      '(default tpe, seeded: --seed)')
  search.add_argument('--seed', type=int, default=None, help='the sampler\'s seed (default 0)')
  search.add_argument('--pruner', choices=studies.PRUNERS, default=None,
                      help='stops trials whose evaluations fall behind (halving = successive halving)')
  search.add_argument('--storage', default='', help='Optuna storage URL (postgresql://..., sqlite:///...) '
                      'or journal:PATH (a journal file); default WORKDIR/study.db, on SLURM '
                      'WORKDIR/study.journal')
  search.add_argument('--worker', type=int, default=-1, help=argparse.SUPPRESS)  # a SLURM array task
  slurm_flags = parser.add_argument_group('--launcher=slurm', 'what each run (one array task) asks SLURM for')
  slurm_flags.add_argument('--partition', default='', help='sbatch --partition')
  slurm_flags.add_argument('--time', default='', help='time limit per run, e.g. 4:00:00')
  slurm_flags.add_argument('--gpus-per-run', type=int, default=0, help='GPUs per run (--gres=gpu:N)')
  slurm_flags.add_argument('--cpus-per-run', type=int, default=0, help='CPUs per run (--cpus-per-task)')
  slurm_flags.add_argument('--mem', default='', help='memory per run, e.g. 32G')
  slurm_flags.add_argument('--sbatch', action='append', default=[], metavar='OPTION',
                           help='another sbatch option, repeatable: --sbatch=--account=lab')
  slurm_flags.add_argument('--wait', action='store_true',
                           help='wait for the runs to leave the queue, then report (exit status as local)')
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


SLURM_ONLY = ('partition', 'time', 'gpus_per_run', 'cpus_per_run', 'mem', 'sbatch', 'wait')


def _check_launcher_flags(args: argparse.Namespace) -> None:
  if (reason := storage.check_workdir_scheme(args.workdir)) is not None:
    raise sweep.SweepError(f'--workdir={args.workdir}: {reason}')
  if args.launcher == 'slurm' and storage.is_remote(args.workdir):
    # Its array scripts, job record and lock, and every run's log are local files beside WORKDIR.
    raise sweep.SweepError(f'--launcher=slurm keeps its array scripts, job record and run logs as files under'
                           f' WORKDIR, which {args.workdir} cannot hold; use a directory that the cluster\'s '
                           'nodes share as --workdir, or drop --launcher=slurm to run the sweep here')
  if args.parallel is not None and args.parallel < 1:
    raise sweep.SweepError(f'--parallel={args.parallel}: must be at least 1')
  if args.launcher == 'local':
    for name in SLURM_ONLY:
      if getattr(args, name):
        flag = '--' + name.replace('_', '-')
        raise sweep.SweepError(f'{flag} is an option of --launcher=slurm; add --launcher=slurm or drop '
                               f'{flag}')
  for value in ('gpus_per_run', 'cpus_per_run'):
    if getattr(args, value) < 0:
      raise sweep.SweepError(f'--{value.replace("_", "-")}={getattr(args, value)}: must be 0 (the '
                             'cluster default) or more')


def _check_output_folders(args: argparse.Namespace) -> None:
  """WORKDIR (local) and the run logs' folder can be written: checked before the sweep's lock, record or
  study database is made there, so a sweep that cannot write them stops in one line, with nothing made."""
  folders = (('--workdir', args.workdir, 'the sweep'),
             ('--log-dir' if args.log_dir else 'the run logs\' folder',
              processes.log_directory(args.workdir, args.log_dir), 'the runs\' logs'))
  for flag, folder, what in folders:
    if reason := files.creatable(folder):
      named = f'{flag}={folder}' if flag.startswith('--') else f'{flag} {folder}'
      raise sweep.SweepError(f'{named} cannot hold {what} ({reason}); choose a directory you can write')


def _slurm_options(args: argparse.Namespace) -> slurm.Options:
  return slurm.Options(partition=args.partition, time=args.time, gpus_per_run=args.gpus_per_run,
                       cpus_per_run=args.cpus_per_run, mem=args.mem, parallel=args.parallel or 0,
                       sbatch_args=args.sbatch)


def _refresh_slurm_statuses(args: argparse.Namespace, runs: list[runner.Run],
                            extra_overrides: list[str]) -> None:
  """Before a report: the statuses of a SLURM sweep's runs as the queue has them now."""
  if not slurm.is_slurm_sweep(args.workdir):
    return
  try:
    jobs = slurm.refresh(args.workdir, runs)
  except sweep.SweepError as error:
    print(f'[sweep] warning: {error}; the report shows what the run directories hold', file=sys.stderr)
    return
  slurm.write_record(args.workdir, args.experiment, runs, extra_overrides, jobs)
  print(slurm.counts_line(runs), flush=True)


def _refuse_runs_queued_on_slurm(workdir: str, runs: list[runner.Run]) -> None:
  """A local run of a sweep whose runs SLURM holds would train them twice at once."""
  if slurm.is_slurm_sweep(workdir) and shutil.which('squeue'):
    jobs = slurm.refresh(workdir, runs)
    queued = [jobs[run.name] for run in runs if run.status in (slurm.QUEUED, runner.RUNNING)]
    if queued:
      raise sweep.SweepError(f'{len(queued)} run(s) of this sweep are queued or running on SLURM '
                             f'({", ".join(queued)}); wait for them, or scancel them, before running it '
                             'here (or add --launcher=slurm)')
    for run in runs:
      run.status, run.error = runner.PENDING, ''


def _final_report(args: argparse.Namespace, runs: list[runner.Run], config: Any) -> int:
  rows = report.write_report(args.experiment, args.workdir, runs, config)
  print(f'[sweep] results: {os.path.join(args.workdir, "results.md")}', flush=True)
  best = rows[0] if rows and rows[0]['eval_accuracy'] is not None else None
  if best:
    print(f'[sweep] best: {best["run"]} eval_accuracy={best["eval_accuracy"]:.4f}', flush=True)
  failed = [run.name for run in runs if run.status != runner.DONE]
  if failed:
    print(f'error: {len(failed)} of {len(runs)} runs failed: {", ".join(failed)}', file=sys.stderr)
    return 1
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """The `python -m flaxtpu.sweep` CLI; returns the exit status (0 only if every run finished)."""
  args, config_args = _parse_args(sys.argv[1:] if argv is None else argv)
  storage.configure()  # a gs:// WORKDIR on an emulator: STORAGE_EMULATOR_HOST (the runs configure themselves)
  study_flags = (args.trials, args.storage, args.sampler, args.pruner, args.seed is not None,
                 args.worker >= 0)
  if any(study_flags) or (args.report and studies.has_study(args.workdir)):
    return study_main(args, config_args)
  with contextlib.ExitStack() as held:  # the sweep directory's lock, while runs are started or submitted
    return _main(args, config_args, held)


def _main(args: argparse.Namespace, config_args: list[str], held: contextlib.ExitStack) -> int:
  try:
    _check_launcher_flags(args)
    if args.report and not files.isdir(args.workdir):
      raise sweep.SweepError(f'--report: {args.workdir} holds no sweep yet (no such directory); run it '
                             'first: the same command without --report')
    config, runs_overrides = runner.load_experiment(args.experiment)
    swept_keys = {key for overrides in runs_overrides for key in overrides}
    extra_overrides = runner.parse_extra_overrides(config, config_args, swept_keys)
    runs = runner.make_runs(args.experiment, args.workdir, runs_overrides, extra_overrides)
    if not args.report:  # each run's config as its trainer will see it: a mistake stops all before any starts
      runner.check_runs(args.experiment, config, runs, args.workdir, extra_overrides,
                        resolve_sources=not args.dry_run)
    if not args.dry_run and not args.report:
      runner.check_data_folders(config, runs_overrides, extra_overrides)
      _check_output_folders(args)
      if args.launcher == 'slurm':
        slurm.check_commands()  # before the lock, which creates WORKDIR
      # One sweep per directory: a second one would start the same runs and record them from its view.
      held.enter_context(lock.WorkdirLock(args.workdir, file=runner.LOCK_FILE, who='sweep'))
      if args.launcher != 'slurm':
        processes.device_groups(args.parallel or 1)  # refuses a --parallel the accelerators cannot split
        _refuse_runs_queued_on_slurm(args.workdir, runs)
    if args.dry_run and args.launcher == 'slurm':
      slurm.dry_run(args.workdir, runs, _slurm_options(args))
      return 0
  except (sweep.SweepError, lock.WorkdirBusy) as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  except Exception as error:  # pylint: disable=broad-except
    # The experiment file's own mistakes are SweepErrors by now: anything else is flaxtpu's bug.
    print(f'error: {type(error).__name__}: {error} (a bug? the traceback follows)', file=sys.stderr)
    traceback.print_exc()
    return 2

  if args.dry_run:
    for run in runs:
      print(shlex.join(run.command))
    return 0
  if args.report:
    _refresh_slurm_statuses(args, runs, extra_overrides)
    report.write_report(args.experiment, args.workdir, runs, config)
    print(f'[sweep] wrote {os.path.join(args.workdir, "results.md")}, results.csv, {report.PLOTS_DIR}/',
          flush=True)
    return 0
  if args.launcher == 'slurm':
    return _run_on_slurm(args, runs, extra_overrides, config)

  parallel = args.parallel or 1
  print(f'[sweep] {len(runs)} runs of {args.experiment} in {args.workdir}, {parallel} at a time', flush=True)
  if (log_dir := processes.log_directory(args.workdir, args.log_dir)) != args.workdir:
    print(f'[sweep] run logs: {log_dir}/<run>/log.txt while they run, copied to {args.workdir}/<run>/log.txt '
          'as each ends', flush=True)
  # A scheduler or `kill` stopping the sweep gets the same clean stop as Ctrl-C.
  signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
  os.environ.update(tracking.parent_environment(config, extra_overrides, args.workdir))
  try:
    processes.run_sweep(args.experiment, args.workdir, runs, parallel, extra_overrides, args.log_dir)
  except KeyboardInterrupt:
    print('[sweep] interrupted; run the same command again to resume', file=sys.stderr)
    report.write_report(args.experiment, args.workdir, runs, config)
    return 130
  return _final_report(args, runs, config)


def _run_on_slurm(args: argparse.Namespace, runs: list[runner.Run], extra_overrides: list[str],
                  config: Any) -> int:
  print(f'[sweep] {len(runs)} runs of {args.experiment} in {args.workdir}, on SLURM', flush=True)
  try:
    # sbatch passes the submitting environment on: the runs become children of the sweep's MLflow run.
    os.environ.update(tracking.parent_environment(config, extra_overrides, args.workdir))
    slurm.submit(args.experiment, args.workdir, runs, _slurm_options(args), extra_overrides)
    if not args.wait:
      return 0
    slurm.wait(args.experiment, args.workdir, runs, extra_overrides)
  except sweep.SweepError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print('[sweep] stopped waiting; the runs stay queued (--report shows them, scancel stops them)',
          file=sys.stderr)
    return 130
  return _final_report(args, runs, config)


# --- --trials=N: an Optuna study ----------------------------------------------------------


def _check_study_flags(args: argparse.Namespace) -> None:
  if args.trials < 1 and not args.report:
    raise sweep.SweepError('--sampler, --pruner, --storage and --seed belong to a study: add --trials=N '
                           '(how many trials it runs)')
  if storage.is_remote(args.workdir):
    raise sweep.SweepError(f'--workdir={args.workdir}: a study keeps its trials\' logs and its lock in '
                           'local files; use a local or shared directory')
  _check_launcher_flags(args)


def study_main(args: argparse.Namespace, config_args: list[str]) -> int:
  """`--trials=N`: run (or preview, report, submit to SLURM) the study of the experiment's get_search."""
  args.sampler, args.pruner, args.seed = args.sampler or 'tpe', args.pruner or 'none', args.seed or 0
  storage_url = args.storage
  try:
    _check_study_flags(args)
    config, get_search = studies.load_search(args.experiment)
    extra_overrides = runner.parse_extra_overrides(config, config_args, swept_keys={'search.storage'})
    if not args.report:
      studies.check_search(get_search, config, args.experiment, extra_overrides,
                           resolve_sources=not args.dry_run)
    storage_url = args.storage or studies.default_storage(args.workdir, args.launcher)
    name = studies.study_name(args.workdir)
    if args.dry_run:
      return _preview_study(args, storage_url, name, config, get_search, extra_overrides)
    if args.report and _not_created(storage_url):
      raise sweep.SweepError(f'--report: {args.workdir} holds no study yet ({storage_url} does not exist); '
                             'run it first: the same command without --report')
    if not args.report:
      runner.check_data_folders(config, [{}], extra_overrides)
      _check_output_folders(args)
    study = studies.open_study(storage_url, name, config, args.sampler, args.pruner,
                               seed=args.seed + 10007 * max(args.worker, 0))
    if args.report:
      _print_summary(studies.write_report(study, args.experiment, args.workdir, config, extra_overrides))
      return 0
    if args.worker >= 0:  # one SLURM array task: trials until the study holds N, one at a time
      failures = studies.run_trials(study, get_search, config, args.experiment, args.workdir, storage_url,
                                    args.trials, 1, extra_overrides)
      return 1 if failures else 0
    if args.launcher == 'slurm':
      return _submit_study(args, study, storage_url, config, extra_overrides)
    with studies.only_sweep_here(args.workdir):
      return _run_study(args, study, storage_url, config, get_search, extra_overrides)
  except sweep.SweepError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  except Exception as error:  # pylint: disable=broad-except
    if storage_url and studies.is_storage_error(error):  # locked, damaged or gone while the study ran
      print(f'error: {studies.storage_problem(storage_url, error)} (the trials\' directories are kept)',
            file=sys.stderr)
      return 2
    # The experiment file's own mistakes are SweepErrors by now: anything else is flaxtpu's bug.
    print(f'error: {type(error).__name__}: {error} (a bug? the traceback follows)', file=sys.stderr)
    traceback.print_exc()
    return 2


def _not_created(storage_url: str) -> bool:
  """Whether a study's SQLite file or journal does not exist yet (opening it would create it)."""
  return any(storage_url.startswith(prefix) and not os.path.exists(storage_url[len(prefix):])
             for prefix in ('sqlite:///', studies.JOURNAL_PREFIX))


def _preview_study(args, storage_url: str, name: str, config, get_search, extra_overrides) -> int:
  """--dry-run: the study's state and the commands of its next trials; nothing is created or run."""
  study = studies.open_study('' if _not_created(storage_url) else storage_url, name, config, args.sampler,
                             args.pruner, seed=args.seed)
  done = len(studies.latest_trials(study))
  print(f'# study {name!r} in {storage_url}: {done} trial(s) so far, --sampler={args.sampler} '
        f'--pruner={args.pruner}; the next {max(args.trials - done, 0)} would run:')
  for line in studies.preview(study, get_search, config, args.experiment, args.workdir, args.trials,
                              extra_overrides):
    print(line)
  return 0


def _print_summary(lines: list[str]) -> None:
  for line in lines:
    if line:
      print(f'[sweep] {line.strip()}', flush=True)


def _run_study(args, study, storage_url: str, config, get_search, extra_overrides) -> int:
  if shutil.which('squeue') and (queued := slurm.study_tasks_in_queue(args.workdir)):
    raise sweep.SweepError(f'{len(queued)} SLURM task(s) of this study are queued or running '
                           f'({", ".join(queued)}); wait for them, or scancel them, before running it here '
                           '(or add --launcher=slurm)')
  requeued = studies.requeue_interrupted(study)
  if requeued:
    print(f'[sweep] resuming {len(requeued)} interrupted trial(s) from their checkpoints: '
          f'{", ".join(requeued)}', flush=True)
  parallel = args.parallel or 1
  print(f'[sweep] study {study.study_name!r} of {args.experiment} in {storage_url}: {args.trials} trials, '
        f'{parallel} at a time, --sampler={args.sampler} --pruner={args.pruner}', flush=True)
  signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
  environment = tracking.parent_environment(config, extra_overrides, args.workdir)
  try:
    failures = studies.run_trials(study, get_search, config, args.experiment, args.workdir, storage_url,
                                      args.trials, parallel, extra_overrides, args.log_dir, environment)
  except KeyboardInterrupt:
    print('[sweep] interrupted; run the same command again to resume the study', file=sys.stderr)
    studies.write_report(study, args.experiment, args.workdir, config, extra_overrides)
    return 130
  lines = studies.write_report(study, args.experiment, args.workdir, config, extra_overrides)
  _print_summary(lines)
  print(f'[sweep] results: {os.path.join(args.workdir, "results.md")}', flush=True)
  if study.get_trials(states=(studies.optuna().trial.TrialState.COMPLETE,)):
    tracking.end_parent(config, extra_overrides, args.workdir,
                        {'best.trial': study.best_trial.number, 'best.value': study.best_value,
                         **{f'best.{key}': value for key, value in study.best_params.items()}})
  return 1 if failures else 0


def _submit_study(args, study, storage_url: str, config, extra_overrides) -> int:
  """--launcher=slurm: array tasks that each take trials from the one study until it holds N."""
  worker = [sys.executable, '-m', 'flaxtpu.sweep', args.experiment, f'--workdir={args.workdir}',
            f'--trials={args.trials}', f'--storage={storage_url}', f'--sampler={args.sampler}',
            f'--pruner={args.pruner}', f'--seed={args.seed}', *extra_overrides]

  def before_submit() -> bool:
    requeued = studies.requeue_interrupted(study)
    if requeued:
      print(f'[sweep] {len(requeued)} interrupted trial(s) will resume: {", ".join(requeued)}', flush=True)
    return studies.budget_left(study, args.trials)

  try:
    # sbatch passes the submitting environment on: the trials become children of the study's MLflow run.
    os.environ.update(tracking.parent_environment(config, extra_overrides, args.workdir))
    tasks = min(args.parallel or args.trials, args.trials)
    job = slurm.submit_study(args.workdir, worker, tasks, _slurm_options(args), before_submit)
    if job and args.wait:
      slurm.wait_for_tasks(args.workdir)
      _print_summary(studies.write_report(study, args.experiment, args.workdir, config, extra_overrides))
  except sweep.SweepError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  return 0

if __name__ == '__main__':
  sys.exit(main())
