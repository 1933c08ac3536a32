"""Start-up: the time from the command to the first step."""

import subprocess
import sys
import time

import pytest

from conftest import ROOT
from flaxtpu import progress


def test_process_start_time_is_when_the_command_started():
  script = ('import time; typed = time.time(); from flaxtpu import progress; '
            'print(typed - progress.process_start_time(fallback=0.0))')
  result = subprocess.run([sys.executable, '-c', script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
  # The interpreter's own start-up lies between the process's start and the script's first line.
  assert -0.05 < float(result.stdout) < 2.0


def test_process_start_time_falls_back_where_proc_is_missing(monkeypatch):
  def no_proc(*args, **kwargs):
    raise FileNotFoundError('/proc/self/stat')

  monkeypatch.setattr(progress, 'open', no_proc, raising=False)
  assert progress.process_start_time(fallback=123.0) == 123.0


def test_time_to_first_step_counts_from_the_command(monkeypatch, caplog):
  clock_time = [1000.0]
  monkeypatch.setattr(progress.time, 'time', lambda: clock_time[0])
  record = progress.Progress()
  clock = progress.TrainClock(first_step=0, progress=record, started=996.0, command_started=990.0)
  clock_time[0] += 2.0
  with caplog.at_level('INFO'):
    clock.step_done(step_metrics=None, wait=False)
  assert record.time_to_first_step_s == pytest.approx(12.0)
  assert 'first step done 12.0 s after the command (6.0 s after training started' in caplog.text
  # A resumed attempt logs its own start-up; the record keeps the first attempt's.
  clock_time[0] = time.time()
  resumed = progress.TrainClock(first_step=5, progress=record, started=clock_time[0] - 3.0,
                                command_started=clock_time[0] - 4.0)
  with caplog.at_level('INFO'):
    resumed.step_done(step_metrics=None, wait=False)
  assert 'first step done 4.0 s after the command (3.0 s after' in caplog.text
  assert record.time_to_first_step_s == pytest.approx(12.0)
