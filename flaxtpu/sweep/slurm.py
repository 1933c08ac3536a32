"""Run a sweep as one SLURM job array: submit the unfinished runs, never one that is queued or running.

Plain `sbatch`, not submitit: each run already is a shell command (`python -m
flaxtpu.main ...`), so the array is a short bash script kept in DIR/slurm/ that
a user can read and resubmit by hand; nothing is pickled, and the cluster needs
no Python package beyond flaxtpu's own environment.

A run's state comes from `squeue` (queued or running, by the job ids recorded
in DIR/slurm/jobs.json), else from its directory: DIR/<run>/results.json means
done; without it the run left the queue unfinished (failed, timed out,
cancelled, its node died), and the next submission runs it again: the trainer
resumes from its newest checkpoint. `sacct`, where the cluster keeps
accounting, adds how the job ended to the run's error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence

from flaxtpu.io import files
from flaxtpu.sweep import SweepError, processes, runner
from flaxtpu.sweep.runner import DONE, FAILED, PENDING, RUNNING, Run

QUEUED = 'queued'
SLURM_DIR = 'slurm'
JOBS_FILE = 'jobs.json'
# squeue's states of a job that SLURM will still start; any other state it lists is treated as running.
QUEUED_STATES = ('PENDING', 'REQUEUED', 'REQUEUE_HOLD', 'REQUEUE_FED', 'RESV_DEL_HOLD', 'SUSPENDED')
MAX_POLL_INTERVAL_S = 10.0


@dataclasses.dataclass
class Options:
  """What each array task asks SLURM for; empty or 0 leaves it to the cluster's defaults."""

  partition: str = ''
  time: str = ''
  gpus_per_run: int = 0
  cpus_per_run: int = 0
  mem: str = ''
  parallel: int = 0  # array tasks at once (`--array=...%N`); 0 = as many as SLURM starts
  sbatch_args: Sequence[str] = ()


def check_commands() -> None:
  """SweepError unless the SLURM client commands are on PATH."""
  missing = [command for command in ('sbatch', 'squeue') if not shutil.which(command)]
  if missing:
    raise SweepError(f'--launcher=slurm needs {" and ".join(missing)} on PATH; run the sweep on a SLURM '
                     'login node (or drop --launcher=slurm to run here)')


def sbatch_command(options: Options, count: int, workdir: str, job_name: str, script: str) -> list[str]:
  """The `sbatch` command line that submits `script` as an array of `count` tasks."""
  array = f'0-{count - 1}' + (f'%{options.parallel}' if options.parallel else '')
  # --requeue: a preempted task goes back to the queue (where the cluster preempts by requeueing).
  command = ['sbatch', '--parsable', '--requeue', f'--array={array}', f'--job-name={job_name}',
             f'--output={os.path.join(os.path.abspath(workdir), SLURM_DIR, "%A_%a.out")}',
             f'--chdir={os.getcwd()}']
  if options.partition:
    command.append(f'--partition={options.partition}')
  if options.time:
    command.append(f'--time={options.time}')
  if options.gpus_per_run:
    command.append(f'--gres=gpu:{options.gpus_per_run}')
  if options.cpus_per_run:
    command.append(f'--cpus-per-task={options.cpus_per_run}')
  if options.mem:
    command.append(f'--mem={options.mem}')
  return command + list(options.sbatch_args) + [script]


