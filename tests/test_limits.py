"""Runs that cannot fit, disks that refuse files, exports killed mid-way: one line, nothing lost."""

import contextlib
import errno
import os
import shutil
import subprocess
import sys

import pytest

from configs import digits
from conftest import ROOT
from flaxtpu.data import memory
from flaxtpu.exporters import export
from flaxtpu.io import files
from flaxtpu.loop import train
from flaxtpu.modes import eval as eval_mode
from flaxtpu.report import writer
from flaxtpu.settings.errors import UserError
from flaxtpu.validation.config import ConfigError
from flaxtpu.validation.workdir_config import from_saved
from flaxtpu.weights import checkpoint


def _digits(**overrides):
  config = digits.get_config()
  config.update(num_train_steps=4, log_every_steps=2, eval_every_steps=4, checkpoint_every_steps=4,
                compilation_cache_dir='none', cpu_devices=1)
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('run'))
  train.train_and_evaluate(_digits(), workdir)
  return workdir


@contextlib.contextmanager
def read_only(directory):
  """`directory` on a read-only mount (root) or without write permission (anyone else)."""
  if os.geteuid() != 0:
    os.chmod(directory, 0o555)
    yield directory
    os.chmod(directory, 0o755)
    return
  mounted = f'{directory}-ro'
  os.makedirs(mounted)
  if subprocess.run(['mount', '--bind', directory, mounted], capture_output=True).returncode or \
      subprocess.run(['mount', '-o', 'remount,ro,bind', mounted], capture_output=True).returncode:
    subprocess.run(['umount', mounted], capture_output=True)
    pytest.skip('no read-only bind mount here')
  try:
    yield mounted
  finally:
    subprocess.run(['umount', mounted], check=True)
    os.rmdir(mounted)


# --- 3. a run that cannot fit is refused before it starts ---------------------------------------


def test_host_estimate_counts_every_batch_alive():
  config = _digits(**{'dataset.image_size': 100_000})
  estimate = memory.host_estimate(config, (100_000, 100_000, 1), streamed=False)
  image = 100_000 * 100_000
  # prefetch 4 + one being built; train: + the step's and two on the devices; eval: + the one scored
  assert estimate.train_batches == 32 * image * (4 + 1 + 3)
  assert estimate.eval_batches == 32 * image * (4 + 1 + 1)
  assert estimate.workers == 0
  assert estimate.total == 4_480_000_000_000
  streamed = memory.host_estimate(_digits(**{'input.workers': 6}), (8, 8, 3), streamed=True)
  assert streamed.workers == 2 * 6 * memory.WORKER_BYTES
  assert streamed.train_batches == 32 * 192 * (6 + 6 + 3)


def test_cli_refuses_a_huge_image_size_before_the_workdir_exists(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py', f'--workdir={workdir}',
       '--config.dataset.image_size=100000'], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  line = result.stderr.strip().splitlines()[-1]
  assert line.startswith('error: config.dataset.image_size=100000 cannot fit: the input pipeline needs '
                         'about 4172.3 GiB (4480000000000 bytes) of host memory, more than the ')
  assert 'Traceback' not in result.stderr
  assert not workdir.exists()  # no lock, no metrics file


@pytest.mark.parametrize('overrides, key', [
    ({'batch_size': 10**8, 'dataset.image_size': 32}, 'batch_size'),
    ({'eval_batch_size': 10**8, 'dataset.image_size': 32}, 'eval_batch_size'),
    ({'input.prefetch': 10**8, 'dataset.image_size': 32}, 'input.prefetch'),
    ({'dataset.image_size': 100_000}, 'dataset.image_size'),
    ({'input.workers': 100_000, 'dataset.cache': 'none', 'dataset.folder': '/photos'}, 'input.workers'),
])
def test_each_key_that_sizes_the_pipeline_is_named(overrides, key):
  config = _digits(**overrides)
  with pytest.raises(ConfigError,
                     match=rf'^config\.{key}=\d+ cannot fit: .* available .*; lower config\.{key}$'):
    memory.check_before_start(config, 'train')
  memory.check_before_start(_digits(), 'train')  # the recipe itself fits


