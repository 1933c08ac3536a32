"""SLURM on this machine: a sweep as one job array, and two srun tasks training as one JAX cluster.

The fixture starts a private single-node cluster (munged, slurmctld and slurmd of Debian's slurm-wlm,
in a temporary directory, on free ports) and stops it afterwards. It needs root and the packages
(`.ci/run` installs them); otherwise the tests skip, saying what is missing.
"""

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import ROOT, restore_checkpoint
from flaxtpu.sweep import __main__ as cli
from flaxtpu.sweep import runner
from flaxtpu.sweep import slurm as slurm_launcher

DAEMONS = ('munged', 'slurmctld', 'slurmd')
CLIENTS = ('sbatch', 'srun', 'squeue', 'sinfo', 'scancel', 'sacct')
START_TIMEOUT_S = 60
JOB_TIMEOUT_S = 600
SACCT_FORMAT = 'JobID,JobName,State,ExitCode,Elapsed,NNodes,NCPUS,NodeList'


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _last_error(log: Path) -> str:
  """The last error line of a daemon's log (else its last line), for a skip reason."""
  try:
    lines = [line.strip() for line in log.read_text(errors='replace').splitlines() if line.strip()]
  except OSError:
    return f'no log at {log}'
  errors = [line for line in lines if 'error' in line.lower() or 'fatal' in line.lower()]
  return (errors or lines or ['its log is empty'])[-1]