def array_script(runs: Sequence[Run], workdir: str) -> str:
  """A bash script whose array task i runs `runs[i]`, appending its output to DIR/<run>/log.txt."""
  cases = [f'  {index}) run_dir={shlex.quote(os.path.join(workdir, run.name))}\n'
           f'     command=({" ".join(shlex.quote(word) for word in run.command)}) ;;'
           for index, run in enumerate(runs)]
  log = f'"$run_dir/{runner.LOG_FILE}"'
  return '\n'.join([
      '#!/bin/bash',
      '# Written by python -m flaxtpu.sweep --launcher=slurm: array task i runs the i-th run below.',
      f'export PYTHONPATH={shlex.quote(processes.repo_root())}${{PYTHONPATH:+:$PYTHONPATH}}',
      'export PYTHONUNBUFFERED=1',
      'case "$SLURM_ARRAY_TASK_ID" in',
      *cases,
      '  *) echo "error: no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;',
      'esac',
      'mkdir -p "$run_dir"',
      'task="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
      f'echo "{runner.LAUNCH_MARKER} $(date "+%Y-%m-%d %H:%M:%S") (slurm job $task on $(hostname)'
      f'${{SLURM_RESTART_COUNT:+, requeued $SLURM_RESTART_COUNT time(s)}}): ${{command[*]}}" >> {log}',
      # A job step: SLURM's SIGTERM reaches the trainer, which saves a checkpoint and exits 0, from a
      # preemption, a time limit, a requeue or `scancel --signal=TERM` (which signals steps, not this script).
      'step=(); if [ -n "$SLURM_JOB_ID" ] && command -v srun >/dev/null; then step=(srun --ntasks=1); fi',
      f'"${{step[@]}}" "${{command[@]}}" >> {log} 2>&1',
      'status=$?',
      # Stopped early (no results) while SLURM still runs the task: only a signal did that, not a
      # cancel or a requeue (those leave it COMPLETING). Requeued, it resumes from the checkpoint as
      # the same array task, so the sweep records it once.
      f'if [ "$status" = 0 ] && [ ! -e "$run_dir/{runner.RESULTS_FILE}" ] && [ -n "$SLURM_JOB_ID" ] &&',
      '    [ "$(squeue --noheader --jobs="$task" --format=%T 2>/dev/null)" = RUNNING ]; then',
      f'  echo "[sweep] stopped before the end: requeueing $task to resume from its checkpoint" >> {log}',
      '  scontrol requeue "$task" && exit 0',
      'fi',
      'exit "$status"',
      ''])


# --- what SLURM holds ----------------------------------------------------------------


def _slurm(command: Sequence[str]) -> str:
  """stdout of a SLURM client command; SweepError with its own message when it fails."""
  try:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=120, check=False)
  except (OSError, subprocess.TimeoutExpired) as error:
    raise SweepError(f'{command[0]} failed ({error}); is the SLURM controller reachable?') from None
  if done.returncode != 0:
    message = (done.stderr.strip().splitlines() or [f'exit status {done.returncode}'])[-1]
    raise SweepError(f'{command[0]} failed: {message}')
  return done.stdout


def queue_states() -> dict[str, str]:
  """squeue's state of each of this user's array tasks still in the queue: {'1234_0': 'RUNNING', ...}."""
  states = {}
  for line in _slurm(['squeue', '--noheader', '--array', '--me', '--format=%i|%T']).splitlines():
    job, _, state = line.strip().partition('|')
    if job:
      states[job] = state
  return states


def accounting_states(job_ids: Sequence[str]) -> dict[str, str]:
  """sacct's final state of finished array tasks ({'1234_0': 'TIMEOUT'}); {} where accounting is off."""
  if not job_ids or not shutil.which('sacct'):
    return {}
  try:
    arrays = sorted({job.split('_')[0] for job in job_ids})
    listing = _slurm(['sacct', '--noheader', '--parsable2', '--allocations',
                      '--format=JobID,State,ExitCode', f'--jobs={",".join(arrays)}'])
  except SweepError:
    return {}
  states = {}
  for line in listing.splitlines():
    job, state, exit_code = (line.split('|') + ['', ''])[:3]
    if job in job_ids:
      states[job] = f'{state} (exit {exit_code})' if exit_code and exit_code != '0:0' else state
  return states


# --- the record: DIR/slurm/jobs.json and DIR/sweep.json ---------------------------------


def _jobs_path(workdir: str) -> str:
  return os.path.join(workdir, SLURM_DIR, JOBS_FILE)


def read_jobs(workdir: str) -> dict[str, str]:
  """The array task that last ran (or will run) each run: {run name: '1234_0'}."""
  return (files.read_json(_jobs_path(workdir)) or {}).get('runs', {})


def is_slurm_sweep(workdir: str) -> bool:
  return os.path.exists(_jobs_path(workdir))


def refresh(workdir: str, runs: Sequence[Run]) -> dict[str, str]:
  """Sets every run's status from its results, the queue and accounting; returns {run name: job id}."""
  jobs = read_jobs(workdir)
  in_queue = queue_states() if jobs else {}
  results = {run.name: files.read_json(os.path.join(workdir, run.name, runner.RESULTS_FILE)) for run in runs}
  unfinished = [jobs[run.name] for run in runs
                if run.name in jobs and jobs[run.name] not in in_queue and results[run.name] is None]
  final_states = accounting_states(unfinished)
  for run in runs:
    job = jobs.get(run.name)
    if job in in_queue:  # with results too: the trainer still writes its pictures after results.json
      run.status = QUEUED if in_queue[job] in QUEUED_STATES else RUNNING
      run.error = ''
    elif results[run.name] is not None:
      run.status, run.error, run.returncode = DONE, '', 0
      run.wall_time_s = results[run.name].get('wall_time_s')
    elif job:
      run.status = FAILED
      log_error = processes.error_line(os.path.join(workdir, run.name, runner.LOG_FILE))
      slurm_state = final_states.get(job, '')
      run.error = '; '.join(part for part in (f'slurm job {job} {slurm_state}'.strip(), log_error) if part)
    else:
      run.status = PENDING
  return jobs


