"""An outside probe of damaged workdirs and start-up folders (issue 70): a finished run whose checkpoints
were deleted (the folder emptied, removed, or a file in its place) given to train, eval, predict and
export; and a default compilation cache that cannot be written. Each either works or stops in one
`error:` line naming the problem and what to do, and leaves the run's files as they were."""

import json
import os
import subprocess
import sys

import pytest

from configs import digits
from conftest import ROOT, tree_digest


def _finished_run_without_checkpoints(workdir, how):
  """What a finished digits run leaves (its config, metrics and results), its checkpoints deleted `how`."""
  os.makedirs(workdir)
  config = digits.get_config()
  config.num_train_steps = 4
  (workdir / 'config.json').write_text(json.dumps(config.to_dict()))
  (workdir / 'metrics.jsonl').write_text('{"step": 4, "train_loss": 0.5, "eval_accuracy": 0.9}\n')
  (workdir / 'results.json').write_text('{"step": 4, "eval_accuracy": 0.9, "train_loss": 0.5}\n')
  if how == 'emptied':
    (workdir / 'checkpoints').mkdir()
  elif how == 'a file':
    (workdir / 'checkpoints').write_text('notes\n')
  return {'emptied': f'no checkpoint in {workdir}/checkpoints', 'removed': f'no {workdir}/checkpoints folder',
          'a file': f'{workdir}/checkpoints is a file, not its checkpoints folder'}[how]


def _main(*args, env=None):
  return subprocess.run([sys.executable, '-m', 'flaxtpu.main', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, env=env)


def _one_error_line(process) -> str:
  assert process.returncode == 2 and 'Traceback' not in process.stderr, process.stderr[-2000:]
  errors = [line for line in process.stderr.splitlines() if line.startswith('error')]
  assert len(errors) == 1, process.stderr[-2000:]
  return errors[0]


@pytest.mark.parametrize('how', ['emptied', 'removed', 'a file'])
def test_training_again_over_a_finished_run_whose_checkpoints_are_gone_is_refused(tmp_path, how):
  """It trained from step 0 and overwrote results.json and metrics.jsonl (a file in place of the folder:
  FileExistsError and its traceback)."""
  workdir = tmp_path / 'run'
  gone = _finished_run_without_checkpoints(workdir, how)
  before = tree_digest(workdir)
  line = _one_error_line(_main('--config=configs/digits.py', f'--workdir={workdir}',
                               '--config.num_train_steps=4'))
  if how == 'a file':
    assert line == (f'error: {workdir}/checkpoints is a file, not the folder a run keeps its checkpoints in; '
                    'move it aside, or use another --workdir')
  else:
    assert line == (f'error: --workdir={workdir} holds a finished run (results.json) but {gone}: training '
                    'here would start again from step 0 over its results and metrics; use another --workdir, '
                    'or move its files aside to train afresh here')
  assert tree_digest(workdir) == before


@pytest.mark.parametrize('how, mode', [('emptied', 'eval'), ('removed', 'export'), ('a file', 'predict')])
def test_reading_a_finished_run_whose_checkpoints_are_gone_names_what_happened(tmp_path, how, mode):
  """It said 'train first with the same --workdir', which would train over the run's results."""
  workdir = tmp_path / 'run'
  gone = _finished_run_without_checkpoints(workdir, how)
  before = tree_digest(workdir)
  line = _one_error_line(_main(f'--workdir={workdir}', f'--mode={mode}',
                               f'--config.predict.input={ROOT}/flaxtpu/datasets'))
  assert line == (f'error: --workdir={workdir} holds a finished run (results.json) but {gone}: its weights '
                  'were deleted; restore them from a copy (or train again in another --workdir)')
  assert tree_digest(workdir) == before


def test_a_default_compilation_cache_that_is_a_file_compiles_without_it_in_one_warning(tmp_path):
  """JAX warned with a two-line UserWarning (and its source line) at the first program it could not keep."""
  home = tmp_path / 'home'
  (home / '.cache' / 'flaxtpu').mkdir(parents=True)
  (home / '.cache' / 'flaxtpu' / 'jax').write_text('not a folder\n')
  process = _main('--config=configs/digits.py', f'--workdir={tmp_path / "run"}', '--mode=plan',
                  '--config.cpu_devices=1', env={**os.environ, 'HOME': str(home)})
  assert process.returncode == 0, process.stderr[-2000:]
  assert 'UserWarning' not in process.stderr
  assert 'Error reading persistent compilation cache' not in process.stderr
  warnings = [line for line in process.stderr.splitlines() if 'compilation cache' in line]
  assert len(warnings) == 1 and warnings[0].endswith(
      f'the compilation cache {home}/.cache/flaxtpu/jax cannot be written ({home}/.cache/flaxtpu/jax is a '
      'file, not a folder); compiling without it: set --config.compilation_cache_dir to a writable folder, '
      'or none')
  assert (home / '.cache' / 'flaxtpu' / 'jax').read_text() == 'not a folder\n'
  assert json.loads((tmp_path / 'run' / 'plan.json').read_text())['total_bytes'] > 0


@pytest.mark.parametrize('name', ['metrics.jsonl', 'config.json'])
def test_a_folder_in_place_of_a_file_the_run_writes_is_one_line(tmp_path, name):
  """It trained, then failed at the file's first write with IsADirectoryError and its traceback."""
  (tmp_path / 'run' / name / 'kept').mkdir(parents=True)
  line = _one_error_line(_main('--config=configs/digits.py', f'--workdir={tmp_path / "run"}',
                               '--config.num_train_steps=4', '--config.cpu_devices=1'))
  assert line == (f'error: {tmp_path}/run/{name} is a folder, not the file a run writes there; move it '
                  'aside, or use another --workdir')
  assert sorted(os.listdir(tmp_path / 'run')) == [name] and os.listdir(tmp_path / 'run' / name) == ['kept']
