"""An outside probe of a study's storage (issue 70): a study database that is damaged, locked by another
process, emptied beside its trials' directories, or that fails while the study runs. Each stops in one
`error:` line that names the file and what to do, and leaves the database and the trials as they were.

No training: every case stops before a trial's trainer starts.
"""

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

from flaxtpu.sweep import __main__ as cli
from flaxtpu.sweep import study as studies

optuna = pytest.importorskip('optuna')
REPO_ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = 'experiments/digits_search.py'


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch):
  monkeypatch.chdir(REPO_ROOT)


def _digest(path) -> str:
  return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _study_with_one_trial(workdir: Path) -> Path:
  """DIR/study.db as a study of one finished trial leaves it, and that trial's directory."""
  study = optuna.create_study(storage=f'sqlite:///{workdir}/study.db', study_name=workdir.name,
                              direction='maximize')
  trial = study.ask({'optimizer.learning_rate': optuna.distributions.FloatDistribution(1e-4, 1.0, log=True)})
  trial.set_user_attr(studies.RUN_ATTR, 'trial-000')
  study.tell(trial, 0.5)
  (workdir / 'trial-000').mkdir()
  (workdir / 'trial-000' / 'results.json').write_text('{"eval_accuracy": 0.5, "step": 20}\n')
  return workdir / 'study.db'


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  assert 'Traceback' not in err and len(lines) == 1, err
  assert lines[0].startswith('error: ')
  return lines[0]


@pytest.mark.parametrize('damage', ['not a database', 'cut off'])
def test_a_damaged_study_database_is_named_and_left_as_it_is(tmp_path, capsys, damage):
  workdir = tmp_path / 'study'
  workdir.mkdir()
  database = _study_with_one_trial(workdir)
  content = database.read_bytes()
  database.write_bytes(b'not a database at all\n' if damage == 'not a database' else content[:4096])
  before = _digest(database)
  assert cli.main([EXPERIMENT, f'--workdir={workdir}', '--trials=2']) == 2
  line = _one_error_line(capsys)
  assert line.startswith(f'error: {database} is not a readable SQLite database (DatabaseError: ')
  assert line.endswith('cannot open the study; restore it from a copy, or move it and the trial-* '
                       'directories beside it aside to start the study afresh')
  assert _digest(database) == before


def test_a_study_database_locked_by_another_process_is_named_after_the_wait(tmp_path, capsys, monkeypatch):
  workdir = tmp_path / 'study'
  workdir.mkdir()
  database = _study_with_one_trial(workdir)
  before = _digest(database)
  monkeypatch.setattr(studies, 'SQLITE_LOCK_WAIT_S', 0.5)
  holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
  holder.execute('BEGIN EXCLUSIVE')  # an sqlite3 shell in the middle of a transaction
  try:
    assert cli.main([EXPERIMENT, f'--workdir={workdir}', '--trials=2']) == 2
  finally:
    holder.execute('ROLLBACK')
    holder.close()
  assert _one_error_line(capsys) == (
      f'error: {database} is locked by another process (waited 0.5 s): cannot open the study; close what '
      'holds it (an sqlite3 shell, a study of another host on a shared disk), then run the same command '
      'again')
  assert _digest(database) == before


def test_trial_directories_that_the_study_does_not_know_are_not_taken_over(tmp_path, capsys):
  """study.db deleted (or replaced) beside trial-000: a new trial 0 would resume that run as its own and
  report its old result for new parameters."""
  workdir = tmp_path / 'study'
  workdir.mkdir()
  _study_with_one_trial(workdir)
  os.remove(workdir / 'study.db')
  results = workdir / 'trial-000' / 'results.json'
  before = _digest(results)
  assert cli.main([EXPERIMENT, f'--workdir={workdir}', '--trials=2']) == 2
  assert _one_error_line(capsys) == (
      f"error: {workdir}/trial-000 holds a run that study 'study' in sqlite:///{workdir}/study.db does not "
      'know (1 such trial-* directories; was its database replaced or emptied?): a new trial would take it '
      'over; restore the database, or move the trial-* directories aside')
  assert _digest(results) == before and sorted(os.listdir(workdir / 'trial-000')) == ['results.json']


def test_a_storage_that_fails_while_the_study_runs_is_one_line(tmp_path, capsys, monkeypatch):
  """The database locked (or gone) between two trials: one line, not a traceback; the trials stay."""
  sqlalchemy_exc = pytest.importorskip('sqlalchemy.exc')
  workdir = tmp_path / 'study'

  def locked(*args, **kwargs):
    raise sqlalchemy_exc.OperationalError('UPDATE trials', {}, Exception('database is locked'))

  monkeypatch.setattr(studies, 'claim', locked)
  assert cli.main([EXPERIMENT, f'--workdir={workdir}', '--trials=2']) == 2
  line = _one_error_line(capsys)
  assert line.startswith(f'error: {workdir}/study.db is locked by another process (waited 60 s): failed; ')
  assert line.endswith("then run the same command again (the trials' directories are kept)")
