"""Optuna studies (python -m flaxtpu.sweep --trials=N) and MLflow tracking (config.mlflow.*).

The database path runs against a real PostgreSQL server that a fixture starts on loopback (Debian's
`postgresql`, which `.ci/run` installs), and the tracker against a real `mlflow server`; either
test skips, saying why, where its server cannot start here.
"""

import csv
import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from configs import digits
from flaxtpu.data import loaders
from flaxtpu.io import tracking
from flaxtpu.loop import pruning, train
from flaxtpu.loop.progress import Progress
from flaxtpu.sweep import __main__ as cli
from flaxtpu.sweep import runner
from flaxtpu.sweep import study as studies

optuna = pytest.importorskip('optuna')
REPO_ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = 'experiments/digits_search.py'
SERVER_START_S = 180  # an mlflow server takes 15-50 s to answer on 2 busy cores
STUDY_TIMEOUT_S = 1800  # 3 tiny trials: about 2 minutes on 2 idle cores, 10 on 2 cores shared by 7 agents


@pytest.fixture
def in_repo_root(monkeypatch):
  monkeypatch.chdir(REPO_ROOT)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def search(trial):
  return {'optimizer.learning_rate': trial.suggest_float('optimizer.learning_rate', 1e-4, 1.0, log=True),
          'schedule.name': trial.suggest_categorical('schedule.name', ['cosine', 'constant'])}


# --- the study: no training ------------------------------------------------------------


def test_dry_run_lists_the_trials_drawn_and_creates_nothing(tmp_path, in_repo_root, capsys):
  workdir = tmp_path / 'study'
  assert cli.main([EXPERIMENT, f'--workdir={workdir}', '--trials=3', '--sampler=random', '--dry-run']) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == (f"# study 'study' in sqlite:///{workdir}/study.db: 0 trial(s) so far, --sampler=random "
                    '--pruner=none; the next 3 would run:')
  assert [line.split()[4] for line in out[1:]] == [f'--workdir={workdir}/trial-00{i}' for i in range(3)]
  # The same draws as the seeded sampler makes when the study runs; momentum only for SGD.
  _, get_search = studies.load_search(EXPERIMENT)
  sampler = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
  for line in out[1:]:
    drawn = get_search(sampler.ask())
    assert line.split()[5:] == [f'--config.{key}={runner.format_value(value)}'
                                for key, value in drawn.items()]
    assert ('optimizer.momentum' in drawn) == (drawn['optimizer.name'] == 'sgd')
  assert not workdir.exists()
  assert cli.main(['experiments/cifar10_search.py', f'--workdir={workdir}', '--trials=2', '--dry-run']) == 0
  assert capsys.readouterr().out.count('--config.optimizer.weight_decay=') == 2


def test_a_study_s_mistakes_are_one_error_line(tmp_path, in_repo_root, capsys):
  bad = tmp_path / 'bad.py'
  bad.write_text('from configs import digits\nget_config = digits.get_config\n'
                 'def get_search(trial):\n'
                 '  return {"optimizer.learning_rat": trial.suggest_float("lr", 0.1, 1)}\n')
  assert cli.main([str(bad), f'--workdir={tmp_path / "s"}', '--trials=2', '--dry-run']) == 2
  assert capsys.readouterr().err == (f"error: {bad}: get_search: trial 0 (optimizer.learning_rat="
                                     "0.5939321535345923): sweep key 'optimizer.learning_rat' is not a "
                                     "config key (did you mean 'optimizer.learning_rate'?)\n")
  assert cli.main(['experiments/cifar10_lr.py', f'--workdir={tmp_path / "s"}', '--trials=2']) == 2
  assert capsys.readouterr().err == 'error: experiments/cifar10_lr.py: must define get_search()\n'
  assert cli.main([EXPERIMENT, f'--workdir={tmp_path / "s"}', '--pruner=median']) == 2
  assert '--trials=N' in capsys.readouterr().err
  assert cli.main([EXPERIMENT, f'--workdir={tmp_path / "new"}', '--trials=2', '--report']) == 2
  assert capsys.readouterr().err == (f'error: --report: {tmp_path / "new"} holds no study yet '
                                     f'(sqlite:///{tmp_path / "new"}/study.db does not exist); run it first: '
                                     'the same command without --report\n')
  assert not (tmp_path / 'new').exists()  # nothing created
  workdir = tmp_path / 'kept'
  studies.open_study(studies.default_storage(str(workdir), 'local'), 'kept', digits.get_config(), 'tpe',
                     'halving')
  assert cli.main([EXPERIMENT, f'--workdir={workdir}', '--trials=2', '--pruner=median', '--dry-run']) == 2
  assert '--pruner=halving to continue it' in capsys.readouterr().err