def write_record(workdir: str, experiment_path: str, runs: Sequence[Run], extra_overrides: Sequence[str],
                 jobs: Mapping[str, str]) -> None:
  """DIR/sweep.json as the local runner writes it, plus each run's SLURM job."""
  files.write_json(os.path.join(workdir, 'sweep.json'), {
      'experiment': experiment_path,
      'extra_overrides': list(extra_overrides),
      'launcher': 'slurm',
      'runs': [{**dataclasses.asdict(run), 'slurm_job': jobs.get(run.name, '')} for run in runs],
  })


def counts_line(runs: Sequence[Run]) -> str:
  counts = {status: sum(run.status == status for run in runs)
            for status in (DONE, RUNNING, QUEUED, FAILED, PENDING)}
  return (f'[sweep] {counts[DONE]}/{len(runs)} done, {counts[RUNNING]} running, {counts[QUEUED]} queued, '
          f'{counts[FAILED]} failed, {counts[PENDING]} not submitted')


@contextlib.contextmanager
def _locked(workdir: str) -> Iterator[None]:
  """One sweep command at a time reads the queue and submits: two at once would submit a run twice."""
  os.makedirs(os.path.join(workdir, SLURM_DIR), exist_ok=True)
  with open(os.path.join(workdir, SLURM_DIR, '.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield


# --- submitting and waiting ------------------------------------------------------------


def _unsubmitted(runs: Sequence[Run], jobs: Mapping[str, str]) -> list[Run]:
  """The runs to submit (neither finished nor queued/running), after saying which are skipped and why."""
  finished = [run for run in runs if run.status == DONE]
  in_queue = [run for run in runs if run.status in (QUEUED, RUNNING)]
  if finished:
    print(f'[sweep] {len(finished)} run(s) already finished, skipping them', flush=True)
  if in_queue:
    print(f'[sweep] {len(in_queue)} run(s) already queued or running '
          f'({", ".join(jobs[run.name] for run in in_queue)}), not submitting them again', flush=True)
  return [run for run in runs if run.status not in (DONE, QUEUED, RUNNING)]


def dry_run(workdir: str, runs: Sequence[Run], options: Options) -> None:
  """Prints the array script and the sbatch command that a submission would use; submits nothing."""
  todo = _unsubmitted(runs, refresh(workdir, runs))
  if todo:
    arrays = len((files.read_json(_jobs_path(workdir)) or {}).get('arrays', []))
    script_path = os.path.join(workdir, SLURM_DIR, f'array-{arrays + 1}.sh')
    print(f'# {script_path}\n{array_script(todo, workdir)}')
    print(shlex.join(sbatch_command(options, len(todo), workdir, _job_name(workdir), script_path)))


def _job_name(workdir: str) -> str:
  return f'sweep-{os.path.basename(os.path.abspath(workdir))}'


def submit(experiment_path: str, workdir: str, runs: Sequence[Run], options: Options,
           extra_overrides: Sequence[str]) -> str:
  """Submits every run that is neither finished nor queued/running as one job array.

  Returns the array's job id, '' when there was nothing to submit.
  """
  check_commands()
  with _locked(workdir):
    jobs = refresh(workdir, runs)
    todo = _unsubmitted(runs, jobs)
    if not todo:
      write_record(workdir, experiment_path, runs, extra_overrides, jobs)
      print('[sweep] nothing to submit', flush=True)
      return ''
    record = files.read_json(_jobs_path(workdir)) or {}
    array_job, script_path = _submit_array(workdir, record, 'array', array_script(todo, workdir), options,
                                           len(todo), runs=[run.name for run in todo])
    for index, run in enumerate(todo):
      jobs[run.name] = f'{array_job}_{index}'
      run.status, run.error, run.returncode = QUEUED, '', None
    record['runs'] = dict(jobs)
    files.write_json(_jobs_path(workdir), record)
    write_record(workdir, experiment_path, runs, extra_overrides, jobs)
  print(f'[sweep] submitted {len(todo)} run(s) as SLURM job array {array_job} ({script_path}); follow it '
        f'with squeue -j {array_job}, or --report for the results so far', flush=True)
  return array_job


def _submit_array(workdir: str, record: dict, kind: str, script: str, options: Options, count: int,
                  **about) -> tuple[str, str]:
  """Writes `script` as DIR/slurm/<kind>-<n>.sh, submits it as an array of `count` tasks and appends it
  (with `about`) to `record['arrays']`; returns (the array's job id, the script's path)."""
  arrays = record.setdefault('arrays', [])
  script_path = os.path.join(workdir, SLURM_DIR, f'{kind}-{len(arrays) + 1}.sh')
  with open(script_path, 'w') as f:
    f.write(script)
  command = sbatch_command(options, count, workdir, _job_name(workdir), script_path)
  array_job = _slurm(command).strip().split(';')[0]  # --parsable prints JOBID or JOBID;CLUSTER
  arrays.append({'job': array_job, 'script': script_path, 'command': command, **about,
                 'submitted': time.strftime('%Y-%m-%d %H:%M:%S')})
  return array_job, script_path


def wait(experiment_path: str, workdir: str, runs: Sequence[Run], extra_overrides: Sequence[str],
         poll_interval_s: float = 1.0) -> None:
  """Polls the queue until no run of the sweep is queued or running, printing the counts as they change."""
  last_line = ''
  while True:
    jobs = refresh(workdir, runs)
    write_record(workdir, experiment_path, runs, extra_overrides, jobs)
    line = counts_line(runs)
    if line != last_line:
      print(line, flush=True)
      last_line = line
    if not any(run.status in (QUEUED, RUNNING) for run in runs):
      return
    time.sleep(poll_interval_s)
    # Short runs are seen finishing soon; a long sweep asks the controller every 10 s.
    poll_interval_s = min(poll_interval_s * 1.5, MAX_POLL_INTERVAL_S)


# --- studies: array tasks that take trials from one study ------------------------------------


def study_script(worker_command: Sequence[str]) -> str:
  """A bash script whose every array task runs the study's worker (trials until the study holds N)."""
  return '\n'.join([
      '#!/bin/bash',
      '# Written by python -m flaxtpu.sweep --trials=N --launcher=slurm: each array task takes trials from',
      '# the study until it holds N; each trial logs to DIR/<trial>/log.txt.',
      f'export PYTHONPATH={shlex.quote(processes.repo_root())}${{PYTHONPATH:+:$PYTHONPATH}}',
      'export PYTHONUNBUFFERED=1',
      f'exec {shlex.join(worker_command)} --worker="$SLURM_ARRAY_TASK_ID"',
      ''])


def study_tasks_in_queue(workdir: str) -> list[str]:
  """The study's array tasks that SLURM still holds (none where no study was submitted from DIR)."""
  record = files.read_json(_jobs_path(workdir)) or {}
  arrays = {array['job'] for array in record.get('arrays', []) if array.get('study')}
  if not arrays:
    return []
  return sorted(job for job in queue_states() if job.split('_')[0] in arrays)


def submit_study(workdir: str, worker_command: Sequence[str], tasks: int, options: Options,
                 before_submit) -> str:
  """Submits `tasks` array tasks running `worker_command`, unless the study's earlier tasks are still
  queued or running; `before_submit()` (re-queueing interrupted trials) runs first, under the lock.
  Returns the array's job id, '' when nothing was submitted."""
  check_commands()
  with _locked(workdir):
    queued = study_tasks_in_queue(workdir)
    if queued:
      print(f'[sweep] {len(queued)} task(s) of this study are queued or running ({", ".join(queued)}); '
            'they take the remaining trials, not submitting more', flush=True)
      return ''
    if not before_submit():
      print('[sweep] the study holds all its trials: nothing to submit', flush=True)
      return ''
    record = files.read_json(_jobs_path(workdir)) or {}
    array_job, script_path = _submit_array(workdir, record, 'study', study_script(worker_command),
                                           dataclasses.replace(options, parallel=0), tasks, study=True)
    files.write_json(_jobs_path(workdir), record)
  print(f'[sweep] submitted {tasks} study worker(s) as SLURM job array {array_job} ({script_path}); follow '
        f'it with squeue -j {array_job}, or --report for the trials so far', flush=True)
  return array_job


def wait_for_tasks(workdir: str, poll_interval_s: float = 1.0) -> None:
  """Polls the queue until none of the study's tasks is queued or running."""
  while study_tasks_in_queue(workdir):
    time.sleep(poll_interval_s)
    poll_interval_s = min(poll_interval_s * 1.5, MAX_POLL_INTERVAL_S)