def test_a_native_size_that_cannot_fit_stops_before_metrics(tmp_path, monkeypatch):
  monkeypatch.setattr(memory, 'available_bytes', lambda: 20_000)
  with pytest.raises(ConfigError, match=r'needs about 0 MiB \(28672 bytes\) of host memory, more than the '
                                        r'0 MiB available'):
    train.train_and_evaluate(_digits(), str(tmp_path))  # digits: 8x8x1, known once the data is read
  assert not {'metrics.jsonl', 'config.json', 'checkpoints'} & set(os.listdir(tmp_path))


def test_a_train_step_larger_than_the_device_is_refused(monkeypatch):
  monkeypatch.setattr(memory, 'available_bytes', lambda: 2**30)
  plan = {'argument_bytes': 0, 'output_bytes': 0, 'temp_bytes': 2**30, 'total_bytes': 2**30}
  with pytest.raises(ConfigError, match=r'config.batch_size=32 cannot fit: the compiled train step .* needs '
                                        r'[\d.]+ GiB \((\d+) bytes\) of device memory, '
                                        r'more than the 1.0 GiB'):
    memory.check_device(_digits(), plan)
  memory.check_device(_digits(), {**plan, 'temp_bytes': 2**20})


# --- 5. read-only and full disks --------------------------------------------------------------


def test_a_full_disk_names_the_cause_path_and_intact_step_first(tmp_path):
  checkpoints = checkpoint.Checkpoints(str(tmp_path), _digits())
  os.makedirs(os.path.join(checkpoints.directory, '3'))
  spec = '{"driver": "ocdbt", "base": {"driver": "file", "path": "' + 'x' * 2000 + '"}}'
  tensorstore_error = ValueError(f'RESOURCE_EXHAUSTED: Error writing in OCDBT database {spec}: Failed to '
                                 "write 33172 bytes: No space left on device [os_error_code='28']")
  with pytest.raises(checkpoint.CheckpointError) as raised:
    with checkpoints._save_errors(6):
      raise tensorstore_error
  checkpoints.close()
  first = str(raised.value)[:200]
  assert 'no space left' in first.lower() and checkpoints.directory in first
  assert 'checkpoint step 3 is intact' in first
  assert len(str(raised.value)) < 400


def test_eval_of_a_read_only_run_writes_its_files_elsewhere(trained, tmp_path, monkeypatch):
  monkeypatch.setattr('tempfile.tempdir', str(tmp_path))
  before = sorted(os.listdir(trained))
  config = from_saved(files.read_json(os.path.join(trained, 'config.json')))
  with read_only(trained) as workdir:
    results = eval_mode.evaluate_checkpoint(config, workdir)
  elsewhere = os.path.join(tmp_path, 'flaxtpu', os.path.abspath(workdir).strip(os.sep).replace(os.sep, '_'))
  assert files.read_json(os.path.join(elsewhere, 'eval.json'))['eval_accuracy'] == results['eval_accuracy']
  assert os.path.exists(os.path.join(elsewhere, 'per_class.csv'))
  assert sorted(os.listdir(trained)) == before


def test_eval_on_a_full_disk_is_one_line(trained, tmp_path, monkeypatch):
  workdir = shutil.copytree(trained, tmp_path / 'run')
  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device', os.path.join(workdir, 'confusion.png'))
  monkeypatch.setattr(writer, 'write_eval_report', full)
  config = from_saved(files.read_json(os.path.join(workdir, 'config.json')))
  with pytest.raises(UserError, match=rf'^cannot write {workdir}: No space left on device; free disk space'):
    eval_mode.evaluate_checkpoint(config, str(workdir))


def test_predict_into_an_unwritable_place_is_one_line(tmp_path):
  with read_only(str(tmp_path)) as directory:
    with pytest.raises(UserError, match=r'cannot write .*/p.csv: (Read-only file system|Permission denied); '
                                        r'choose another --config.predict.output_csv'):
      files.write_csv(os.path.join(directory, 'p.csv'), [{'path': 'a.png'}], 'predict.output_csv')


