"""Run a sweep's runs as processes: each run's devices, its trainer process and log, the sweep's
progress and ETA, and stopping the runs when the sweep is stopped (runner.py makes the runs).

A run's log.txt cannot be appended to in a bucket: it is written locally while the run runs
(--log-dir, by default under ~/.cache/flaxtpu/sweep-logs) and copied to DIR/<run>/log.txt when it
ends.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flaxtpu.io import files, storage
from flaxtpu.sweep import SweepError
from flaxtpu.sweep.runner import (
  DONE,
  FAILED,
  INTERRUPTED,
  LAUNCH_MARKER,
  LOG_FILE,
  PENDING,
  RESULTS_FILE,
  RUNNING,
  Run,
  read_sweep_record,
  write_sweep_record,
)

POLL_INTERVAL_S = 0.1


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