@pytest.mark.parametrize('body, message', [
    ("  rate = trial.suggest_float('optimizer.learning_rate', 0.1, 1.0)\n"
     "  return {'optimizer.learning_rate': rate / 0}\n",
     'FILE, line 6: ZeroDivisionError: float division by zero (while get_search drew trial 0 '
     '(optimizer.learning_rate=0.5939321535345923)); fix the experiment file'),
    ("  return [trial.suggest_categorical('seed', [1, 2])]\n",
     'FILE: get_search(trial) must return a non-empty {config key: value} dict; for trial 0 (seed=2) it '
     'returned a list ([2])'),
    ("  return {'schedule.name': trial.suggest_categorical('schedule.name', ['cosine', 'cosin'])}\n",
     "FILE: get_search: trial 0 (schedule.name=cosin): config.schedule.name='cosin' is not valid; choose one "
     "of: 'constant', 'cosine', 'linear', 'onecycle', 'step', 'exponential', 'rsqrt', 'plateau'"),
])
def test_a_mistake_in_get_search_is_one_line_naming_the_trial(tmp_path, body, message):
  """Issue 52 part 3: get_search raising, returning the wrong type or drawing a config that validation
  refuses is one line naming the file and the trial with its draws; no traceback, no study created."""
  bad = tmp_path / 'bad.py'
  bad.write_text('from flaxtpu.settings import defaults\nget_config = defaults.get_config\n\ndef '
                 'get_search(trial):\n'
                 + body)
  for dry_run in ((), ('--dry-run',)):
    result = subprocess.run([sys.executable, '-m', 'flaxtpu.sweep', str(bad), f'--workdir={tmp_path / "s"}',
                             '--trials=2', *dry_run], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    expected = f'error: {message.replace("FILE", str(bad))}\n'
    assert (result.returncode, result.stderr, result.stdout) == (2, expected, ''), result.stderr
    assert not (tmp_path / 's').exists()


def test_a_later_trial_that_cannot_work_stops_the_study_naming_it(tmp_path):
  """A draw that only a later trial makes is refused when that trial is claimed: one line naming it,
  the trial failed in the study, no run directory made for it."""
  def later(trial):
    return {'optimizer.nesterov': trial.number == 1}  # Adam reads no nesterov: trial 1 cannot work

  url = studies.default_storage(str(tmp_path), 'local')
  study = studies.open_study(url, 'later', digits.get_config(), 'random', 'none')
  first, run = studies.claim(study, later, digits.get_config(), EXPERIMENT, str(tmp_path), url, [])
  assert run.overrides == {'optimizer.nesterov': False}
  with pytest.raises(runner.SweepError) as raised:
    studies.claim(study, later, digits.get_config(), EXPERIMENT, str(tmp_path), url, [])
  assert str(raised.value) == (f'{EXPERIMENT}: get_search: trial 1 (optimizer.nesterov=true): '
                               'config.optimizer.nesterov=True has no effect on optimizer.name=\'adam\'; '
                               'leave it at False or pick one that reads it: sgd, lars, rmsprop, muon')
  assert [trial.state.name for trial in study.get_trials()] == ['RUNNING', 'FAIL']
  assert not (tmp_path / 'trial-001').exists()
  del first


def _claim(study, url, workdir):
  return studies.claim(study, search, digits.get_config(), EXPERIMENT, str(workdir), url, [])


def test_an_interrupted_trial_resumes_in_its_directory_with_its_draws_and_reports(tmp_path):
  url = studies.default_storage(str(tmp_path), 'local')
  study = studies.open_study(url, 'study', digits.get_config(), 'random', 'median')
  first, run = _claim(study, url, tmp_path)
  study.tell(first, 0.5)
  second, interrupted = _claim(study, url, tmp_path)
  second.report(0.25, 5)  # then the sweep was killed: the trial stays RUNNING
  assert interrupted.command[-3:] == [f'--config.search.storage={url}', '--config.search.study=study',
                                      '--config.search.trial=1']
  assert not studies.budget_left(study, trials=2)

  assert studies.requeue_interrupted(study) == ['trial-001']
  assert studies.budget_left(study, trials=2)  # the waiting trial, not a new one
  resumed, again = _claim(study, url, tmp_path)
  assert (again.name, again.overrides, again.command[:-1]) == (interrupted.name, interrupted.overrides,
                                                               interrupted.command[:-1])
  assert again.command[-1] == '--config.search.trial=2'
  assert study.trials[2].intermediate_values == {5: 0.25}
  assert not studies.budget_left(study, trials=2)
  assert [(studies.run_name(t), studies.state_name(t)) for t in studies.latest_trials(study)] == [
      ('trial-000', 'complete'), ('trial-001', 'running')]
  assert run.name == 'trial-000'


@pytest.mark.parametrize('sampler', ['tpe', 'random', 'qmc'])
def test_a_continued_study_draws_new_configurations(tmp_path, sampler):
  url = studies.default_storage(str(tmp_path), 'local')
  drawn = []
  for _ in range(3):  # three commands, one trial each, as a killed and continued study runs
    study = studies.open_study(url, 'study', digits.get_config(), sampler, 'none')
    trial, run = _claim(study, url, tmp_path)
    study.tell(trial, 0.5)
    drawn.append(run.overrides['optimizer.learning_rate'])
  assert len(set(drawn)) == 3, drawn


def test_a_study_that_cannot_be_reached_never_stops_training(caplog, tmp_path):
  blocker = tmp_path / 'a_file'  # a database under a regular file: no storage can be opened or created there
  blocker.write_text('')
  config = digits.get_config()
  config.search.storage, config.search.study, config.search.trial = f'sqlite:///{blocker}/dir/x.db', 's', 0
  reporter = pruning.Pruning.of(config)
  progress = Progress()
  with caplog.at_level(logging.WARNING):
    reporter.update(progress, 5, {'eval_accuracy': 0.5})
    reporter.update(progress, 10, {'eval_accuracy': 0.6})
  warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
  assert len(warnings) == 1 and warnings[0].startswith("search: cannot report to study 's' in sqlite:////")
  assert warnings[0].endswith('training goes on unpruned')
  assert progress.stopped_early is None


# --- PostgreSQL on loopback ------------------------------------------------------------------


@pytest.fixture(scope='module')
def postgresql():
  """A PostgreSQL server on loopback in a temporary directory (as `nobody` where this is root: the server
  refuses to run as root); skipped, saying why, where it cannot start."""
  binaries = sorted(glob.glob('/usr/lib/postgresql/*/bin/initdb'))
  if not binaries:
    pytest.skip('PostgreSQL is not installed (apt install postgresql; .ci/run does)')
  pytest.importorskip('psycopg', reason='psycopg is not installed (the test extra has it)')
  bin_dir = os.path.dirname(binaries[-1])
  directory = tempfile.mkdtemp(prefix='flaxtpu-pg-')
  as_user = []
  if os.getuid() == 0:
    shutil.chown(directory, 'nobody')
    as_user = ['runuser', '-u', 'nobody', '--']
  port = _free_port()
  data = os.path.join(directory, 'data')
  try:
    subprocess.run(as_user + [f'{bin_dir}/initdb', '-D', data, '-A', 'trust', '-U', 'postgres'],
                   check=True, capture_output=True, timeout=120)
    subprocess.run(as_user + [f'{bin_dir}/pg_ctl', '-D', data, '-l', os.path.join(directory, 'log'), '-w',
                              '-o', f'-p {port} -k {directory} -h 127.0.0.1', 'start'],
                   check=True, capture_output=True, timeout=120)
  except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
    shutil.rmtree(directory, ignore_errors=True)
    pytest.skip(f'PostgreSQL did not start: {getattr(error, "stderr", b"").decode(errors="replace")[-300:]}')
  yield f'postgresql://postgres@127.0.0.1:{port}/postgres'
  subprocess.run(as_user + [f'{bin_dir}/pg_ctl', '-D', data, '-m', 'immediate', 'stop'], capture_output=True,
                 timeout=120)
  shutil.rmtree(directory, ignore_errors=True)


def test_two_workers_share_a_postgresql_study_and_its_pruner_stops_the_worse_trial(postgresql, tmp_path):
  config = digits.get_config()
  workers = [studies.open_study(postgresql, 'shared', config, 'random', 'median', seed=seed)
             for seed in (0, 1)]
  for index in range(5):  # MedianPruner prunes from its 6th trial on
    trial, run = _claim(workers[index % 2], postgresql, tmp_path)
    trial.report(0.9, 5)
    workers[index % 2].tell(trial, 0.9)
  assert [run.name for run in studies.report_runs(workers[1], EXPERIMENT, str(tmp_path), [])] == [
      f'trial-00{i}' for i in range(5)]
  config.search.storage, config.search.study = postgresql, 'shared'
  for value, pruned in ((0.1, True), (0.95, False)):
    trial, run = _claim(workers[0], postgresql, tmp_path)
    config.search.trial = trial.number
    progress = Progress()
    pruning.Pruning.of(config).update(progress, 5, {'eval_accuracy': value})  # as the trainer reports
    assert workers[1].trials[trial.number].intermediate_values == {5: value}
    assert bool(progress.stopped_early) == pruned
  assert progress.stopped_early is None
  reopened = studies.open_study(postgresql, 'shared', config, 'random', 'median')
  assert reopened.trials[5].state.name == 'RUNNING'


# --- a study that trains, with MLflow ---------------------------------------------------------


def test_a_study_prunes_reports_and_a_rerun_keeps_its_trials(tmp_path):
  workdir = tmp_path / 'study'
  mlflow_uri = f'sqlite:///{tmp_path}/mlflow.db'
  # Run outside the repository: an MLflow SQLite store keeps artifacts in ./mlruns.
  command = [sys.executable, '-m', 'flaxtpu.sweep', str(REPO_ROOT / EXPERIMENT), f'--workdir={workdir}',
             '--trials=3',
             '--sampler=random', '--pruner=halving', '--config.num_train_steps=10',
             '--config.eval_every_steps=5', '--config.cpu_devices=1',
             f'--config.mlflow.tracking_uri={mlflow_uri}']
  environment = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  first = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True,
                         timeout=STUDY_TIMEOUT_S)
  assert first.returncode == 0, first.stdout + first.stderr
  with open(workdir / 'results.csv') as f:
    rows = {row['run']: row for row in csv.DictReader(f)}
  assert {name: (row['status'], row['step']) for name, row in rows.items()} == {
      'trial-000': ('complete', '10'), 'trial-001': ('complete', '10'), 'trial-002': ('pruned', '5')}
  pruned = json.loads((workdir / 'trial-002' / 'results.json').read_text())
  assert pruned['pruned'] is True and pruned['stopped_early']['step'] == 5
  assert (workdir / 'trial-002' / 'checkpoints' / '5').is_dir()
  study = optuna.load_study(study_name='study', storage=f'sqlite:///{workdir}/study.db')
  assert [trial.state.name for trial in study.trials] == ['COMPLETE', 'COMPLETE', 'PRUNED']
  assert study.trials[0].intermediate_values.keys() == {5, 10}
  assert study.best_value == float(rows[f'trial-00{study.best_trial.number}']['eval_accuracy'])
  report = (workdir / 'results.md').read_text()
  assert '3 trials: 2 complete, 1 pruned, 0 failed, 0 unfinished.' in report
  assert 'Steps trained: 25 (83% of 3 full runs of 10 steps).' in report
  best = f'trial-00{study.best_trial.number}'
  assert f'Best trial: `{best}`' in report and f'--workdir={workdir}/{best} ' in report
  assert '--config.search' not in report
  for plot in ('optimization_history', 'param_importances', 'eval_accuracy_vs_optimizer.learning_rate'):
    assert (workdir / 'plots' / f'{plot}.png').exists()

  from mlflow import MlflowClient
  client = MlflowClient(mlflow_uri)
  parent = json.loads((workdir / tracking.RUN_FILE).read_text())['run_id']
  children = client.search_runs([client.get_experiment_by_name('flaxtpu').experiment_id],
                                f"tags.mlflow.parentRunId = '{parent}'")
  assert sorted(run.info.run_name for run in children) == ['trial-000', 'trial-001', 'trial-002']
  assert client.get_run(parent).data.tags['best.trial'] == str(study.best_trial.number)
  child = next(run for run in children if run.info.run_name == 'trial-002')
  assert [(m.step, m.value) for m in client.get_metric_history(child.info.run_id, 'eval_accuracy')] == [
      (5, float(rows['trial-002']['eval_accuracy']))]
  assert child.data.params['optimizer.name'] == 'sgd' and child.data.tags['pruned'] == 'true'

  # Run again: the finished trials are kept, none trains again.
  again = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True,
                         timeout=STUDY_TIMEOUT_S)
  assert again.returncode == 0, again.stdout + again.stderr
  assert '[sweep] start' not in again.stdout
  assert [trial.state.name for trial in study.trials] == ['COMPLETE', 'COMPLETE', 'PRUNED']
  for name in ('trial-000', 'trial-001', 'trial-002'):
    assert (workdir / name / 'log.txt').read_text().count(runner.LAUNCH_MARKER) == 1