def test_cli_export_into_a_read_only_workdir_is_one_line(trained):
  with read_only(trained) as workdir:
    result = subprocess.run(
        [sys.executable, '-m', 'flaxtpu.main', f'--workdir={workdir}', '--mode=export'], cwd=ROOT,
        capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(
      f'error: --mode=export writes {workdir}/export, but {workdir} refuses files (')
  assert 'Traceback' not in result.stderr


# --- 7. export is atomic ----------------------------------------------------------------------


class Killed(BaseException):
  """A SIGKILL: nothing after it runs, no except clause catches it."""


def _export_dir(path, content):
  os.makedirs(os.path.join(path, 'saved_model'))
  for name in ('model.tflite', 'export.json'):
    with open(os.path.join(path, name), 'w') as f:
      f.write(content)


def _content(workdir):
  with open(os.path.join(workdir, 'export', 'model.tflite')) as f:
    return f.read()


@pytest.mark.parametrize('first', [True, False], ids=['first export', 'replacing one'])
@pytest.mark.parametrize('kill_at', range(5))
def test_a_kill_at_any_instant_leaves_the_old_export_or_the_new(tmp_path, monkeypatch, kill_at, first):
  workdir = str(tmp_path)
  if not first:
    _export_dir(os.path.join(workdir, 'export'), 'old')
  staging = os.path.join(workdir, f'export.staging-{os.getpid()}')
  operations = []

  def step(real):
    def run(*args, **kwargs):
      operations.append(real.__name__)
      if len(operations) == kill_at:
        raise Killed
      return real(*args, **kwargs)
    return run

  _export_dir(staging, 'new')
  if kill_at == 0:  # killed while staging: export.json not written yet
    os.remove(os.path.join(staging, 'export.json'))
  else:
    monkeypatch.setattr(os, 'rename', step(os.rename))
    monkeypatch.setattr(shutil, 'rmtree', step(shutil.rmtree))
    with contextlib.suppress(Killed):
      export._move_into_place(staging, os.path.join(workdir, 'export'))
    monkeypatch.undo()
  export.recover(workdir)  # what the next export does first
  assert os.listdir(workdir) == (['export'] if not first or kill_at else [])
  swapped = kill_at != 0 and (first or kill_at != 1)  # complete staging and the old export moved aside
  if os.listdir(workdir):
    assert _content(workdir) == ('new' if swapped else 'old')


def test_staging_of_a_live_export_is_left_alone(tmp_path):
  live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  try:
    _export_dir(os.path.join(tmp_path, f'export.staging-{live.pid}'), 'new')
    _export_dir(os.path.join(tmp_path, '.export-0123456789ab'), 'legacy')  # left by an older version
    export.recover(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['export', f'export.staging-{live.pid}']  # legacy one moved in
  finally:
    live.kill()
    live.wait()


def test_a_full_disk_during_export_keeps_the_previous_export(trained, tmp_path, monkeypatch):
  workdir = str(shutil.copytree(trained, tmp_path / 'run'))
  _export_dir(os.path.join(workdir, 'export'), 'old')

  def full(tf, directory, *args):
    with open(os.path.join(directory, 'class_names.txt'), 'w') as f:
      f.write('half')
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(export, '_export_into', full)
  config = from_saved(files.read_json(os.path.join(workdir, 'config.json')))
  with pytest.raises(UserError, match=r'^exporting step 4 into .* failed \(No space left on device\); the '
                                      r'previous export in .*/export is unchanged'):
    export.export_checkpoint(config, workdir)
  assert _content(workdir) == 'old'
  assert not [name for name in os.listdir(workdir) if name.startswith('export.')]



def test_a_forced_memory_cache_that_cannot_fit_is_refused_before_decoding(image_folder, monkeypatch):
  """Issue 43, class 8: dataset.cache=memory is estimated first (69 images of at least 19x19x3 bytes at
  image_size=16: 74727 bytes), then refused in one line with the numbers and the fix; nothing decodes."""
  from flaxtpu.data import cache, pipeline
  from flaxtpu.settings import defaults
  decoded = []
  monkeypatch.setattr(cache, 'examples', lambda *args, **kwargs: decoded.append(args))
  monkeypatch.setattr(memory, 'available_bytes', lambda: 50_000)
  config = defaults.get_config()
  config.dataset.update({'folder': image_folder, 'image_size': 16, 'cache': 'memory'})
  with pytest.raises(ConfigError, match=r'^config.dataset.cache=memory cannot fit: the 69 images decode '
                                        r'to about 0 MiB \(19x19x3 uint8 each at least\), more than the 0 '
                                        r'MiB of host memory available; set --config.dataset.cache=auto'):
    pipeline.load(config)
  assert decoded == []
  monkeypatch.setattr(memory, 'available_bytes', lambda: 80_000)  # enough: decoded as asked
  pipeline.load(config)
  assert len(decoded) == 2