@dataclasses.dataclass
class Cluster:
  directory: Path
  env: dict
  processes: dict

  def run(self, *command, env=None):
    return subprocess.run(list(command), env=env or self.env, capture_output=True, text=True, timeout=120)

  def queue(self) -> list[str]:
    return self.run('squeue', '--noheader', '--array', '--format=%i %T').stdout.split('\n')[:-1]

  def wait_for_empty_queue(self, timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while self.queue():
      assert time.monotonic() < deadline, f'jobs still queued after {timeout_s} s: {self.queue()}'
      time.sleep(0.5)

  def sacct(self, jobs) -> str:
    """`jobs` (ids or array ids) as sacct reads them from the job-completion file (the cluster has no
    slurmdbd), with the array task each one was (`sacct --completion` shows only the raw job id)."""
    lines = self.run('sacct', '--completion', '--parsable2', f'--format={SACCT_FORMAT}').stdout.splitlines()
    fields = [dict(f.split('=', 1) for f in line.split() if '=' in f)
              for line in (self.directory / 'jobcomp.txt').read_text().splitlines()]
    tasks = {f['JobId']: f'{f["ArrayJobId"]}_{f["ArrayTaskId"]}' for f in fields if f.get('ArrayTaskId')}
    rows = [f'{line}|{tasks.get(line.split("|")[0], "")}' for line in lines[1:]]
    return '\n'.join([lines[0] + '|ArrayTask'] + [
        row for row in rows if row.split('|')[0] in jobs or row.split('|')[-1].split('_')[0] in jobs])

  def log_tails(self) -> str:
    return '\n'.join(f'{name}: {_last_error(self.directory / "log" / f"{name}.log")}' for name in DAEMONS)


def _start(directory: Path) -> Cluster:
  """munged, slurmctld and slurmd in the foreground, writing under `directory`; pytest.skip on failure."""
  for sub in ('munge', 'state', 'spool', 'log'):
    (directory / sub).mkdir()
  # munged refuses a socket directory that others cannot traverse, and a key others can read.
  directory.chmod(0o711)
  (directory / 'munge').chmod(0o711)
  key = directory / 'munge' / 'munge.key'
  key.write_bytes(os.urandom(1024))
  key.chmod(0o400)
  socket_path = directory / 'munge' / 'munge.socket'
  hostname = socket.gethostname().split('.')[0]
  # This host as slurmd sees it (CPUs, cores, memory): a node that claims more is drained.
  node = subprocess.run(['slurmd', '-C'], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
  conf = directory / 'slurm.conf'
  conf.write_text(textwrap.dedent(f'''\
      ClusterName=flaxtpu{os.getpid()}
      SlurmctldHost={hostname}(127.0.0.1)
      SlurmctldPort={_free_port()}
      SlurmdPort={_free_port()}
      SlurmUser=root
      SlurmdUser=root
      AuthType=auth/munge
      CredType=cred/munge
      AuthInfo=socket={socket_path}
      StateSaveLocation={directory}/state
      SlurmdSpoolDir={directory}/spool
      SlurmctldPidFile={directory}/slurmctld.pid
      SlurmdPidFile={directory}/slurmd.pid
      SlurmctldLogFile={directory}/log/slurmctld.log
      SlurmdLogFile={directory}/log/slurmd.log
      ProctrackType=proctrack/linuxproc
      TaskPlugin=task/none
      JobAcctGatherType=jobacct_gather/none
      AccountingStorageType=accounting_storage/none
      JobCompType=jobcomp/filetxt
      JobCompLoc={directory}/jobcomp.txt
      SelectType=select/cons_tres
      SelectTypeParameters=CR_Core
      MpiDefault=none
      ReturnToService=2
      {node} NodeAddr=127.0.0.1 State=UNKNOWN
      PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
      '''))
  # Jobs inherit this environment: no XLA_FLAGS from conftest, so each run sets its own device count.
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS' and not k.startswith('SLURM_')}
  env.update(SLURM_CONF=str(conf), PYTHONPATH=str(ROOT))
  cluster = Cluster(directory, env, {})
  commands = {
      'munged': ['munged', '--foreground', f'--key-file={key}', f'--socket={socket_path}',
                 f'--pid-file={directory}/munge/munged.pid', f'--seed-file={directory}/munge/munged.seed',
                 f'--log-file={directory}/log/munged.log'],
      'slurmctld': ['slurmctld', '-D', '-f', str(conf)],
      'slurmd': ['slurmd', '-D', '-f', str(conf)],
  }
  for name in DAEMONS:
    with open(directory / 'log' / f'{name}.out', 'w') as output:
      cluster.processes[name] = subprocess.Popen(commands[name], env=env, stdout=output,
                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if name == 'munged':
      deadline = time.monotonic() + 10
      while (not socket_path.exists() and cluster.processes[name].poll() is None
             and time.monotonic() < deadline):
        time.sleep(0.05)
  deadline = time.monotonic() + START_TIMEOUT_S
  while True:
    for name, process in cluster.processes.items():
      if process.poll() is not None:
        reason = _last_error(directory / 'log' / f'{name}.log')
        _stop(cluster)
        pytest.skip(f'{name} did not start: {reason}')
    states = cluster.run('sinfo', '--noheader', '--format=%T').stdout.split()
    if states == ['idle']:
      return cluster
    if time.monotonic() > deadline:
      reason = cluster.log_tails()
      _stop(cluster)
      pytest.skip(f'the SLURM node is not idle after {START_TIMEOUT_S} s (sinfo: {states}): {reason}')
    time.sleep(0.2)


def _stop(cluster: Cluster) -> None:
  """Cancels what is left, then stops the daemons this fixture started (by their own pids)."""
  if cluster.processes.get('slurmctld') and cluster.processes['slurmctld'].poll() is None:
    cluster.run('scancel', '--me')
    try:
      cluster.wait_for_empty_queue(timeout_s=60)
    except AssertionError:
      pass
  for name in reversed(DAEMONS):
    process = cluster.processes.get(name)
    if process is None or process.poll() is not None:
      continue
    process.terminate()
    try:
      process.wait(timeout=20)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


@pytest.fixture(scope='module')
def slurm():
  if os.geteuid() != 0:
    pytest.skip('not root: the SLURM tests start slurmctld and slurmd as root (.ci/run does)')
  missing = [name for name in DAEMONS + CLIENTS if not shutil.which(name)]
  if missing:
    pytest.skip(f'{", ".join(missing)} not installed (apt install slurm-wlm munge)')
  # Not pytest's tmp_path: munged needs every directory above its socket to be traversable by all.
  directory = Path(tempfile.mkdtemp(prefix='flaxtpu-slurm-'))
  cluster = _start(directory)
  try:
    yield cluster
  finally:
    _stop(cluster)
    shutil.rmtree(directory, ignore_errors=True)


# --- without a cluster: the command line, the script, and what is submitted when --------------

TWO_RUNS = """
from flaxtpu import sweep
from flaxtpu.settings import defaults

def get_config():
  return defaults.get_config()

def get_sweep():
  return sweep.sweep('seed', [0, 1])
"""


def test_slurm_options_need_the_slurm_launcher_and_its_commands(tmp_path, monkeypatch, capsys):
  experiment = tmp_path / 'experiment.py'
  experiment.write_text(TWO_RUNS)
  workdir = tmp_path / 'sweep'
  assert cli.main([str(experiment), f'--workdir={workdir}', '--partition=gpu']) == 2
  assert capsys.readouterr().err == ('error: --partition is an option of --launcher=slurm; add '
                                     '--launcher=slurm or drop --partition\n')
  monkeypatch.setenv('PATH', str(tmp_path / 'empty'))
  assert cli.main([str(experiment), f'--workdir={workdir}', '--launcher=slurm']) == 2
  assert capsys.readouterr().err == ('error: --launcher=slurm needs sbatch and squeue on PATH; run the '
                                     'sweep on a SLURM login node (or drop --launcher=slurm to run here)\n')
  assert not workdir.exists()


def test_the_array_script_runs_the_task_s_run_into_its_log(tmp_path):
  runs = [runner.Run(name=f'run{i}', overrides={}, command=['echo', f'run {i}', "it's", '$HOME'])
          for i in range(2)]
  script = tmp_path / 'array.sh'
  script.write_text(slurm_launcher.array_script(runs, str(tmp_path / 'sweep')))
  env = dict(os.environ, SLURM_ARRAY_JOB_ID='7', SLURM_ARRAY_TASK_ID='1')
  subprocess.run(['bash', str(script)], env=env, check=True, timeout=30)
  log = (tmp_path / 'sweep' / 'run1' / 'log.txt').read_text().splitlines()
  assert log[0].startswith(f'{runner.LAUNCH_MARKER} ') and '(slurm job 7_1 on ' in log[0]
  assert log[1] == "run 1 it's $HOME"  # every word reaches the trainer as written
  assert not (tmp_path / 'sweep' / 'run0').exists()
  options = slurm_launcher.Options(partition='gpu', time='4:00:00', gpus_per_run=2, cpus_per_run=16,
                                   mem='64G', parallel=3, sbatch_args=['--account=lab'])
  command = slurm_launcher.sbatch_command(options, 5, str(tmp_path / 'sweep'), 'sweep-x', str(script))
  assert command[:4] == ['sbatch', '--parsable', '--requeue', '--array=0-4%3']
  assert command[-7:] == ['--partition=gpu', '--time=4:00:00', '--gres=gpu:2', '--cpus-per-task=16',
                          '--mem=64G', '--account=lab', str(script)]


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
  """sbatch, squeue and sacct stand-ins: sbatch logs its arguments and answers job 41, 42, ...;
  squeue prints the file `queue`; sacct fails as it does without accounting."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  scripts = {
      'sbatch': f'echo "$@" >> {tmp_path}/sbatch.log\necho $((40 + $(wc -l < {tmp_path}/sbatch.log)))',
      'squeue': f'cat {tmp_path}/queue 2>/dev/null; true',
      'sacct': 'echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1',
  }
  for name, body in scripts.items():
    (bin_dir / name).write_text(f'#!/bin/sh\n{body}\n')
    (bin_dir / name).chmod(0o755)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  return tmp_path


def test_each_run_is_submitted_until_it_finishes_and_never_while_slurm_holds_it(fake_slurm, capsys):
  experiment = fake_slurm / 'experiment.py'
  experiment.write_text(TWO_RUNS)
  workdir = fake_slurm / 'sweep'
  command = [str(experiment), f'--workdir={workdir}', '--launcher=slurm', '--cpus-per-run=2']

  assert cli.main(command) == 0
  assert 'submitted 2 run(s) as SLURM job array 41' in capsys.readouterr().out
  assert slurm_launcher.read_jobs(str(workdir)) == {'seed=0': '41_0', 'seed=1': '41_1'}
  # Queued and running runs are not submitted again.
  (fake_slurm / 'queue').write_text('41_0|RUNNING\n41_1|PENDING\n')
  assert cli.main(command) == 0
  out = capsys.readouterr().out
  assert '2 run(s) already queued or running (41_0, 41_1)' in out and 'nothing to submit' in out
  assert cli.main(command[:2] + ['--report']) == 0
  assert '0/2 done, 1 running, 1 queued, 0 failed' in capsys.readouterr().out
  table = (workdir / 'results.md').read_text()
  assert '| running |' in table and '| queued |' in table
  # seed=0 finished; seed=1 left the queue without results (a time limit, scancel, a lost node).
  (fake_slurm / 'queue').write_text('')
  (workdir / 'seed=0').mkdir()
  (workdir / 'seed=0' / 'results.json').write_text(json.dumps({'step': 10, 'eval_accuracy': 0.5}))
  (workdir / 'seed=1').mkdir()
  (workdir / 'seed=1' / 'log.txt').write_text(f'{runner.LAUNCH_MARKER} ...\nerror: out of memory\n')
  assert cli.main(command[:2] + ['--report']) == 0
  assert '1/2 done, 0 running, 0 queued, 1 failed' in capsys.readouterr().out
  assert '- `seed=1`: slurm job 41_1; error: out of memory' in (workdir / 'results.md').read_text()
  assert cli.main(command) == 0
  out = capsys.readouterr().out
  assert '1 run(s) already finished' in out and 'submitted 1 run(s) as SLURM job array 42' in out
  assert slurm_launcher.read_jobs(str(workdir)) == {'seed=0': '41_0', 'seed=1': '42_0'}
  script = (workdir / 'slurm' / 'array-2.sh').read_text()
  assert '--workdir=' + str(workdir / 'seed=1') in script and 'seed=0' not in script
  submissions = (fake_slurm / 'sbatch.log').read_text().splitlines()
  assert len(submissions) == 2 and '--array=0-0 ' in submissions[1] and '--cpus-per-task=2' in submissions[1]
  # Running the sweep here while SLURM holds one of its runs would train it twice.
  (fake_slurm / 'queue').write_text('42_0|RUNNING\n')
  assert cli.main(command[:2]) == 2
  assert 'error: 1 run(s) of this sweep are queued or running on SLURM (42_0)' in capsys.readouterr().err


# --- a sweep through one job array ------------------------------------------------------

EXPERIMENT = '''
from configs import digits
from flaxtpu import sweep

def get_config():
  return digits.get_config()

def get_sweep():
  return sweep.sweep('seed', [0, 1])
'''


@pytest.mark.multiprocess
def test_a_sweep_runs_as_one_job_array_and_a_rerun_submits_nothing(slurm, tmp_path):
  experiment = tmp_path / 'experiment.py'
  experiment.write_text(EXPERIMENT)
  workdir = tmp_path / 'sweep'
  sweep_command = [sys.executable, '-m', 'flaxtpu.sweep', str(experiment), f'--workdir={workdir}',
                   '--launcher=slurm', '--cpus-per-run=1', '--time=10:00', '--config.num_train_steps=6',
                   '--config.eval_every_steps=6', '--config.cpu_devices=1',
                   '--config.compilation_cache_dir=none']

  def sweep(*extra):
    done = subprocess.run(sweep_command + list(extra), cwd=ROOT, env=slurm.env, capture_output=True,
                          text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout

  def arrays():
    return json.loads((workdir / 'slurm' / 'jobs.json').read_text())['arrays']

  first = sweep()
  assert 'submitted 2 run(s) as SLURM job array' in first, first
  array_job = arrays()[0]['job']
  # Submitted again while SLURM holds the runs: nothing new (or, on a fast machine, they already finished).
  second = sweep()
  assert 'nothing to submit' in second and len(arrays()) == 1, second
  # The report works while the runs are queued or running.
  report = sweep('--report')
  assert 'results.md' in report, report
  assert (workdir / 'results.md').exists()

  waited = sweep('--wait')
  assert 'nothing to submit' in waited and '2/2 done' in waited, waited
  record = json.loads((workdir / 'sweep.json').read_text())
  assert record['launcher'] == 'slurm'
  assert {run['slurm_job'] for run in record['runs']} == {f'{array_job}_0', f'{array_job}_1'}
  for seed in (0, 1):
    run_dir = workdir / f'seed={seed}'
    results = json.loads((run_dir / 'results.json').read_text())
    assert results['step'] == 6 and 0 <= results['eval_accuracy'] <= 1
    log = (run_dir / 'log.txt').read_text()
    assert log.count(runner.LAUNCH_MARKER) == 1 and f'(slurm job {array_job}_{seed} on ' in log
  table = (workdir / 'results.md').read_text()
  assert table.count('| done |') == 2, table

  third = sweep()
  assert '2 run(s) already finished, skipping them' in third and 'nothing to submit' in third, third
  assert len(arrays()) == 1 and not slurm.queue()
  print(f'\nsacct of the sweep (array {array_job}):\n{slurm.sacct([array_job])}')


@pytest.mark.multiprocess
def test_a_run_that_left_the_queue_without_results_is_submitted_again(slurm, tmp_path):
  experiment = tmp_path / 'experiment.py'
  experiment.write_text(EXPERIMENT)
  workdir = tmp_path / 'sweep'
  base = [sys.executable, '-m', 'flaxtpu.sweep', str(experiment), f'--workdir={workdir}']
  # Held: SLURM starts none of the runs, so the test decides how each one ends.
  submit = base + ['--launcher=slurm', '--cpus-per-run=1', '--sbatch=--hold']

  def sweep(command):
    done = subprocess.run(command, cwd=ROOT, env=slurm.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout

  sweep(submit)
  jobs = json.loads((workdir / 'slurm' / 'jobs.json').read_text())['runs']
  # As a time limit, scancel or a lost node would end it: gone from the queue, no results.
  slurm.run('scancel', jobs['seed=1'])
  deadline = time.monotonic() + 60
  while any(line.startswith(f'{jobs["seed=1"]} ') for line in slurm.queue()):
    assert time.monotonic() < deadline, slurm.queue()
    time.sleep(0.2)
  again = sweep(submit)
  assert '1 run(s) already queued or running' in again and 'submitted 1 run(s)' in again, again
  resubmitted = json.loads((workdir / 'slurm' / 'jobs.json').read_text())['runs']
  assert resubmitted['seed=0'] == jobs['seed=0'] and resubmitted['seed=1'] != jobs['seed=1']
  assert '0/2 done, 0 running, 2 queued, 0 failed' in sweep(base + ['--report'])
  slurm.run('scancel', '--me')
  slurm.wait_for_empty_queue(60)
  assert '0/2 done, 0 running, 0 queued, 2 failed' in sweep(base + ['--report'])


@pytest.mark.multiprocess
def test_a_preempted_or_requeued_task_resumes_and_the_sweep_records_it_once(slurm, tmp_path):
  """scancel --signal=TERM (a preemption notice) and scontrol requeue, each mid-run: the trainer saves,
  the task goes back to the queue as itself, resumes from its checkpoint and finishes (issue 43, 7b)."""
  experiment = tmp_path / 'experiment.py'
  experiment.write_text(EXPERIMENT)
  workdir = tmp_path / 'sweep'
  command = [sys.executable, '-m', 'flaxtpu.sweep', str(experiment), f'--workdir={workdir}',
             '--launcher=slurm', '--cpus-per-run=1', '--config.num_train_steps=3000',
             '--config.checkpoint_every_steps=100', '--config.eval_every_steps=3000',
             '--config.log_every_steps=10',
             '--config.cpu_devices=1', '--config.compilation_cache_dir=none']

  def sweep(*extra):
    done = subprocess.run(command + list(extra), cwd=ROOT, env=slurm.env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout

  sweep()
  jobs = json.loads((workdir / 'slurm' / 'jobs.json').read_text())['runs']
  stops = {'seed=0': ('scancel', '--signal=TERM', jobs['seed=0']),
           'seed=1': ('scontrol', 'requeue', jobs['seed=1'])}
  deadline = time.monotonic() + JOB_TIMEOUT_S
  while stops:  # each one as soon as its run trains
    assert time.monotonic() < deadline, slurm.queue()
    for name in list(stops):
      log = workdir / name / 'log.txt'
      if log.exists() and re.search(r'step \d+/3000', log.read_text()):
        done = slurm.run(*stops.pop(name))
        assert done.returncode == 0, done.stderr
    time.sleep(0.2)

  waited = sweep('--wait')
  assert '2/2 done' in waited, waited
  record = json.loads((workdir / 'sweep.json').read_text())
  assert [(run['name'], run['status'], run['slurm_job']) for run in record['runs']] == [
      (name, runner.DONE, jobs[name]) for name in ('seed=0', 'seed=1')]
  assert json.loads((workdir / 'slurm' / 'jobs.json').read_text())['runs'] == jobs  # no second submission
  for name in ('seed=0', 'seed=1'):
    log = (workdir / name / 'log.txt').read_text()
    assert log.count(runner.LAUNCH_MARKER) == 2 and 'requeued 1 time(s)' in log, log
    stopped = int(re.search(r'stopped by SIGTERM at step (\d+)', log).group(1))
    resumed = int(re.search(r'resuming from step (\d+)', log).group(1))
    assert 0 < stopped < 3000 and resumed == stopped, log
    assert json.loads((workdir / name / 'results.json').read_text())['step'] == 3000


# --- a study whose array tasks share one storage ----------------------------------------------

SEARCH_EXPERIMENT = '''
from configs import digits

def get_config():
  return digits.get_config()

def get_search(trial):
  return {'optimizer.learning_rate': trial.suggest_float('optimizer.learning_rate', 1e-3, 1e-2, log=True)}
'''


@pytest.mark.multiprocess
def test_two_array_tasks_take_the_trials_of_one_study_from_its_journal(slurm, tmp_path):
  optuna = pytest.importorskip('optuna')
  experiment = tmp_path / 'experiment.py'
  experiment.write_text(SEARCH_EXPERIMENT)
  workdir = tmp_path / 'study'
  command = [sys.executable, '-m', 'flaxtpu.sweep', str(experiment), f'--workdir={workdir}', '--trials=2',
             '--sampler=random', '--launcher=slurm', '--parallel=2', '--cpus-per-run=1', '--time=10:00',
             '--config.num_train_steps=4', '--config.eval_every_steps=2', '--config.cpu_devices=1',
             '--config.compilation_cache_dir=none']

  def study(*extra):
    done = subprocess.run(command + list(extra), cwd=ROOT, env=slurm.env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout

  first = study('--wait')
  assert 'submitted 2 study worker(s) as SLURM job array' in first, first
  assert '2 trials: 2 complete, 0 pruned, 0 failed, 0 unfinished.' in first, first
  storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
      str(workdir / 'study.journal')))
  trials = optuna.load_study(study_name='study', storage=storage).trials
  assert [trial.state.name for trial in trials] == ['COMPLETE', 'COMPLETE']
  assert {trial.params['optimizer.learning_rate'] for trial in trials} == {
      json.loads((workdir / f'trial-00{i}' / 'config.json').read_text())['optimizer']['learning_rate']
      for i in (0, 1)}
  # Each trial was started once, by one of the two tasks (each task's sampler has its own seed).
  outputs = [path.read_text() for path in sorted((workdir / 'slurm').glob('*.out'))]
  assert len(outputs) == 2
  started = [line.split()[2] for output in outputs for line in output.splitlines()
             if line.startswith('[sweep] start ')]
  assert sorted(started) == ['trial-000', 'trial-001'], outputs
  assert 'nothing to submit' in study()
  print(f'\nstudy on SLURM: trials per task {[output.count("[sweep] start ") for output in outputs]}')


# --- one run over two srun tasks -----------------------------------------------------------

TRAIN_ARGS = ['--config=configs/digits.py', '--config.batch_size=16', '--config.num_train_steps=4',
              '--config.log_every_steps=2', '--config.eval_every_steps=4',
              '--config.checkpoint_every_steps=4', '--config.compilation_cache_dir=none']


@pytest.mark.multiprocess
def test_two_srun_tasks_train_as_one_jax_cluster_like_one_process(slurm, tmp_path):
  script = Path(ROOT) / 'examples' / 'slurm' / 'train.sbatch'
  jobs = {}
  for name, tasks, devices in (('multi', 2, 4), ('single', 1, 8)):
    submitted = slurm.run(
        'sbatch', '--parsable', f'--job-name={name}', '--nodes=1', f'--ntasks-per-node={tasks}',
        '--cpus-per-task=1', '--gpus-per-node=0', '--time=10:00', f'--output={tmp_path}/{name}-%j.out',
        f'--chdir={ROOT}', str(script), *TRAIN_ARGS, f'--workdir={tmp_path / name}',
        f'--config.cpu_devices={devices}', env={**slurm.env, 'PYTHON': sys.executable})
    assert submitted.returncode == 0, submitted.stderr
    jobs[name] = submitted.stdout.strip()
  slurm.wait_for_empty_queue()
  print(f'\nsacct of the training jobs (2 tasks: {jobs["multi"]}, 1 task: {jobs["single"]}):\n'
        f'{slurm.sacct(list(jobs.values()))}')
  outputs = {name: Path(f'{tmp_path}/{name}-{job}.out').read_text() for name, job in jobs.items()}
  for name in jobs:
    assert (tmp_path / name / 'results.json').exists(), outputs[name][-3000:]
  assert 'devices=8 (local 4) process=0/2' in outputs['multi'], outputs['multi'][-3000:]
  assert 'process=1/2' in outputs['multi']
  assert 'devices=8 (local 8) process=0/1' in outputs['single'], outputs['single'][-3000:]
  one, two = restore_checkpoint(tmp_path / 'single', 4), restore_checkpoint(tmp_path / 'multi', 4)
  assert int(one['step']) == int(two['step']) == 4
  # The same sums reduced in a different order across processes (float32).
  for x, y in zip(jax.tree.leaves(one['params']), jax.tree.leaves(two['params'])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
  single, multi = (json.loads((tmp_path / name / 'results.json').read_text()) for name in ('single', 'multi'))
  for key in ('eval_accuracy', 'eval_loss', 'train_loss'):
    np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-6)