# --- MLflow: a real server on loopback, killed mid-run -------------------------------------


@pytest.fixture(scope='module')
def mlflow_server(tmp_path_factory):
  """`mlflow server` on loopback with a SQLite backend: (its URL, the backend URI, its process)."""
  executable = os.path.join(os.path.dirname(sys.executable), 'mlflow')
  if not os.path.exists(executable):
    pytest.skip('mlflow is not installed (the test extra has it)')
  directory = tmp_path_factory.mktemp('mlflow')
  backend, port = f'sqlite:///{directory}/backend.db', _free_port()
  log = open(directory / 'server.log', 'w')
  server = subprocess.Popen([executable, 'server', '--backend-store-uri', backend,
                             '--default-artifact-root', str(directory / 'art'), '--host', '127.0.0.1',
                             '--port', str(port), '--workers', '1'],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  url = f'http://127.0.0.1:{port}'
  deadline = time.monotonic() + SERVER_START_S
  while True:
    try:
      urllib.request.urlopen(f'{url}/health', timeout=2)
      break
    except OSError:
      if server.poll() is not None or time.monotonic() > deadline:
        if server.poll() is None:
          os.killpg(server.pid, signal.SIGKILL)
        pytest.skip(f'mlflow server did not answer: {(directory / "server.log").read_text()[-300:]}')
      time.sleep(0.5)
  yield url, backend, server
  if server.poll() is None:
    os.killpg(server.pid, signal.SIGKILL)
  server.wait()
  log.close()


def _config(**overrides):
  config = digits.get_config()
  config.num_train_steps, config.log_every_steps, config.eval_every_steps = 12, 1, 4
  config.checkpoint_every_steps = 2
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


def _at_step(monkeypatch, step_to_act, act):
  """Calls `act()` when the data pipeline reaches a step (it runs a few steps ahead of the loop)."""
  real = loaders.train_batches

  def batches(*args, **kwargs):
    for step, batch in enumerate(real(*args, **kwargs), kwargs['first_step'] + 1):
      if step == step_to_act:
        act()
      yield batch

  monkeypatch.setattr(loaders, 'train_batches', batches)


def test_a_resumed_run_continues_its_mlflow_run_and_a_dead_server_never_stops_training(
    mlflow_server, tmp_path, monkeypatch, caplog):
  url, backend, server = mlflow_server
  from mlflow import MlflowClient
  workdir = str(tmp_path / 'run')
  config = _config(**{'mlflow.tracking_uri': url, 'mlflow.experiment': 'killed'})
  _at_step(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGTERM))
  stopped = train.train_and_evaluate(config, workdir)
  assert 'stopped_at_step' in stopped
  run_id = json.loads(Path(workdir, tracking.RUN_FILE).read_text())['run_id']
  assert MlflowClient(url).get_run(run_id).info.status == 'KILLED'

  monkeypatch.undo()
  _at_step(monkeypatch, 8, lambda: os.killpg(server.pid, signal.SIGKILL))  # the server dies mid-run
  with caplog.at_level(logging.WARNING):
    results = train.train_and_evaluate(config, workdir)
  assert results['step'] == 12
  warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith('mlflow:')]
  assert len(warnings) == 1 and warnings[0].endswith('training goes on, logged locally only'), warnings
  assert json.loads(Path(workdir, tracking.RUN_FILE).read_text())['run_id'] == run_id
  # One MLflow run holds both attempts' metrics, up to where its server died.
  history = MlflowClient(backend).get_metric_history(run_id, 'train_loss')
  steps = sorted({m.step for m in history})
  assert steps[0] == 1 and 3 < steps[-1] < 12 and len(steps) == steps[-1], steps
  logged = {json.loads(line)['step'] for line in open(os.path.join(workdir, 'metrics.jsonl'))}
  assert logged == set(range(1, 13))
  assert MlflowClient(backend).get_run(run_id).data.params['num_train_steps'] == '12'
