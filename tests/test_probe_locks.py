"""An outside probe of the lock files that keep a workdir, a sweep and a study to one process each
(issue 70): a folder in the lock file's place. Each command stops in one `error:` line naming the file
and what to do (it was IsADirectoryError and its traceback), and leaves the folder as it was."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from flaxtpu.sweep import __main__ as cli


def _one_error_line(err: str) -> str:
  lines = [line for line in err.splitlines() if line.startswith('error')]
  assert 'Traceback' not in err and len(lines) == 1, err[-2000:]
  return lines[0]


def test_a_folder_in_place_of_the_workdir_lock_is_one_line(tmp_path):
  (tmp_path / 'run' / 'train.lock' / 'kept').mkdir(parents=True)
  process = subprocess.run([sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py',
                            f'--workdir={tmp_path / "run"}', '--config.num_train_steps=2',
                            '--config.cpu_devices=1', '--config.compilation_cache_dir=none'],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert process.returncode == 2
  assert _one_error_line(process.stderr) == (
      f"error: {tmp_path}/run/train.lock cannot be opened as the trainer's lock file (Is a directory); move "
      'it aside, then run the same command again')
  assert os.listdir(tmp_path / 'run' / 'train.lock') == ['kept']


@pytest.mark.parametrize('experiment, lock, who', [
    ('experiments/digits_families.py', 'sweep.lock', "the sweep's lock file"),
    ('experiments/digits_search.py', '.study.lock', "the study's lock file"),
])
def test_a_folder_in_place_of_a_sweep_or_study_lock_is_one_line(tmp_path, monkeypatch, capsys, experiment,
                                                                 lock, who):
  if lock == '.study.lock':
    pytest.importorskip('optuna')
  monkeypatch.chdir(ROOT)
  assert Path(experiment).exists()
  (tmp_path / 'sweep' / lock / 'kept').mkdir(parents=True)
  trials = ['--trials=1'] if lock == '.study.lock' else []
  assert cli.main([experiment, f'--workdir={tmp_path / "sweep"}', *trials]) == 2
  assert _one_error_line(capsys.readouterr().err) == (
      f'error: {tmp_path}/sweep/{lock} cannot be opened as {who} (Is a directory); move it aside, then '
      'run the same command again')
  assert os.listdir(tmp_path / 'sweep' / lock) == ['kept']
