"""The command line end to end: files in the workdir, eval, predict, plan, and one-line errors."""

import csv
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import cifar10_resnet
from conftest import ROOT, cli_env, make_mixed_folder, metric_rows
from flaxtpu.modes import eval as eval_mode
from flaxtpu.settings import lengths
from flaxtpu.step import steps
from flaxtpu.validation import config as config_lib

TINY = ['--config.batch_size=16', '--config.num_train_steps=6', '--config.log_every_steps=2',
        '--config.eval_every_steps=3', '--config.checkpoint_every_steps=3',
        '--config.compilation_cache_dir=none']


def run_cli(*args, check=True):
  env = cli_env()  # the CLI picks the devices
  result = subprocess.run([sys.executable, '-m', 'flaxtpu.main', *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  if check and result.returncode:
    raise AssertionError(result.stderr[-3000:])
  return result


@pytest.fixture(scope='module')
def trained(image_folder, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('run'))
  result = run_cli('--config=configs/cifar10.py', f'--workdir={workdir}',
                   f'--config.dataset.folder={image_folder}', *TINY)
  return workdir, result


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_train_writes_every_workdir_file(trained):
  workdir, result = trained
  assert 'platform=cpu' in result.stderr and 'devices=8' in result.stderr
  assert "jit over mesh {'data': 8, 'fsdp': 1}" in result.stderr
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(workdir))
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['model']['name'] == 'cnn'
  with open(os.path.join(workdir, 'results.json')) as f:
    results = json.load(f)
  for key in ('step', 'eval_accuracy', 'eval_loss', 'train_loss', 'train_images_per_sec', 'wall_time_s'):
    assert key in results
  assert results['step'] == 6
  assert 0.0 <= results['eval_accuracy'] <= 1.0
  assert results['memory_plan']['total_bytes'] > 0
  rows = _rows(os.path.join(workdir, 'metrics.jsonl'))
  train_rows = [r for r in rows if 'train_loss' in r]
  eval_rows = [r for r in rows if 'eval_accuracy' in r]
  assert [r['step'] for r in train_rows] == [2, 4, 6]
  assert [r['step'] for r in eval_rows] == [3, 6]
  assert eval_rows[-1]['eval_accuracy'] == results['eval_accuracy']
  assert train_rows[-1]['train_loss'] == results['train_loss']
  assert all(r['images_per_sec'] > 0 for r in train_rows)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['3', '6']
  assert 'step 6/6 (epoch ' in result.stderr and 'ETA' in result.stderr and '[input ' in result.stderr
  # The finished run's pictures, and its per-class report for the eval split.
  for name in ('per_class.csv', 'confusion.png', 'mistakes.png', 'reliability.png', 'curves.png'):
    assert os.path.getsize(os.path.join(workdir, name)) > 1000 or name == 'per_class.csv', name
  with open(os.path.join(workdir, 'per_class.csv')) as f:
    rows = [row.split(',') for row in f.readlines()[1:]]
  assert sum(int(row[1]) for row in rows) == 21  # every test example once
  assert sum(int(row[2]) for row in rows) / 21 == pytest.approx(results['eval_accuracy'], abs=1e-6)
  tags = _tensorboard_tags(workdir)
  assert {'train_images', 'parameters', 'train_loss', 'eval_accuracy', '_hparams_/session_start_info'} <= tags


def _tensorboard_tags(workdir):
  import tensorflow as tf
  tags = set()
  for name in os.listdir(workdir):
    if name.startswith('events.out.tfevents'):
      for event in tf.compat.v1.train.summary_iterator(os.path.join(workdir, name)):
        tags |= {value.tag for value in event.summary.value}
  return tags


def test_profile_wandb_and_progress_by_seconds(image_folder, tmp_path):
  workdir = str(tmp_path)
  result = run_cli('--config=configs/cifar10.py', f'--workdir={workdir}',
                   f'--config.dataset.folder={image_folder}', *TINY,
                   '--config.num_train_steps=9', '--config.log_every_steps=100',
                   '--config.log_every_secs=1e-9', '--config.profile_steps=2',
                   '--config.wandb.project=flaxtpu-test', '--config.wandb.mode=offline')
  # Every step passes the seconds trigger: one progress line and metrics row per step.
  assert ([r['step'] for r in _rows(os.path.join(workdir, 'metrics.jsonl')) if 'train_loss' in r]
          == list(range(1, 10)))
  profile = os.path.join(workdir, 'profile')
  traces = [os.path.join(d, f) for d, _, names in os.walk(profile) for f in names]
  assert any(t.endswith('.xplane.pb') for t in traces) and any(t.endswith('.trace.json.gz') for t in traces)
  assert f'profile of steps 6-7 in {profile}' in result.stderr
  # W&B in offline mode: one run log under the workdir, holding the final numbers as its history values.
  with open(os.path.join(workdir, 'results.json')) as f:
    results = json.load(f)
  logs = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(workdir, 'wandb')) for f in names
          if f.endswith('.wandb') and 'latest-run' not in d]
  assert len(logs) == 1
  with open(logs[0], 'rb') as f:
    history = f.read()
  for key in ('eval_accuracy', 'train_loss'):
    assert json.dumps(results[key]).encode() in history, key


def test_eval_mode_counts_every_example_on_one_device(trained, image_folder):
  workdir, _ = trained
  with open(os.path.join(workdir, 'results.json')) as f:
    results = json.load(f)
  # A different device count (1) and an eval batch that leaves a remainder (21 = 2 x 8 + 5).
  result = run_cli('--config=configs/cifar10.py', f'--workdir={workdir}', '--mode=eval',
                   f'--config.dataset.folder={image_folder}', '--config.cpu_devices=1',
                   '--config.eval_batch_size=8')
  assert 'devices=1' in result.stderr
  with open(os.path.join(workdir, 'eval.json')) as f:
    evaluation = json.load(f)
  assert evaluation['num_examples'] == 21
  assert evaluation['step'] == 6
  assert evaluation['eval_accuracy'] == pytest.approx(results['eval_accuracy'], abs=1e-6)
  assert evaluation['eval_loss'] == pytest.approx(results['eval_loss'], rel=1e-5)


def test_eval_needs_only_the_workdir_and_keeps_each_splits_result(trained):
  workdir, _ = trained
  run_cli(f'--workdir={workdir}', '--mode=eval')  # the config it trained with, from the workdir
  run_cli(f'--workdir={workdir}', '--mode=eval', '--config.dataset.eval_split=train[:10]')
  with open(os.path.join(workdir, 'eval.json')) as f:
    evaluation = json.load(f)
  assert (evaluation['split'], evaluation['num_examples']) == ('train[:10]', 10)
  assert sorted(evaluation['splits']) == ['test', 'train[:10]']
  assert evaluation['splits']['test']['num_examples'] == 21
  # Another test-time augmentation than training's is kept beside it, report files included.
  with open(os.path.join(workdir, 'per_class.csv')) as f:
    trained_report = f.read()
  run_cli(f'--workdir={workdir}', '--mode=eval', '--config.eval.flip_tta=true')
  with open(os.path.join(workdir, 'eval.json')) as f:
    evaluation = json.load(f)
  assert (evaluation['split'], evaluation['tta']) == ('test', 'flip')
  assert sorted(evaluation['splits']) == ['test', 'test:tta=flip', 'train[:10]']
  assert evaluation['splits']['test']['tta'] == 'none'
  with open(os.path.join(workdir, 'per_class.csv')) as f:
    assert f.read() == trained_report
  with open(os.path.join(workdir, 'per_class-tta_flip.csv'), newline='') as f:
    rows = list(csv.DictReader(f))
  assert sum(int(row['correct']) for row in rows) / 21 == pytest.approx(evaluation['eval_accuracy'], abs=1e-6)
  # A checkpoint before the last is named by its step.
  run_cli(f'--workdir={workdir}', '--mode=eval', '--config.eval.checkpoint=3')
  with open(os.path.join(workdir, 'eval.json')) as f:
    evaluation = json.load(f)
  assert evaluation['step'] == 3 and 'test:step=3' in evaluation['splits']
  assert 'per_class-step3.csv' in evaluation['report_files']
  with open(os.path.join(workdir, 'per_class.csv')) as f:
    assert f.read() == trained_report

  result = run_cli(f'--workdir={workdir}/nothing_here', '--mode=eval', check=False)
  assert result.returncode == 2 and result.stderr.strip() == (
      f'error: --workdir={workdir}/nothing_here holds no config.json of a training run; point --workdir '
      'at a trained run, or pass its --config')


def test_split_file_names_keep_the_slice():
  names = [eval_mode.split_file_name(split) for split in
           ('train[:5000]', 'train[45000:]', 'train[:90%]', 'train[90%:]', 'train[10:20]', 'train[-5:]',
            'train[:-5]', 'test')]
  assert names == ['train_5000', 'train_45000-', 'train_90pct', 'train_90pct-', 'train_10-20', 'train_-5-',
                   'train_-5', 'test']


def test_make_train_default_learns_the_embedded_digits(tmp_path):
  workdir = str(tmp_path)
  run_cli('--config=configs/digits.py', f'--workdir={workdir}')  # what `make train` runs
  with open(os.path.join(workdir, 'results.json')) as f:
    results = json.load(f)
  assert results['step'] == 880 and results['eval_accuracy'] >= 0.95
  assert results['eval_accuracy'] <= results['eval_top5_accuracy'] <= 1.0  # 10 classes: top-5 is counted
  assert os.listdir(os.path.join(workdir, 'checkpoints'))
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(workdir))
  assert len(_rows(os.path.join(workdir, 'metrics.jsonl'))) >= 40


def test_predict_mode_prints_top_classes_and_writes_csv(trained, image_folder, tmp_path):
  workdir, _ = trained
  csv_path = tmp_path / 'predictions.csv'
  result = run_cli('--config=configs/cifar10.py', f'--workdir={workdir}', '--mode=predict',
                   f'--config.predict.input={image_folder}/test/frog', '--config.predict.top_k=2',
                   f'--config.predict.output_csv={csv_path}')
  lines = [line for line in result.stdout.splitlines() if line.startswith(image_folder)]
  assert len(lines) == 7
  header, *rows = csv_path.read_text().splitlines()
  assert header == 'path,class_1,probability_1,class_2,probability_2'
  assert len(rows) == 7
  for row in rows:
    _, first, p1, second, p2 = row.split(',')
    assert {first, second} <= {'cat', 'dog', 'frog'} and 1.0 >= float(p1) >= float(p2) >= 0.0


def test_plan_mode_writes_plan_json(image_folder, tmp_path):
  run_cli('--config=configs/cifar10_resnet.py', f'--workdir={tmp_path}', '--mode=plan',
          f'--config.dataset.folder={image_folder}', '--config.batch_size=12',
          '--config.compilation_cache_dir=none')
  with open(tmp_path / 'plan.json') as f:
    plan = json.load(f)
  assert plan['mesh'] == {'data': 4, 'fsdp': 1}  # 8 CPU devices asked, 4 divide the batch of 12
  # Arguments per device, counted from the shapes: the replicated train state plus a quarter of
  # the batch (3 uint8 8x8x3 images of the toy folder and 3 int32 labels).
  config = cifar10_resnet.get_config()
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=np.zeros(3),
                           std=np.ones(3), length=lengths.run_length(config, 50_000))
  state_bytes = sum(x.size * x.dtype.itemsize
                    for x in jax.tree.leaves(jax.eval_shape(lambda: steps.init_state(task, 0))))
  # And the 7 float32 numbers of the optimizer and loss that this recipe's step reads as inputs (learning
  # rate, weight decay, momentum, final fraction, label smoothing, run length, warmup: step_inputs.py; jit
  # drops the ones it does not read).
  assert plan['argument_bytes'] == state_bytes + 3 * 8 * 8 * 3 + 3 * 4 + 7 * 4
  # The donated state is returned in place: outputs alias it, so it is not counted twice.
  assert plan['alias_bytes'] >= state_bytes - 16
  assert plan['total_bytes'] < plan['argument_bytes'] + plan['output_bytes'] + plan['temp_bytes']
  assert plan['temp_bytes'] > 0 and plan['model'] == 'resnet20'
  assert not os.path.exists(tmp_path / 'checkpoints')


def test_imagenet_recipe_plans_on_a_stand_in_folder(tmp_path):
  folder = make_mixed_folder(tmp_path / 'stand_in', train_per_class=2, test_per_class=2)
  run_cli('--config=configs/imagenet_resnet50.py', f'--workdir={tmp_path / "plan"}', '--mode=plan',
          f'--config.dataset.folder={folder}', '--config.dataset.eval_split=test', '--config.batch_size=8',
          '--config.eval_batch_size=8', '--config.compilation_cache_dir=none')
  with open(tmp_path / 'plan' / 'plan.json') as f:
    plan = json.load(f)
  assert plan['model'] == 'resnet50' and plan['image_shape'] == [224, 224, 3]
  assert plan['dtype'] == 'bfloat16' and plan['mesh'] == {'data': 8, 'fsdp': 1}
  # ResNet-50 (3 classes): 23.5M parameters + as much momentum, float32, replicated on each device.
  assert 180e6 < plan['argument_bytes'] < 200e6 and plan['temp_bytes'] > 0


@pytest.mark.parametrize('args, message', [
    (['--config.model.name=vgg'], "error: config.model.name='vgg' is not valid; choose one of: 'cnn'"),
    (['--config.no_such_key=1'], 'error: --config.no_such_key: not a config key'),
    (['--config.optimizer.lr=0.1'],
     "error: --config.optimizer.lr: not a config key (did you mean 'optimizer.learning_rate'?)"),
    (['--config.batch_size=abc'], "error: flag --config.batch_size=abc: invalid literal for int()"),
    # Data the config can read: the data is read while the devices start, so its error would come first.
    (['--config.batch_size=12', '--config.mesh.data=8', '--config.dataset.name=digits'],
     'error: config.mesh.data=8 x config.mesh.fsdp=1 does not fit 4 devices'),
    (['--config.num_epochs=0'], 'error: config.num_epochs=0.0 must be > 0'),
    (['--config.dataset.folder=/nonexistent'],
     "error: config.dataset.folder='/nonexistent' is not a directory"),
    (['--config.require_platform=tpu'], "error: config.require_platform='tpu' but JAX found cpu"),
])
def test_bad_input_is_one_line_and_nonzero(args, message, tmp_path):
  workdir = tmp_path / 'run'
  result = run_cli('--config=configs/cifar10.py', f'--workdir={workdir}', *args, check=False)
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
  assert 'Traceback' not in result.stderr and 'a bug?' not in result.stderr


@pytest.mark.parametrize('config_text, message', [
    (None, 'error: --config=MISSING does not exist; config files in'),
    ('FOLDER',
     'error: --config=MISSING is a folder, not a config file; config files in MISSING: MISSING/a.py'),
    ('from flaxtpu.settings import defaults\n\ndef get_config():\n  config = defaults.get_config()\n'
     '  config.model.nme = "resnet20"\n  return config\n',
     "sets config key 'nme', which does not exist (did you mean 'name'?)"),
])
def test_bad_config_file_is_one_line(config_text, message, tmp_path):
  path = tmp_path / {None: 'missing.py', 'FOLDER': 'recipes'}.get(config_text, 'typo.py')
  if config_text == 'FOLDER':  # --config=configs: the recipes in it are named
    path.mkdir()
    (path / 'a.py').write_text('')
  elif config_text is not None:
    path.write_text(config_text)
  result = run_cli(f'--config={path}', f'--workdir={tmp_path / "run"}', check=False)
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
  assert message.replace('MISSING', str(path)) in errors[0]
  assert 'Traceback' not in result.stderr and not (tmp_path / 'run').exists()


def test_eval_without_checkpoint_names_the_path(tmp_path, image_folder):
  result = run_cli('--config=configs/cifar10.py', f'--workdir={tmp_path}', '--mode=eval',
                   f'--config.dataset.folder={image_folder}', check=False)
  assert result.returncode != 0
  assert f'error: no checkpoints in {tmp_path}/checkpoints' in result.stderr
  assert os.listdir(tmp_path) == []


def _cpu_flags(xla_flags='', mode='train', **overrides):
  from flaxtpu import main as main_lib  # pylint: disable=g-import-not-at-top
  config = cifar10_resnet.get_config()
  config.update(overrides)
  return main_lib.cpu_xla_flags(config, mode, xla_flags)


def test_cpu_flags_set_devices_and_convolutions_unless_the_user_did():
  assert _cpu_flags() == ('--xla_force_host_platform_device_count=8', '')
  eigen = '--xla_cpu_experimental_ynn_fusion_type=-individual_convolution'
  assert _cpu_flags(cpu_convolutions='eigen')[0] == f'--xla_force_host_platform_device_count=8 {eigen}'
  # 8 devices do not divide a batch of 12: the largest count that does, said in the log.
  assert _cpu_flags(batch_size=12, cpu_convolutions='eigen') == (
      f'--xla_force_host_platform_device_count=4 {eigen}',
      'using 4 CPU devices, not config.cpu_devices=8: batch sizes 12/12 must divide over them')
  assert _cpu_flags(mode='predict')[0] == '--xla_force_host_platform_device_count=1'
  # What the user put in XLA_FLAGS stays as it is.
  mine = '--xla_force_host_platform_device_count=2 --xla_cpu_experimental_ynn_fusion_type='
  assert _cpu_flags(mine, cpu_convolutions='eigen') == (mine, '')
  assert _cpu_flags(cpu_devices=0, cpu_convolutions='xla') == ('', '')


def test_the_tpu_runtime_maps_a_small_transfer_buffer_unless_the_user_set_one(monkeypatch):
  """The TPU runtime's 4 GiB default buffer took 6.8 s of its start on a TPU v5e host: 256 MiB a chip."""
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top

  from flaxtpu import main as main_lib  # pylint: disable=g-import-not-at-top
  for name in ('TPU_PREMAPPED_BUFFER_SIZE', 'TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES'):
    monkeypatch.delenv(name, raising=False)
  config = cifar10_resnet.get_config()
  monkeypatch.setattr(hardware_utils, 'num_available_tpu_chips_and_device_id', lambda: (0, None))
  main_lib._size_tpu_transfer_buffer(config)  # no TPU here: the environment stays as it is
  assert 'TPU_PREMAPPED_BUFFER_SIZE' not in os.environ
  monkeypatch.setattr(hardware_utils, 'num_available_tpu_chips_and_device_id', lambda: (4, None))
  main_lib._size_tpu_transfer_buffer(config)
  assert os.environ['TPU_PREMAPPED_BUFFER_SIZE'] == str(4 * 256 << 20)
  assert os.environ['TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES'] == str(4 * 256 << 20)
  monkeypatch.setenv('TPU_PREMAPPED_BUFFER_SIZE', str(1 << 30))  # the user's own stays
  monkeypatch.delenv('TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES')
  main_lib._size_tpu_transfer_buffer(config)
  assert os.environ['TPU_PREMAPPED_BUFFER_SIZE'] == str(1 << 30)
  assert 'TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES' not in os.environ
  monkeypatch.delenv('TPU_PREMAPPED_BUFFER_SIZE')
  config.tpu_premapped_buffer_mib = 0  # the runtime's own default
  main_lib._size_tpu_transfer_buffer(config)
  assert 'TPU_PREMAPPED_BUFFER_SIZE' not in os.environ
  config.tpu_premapped_buffer_mib = -1
  with pytest.raises(config_lib.ConfigError, match='tpu_premapped_buffer_mib=-1 must be a whole number'):
    config_lib.validate(config)


_CONV_GRADIENT = '''
import json, jax, jax.numpy as jnp, numpy as np
def loss(w, x):
  y = jax.lax.conv_general_dilated(x, w, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  return jnp.sum(y ** 2)
rng = np.random.default_rng(0)
x, w = rng.normal(size=(4, 8, 8, 16)).astype(np.float32), rng.normal(size=(3, 3, 16, 32)).astype(np.float32)
compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile()
print(json.dumps({'ynn': 'ynn_fusion' in compiled.as_text(),
                  'grads': [np.asarray(g).ravel().tolist() for g in compiled(w, x)]}))
'''


def test_eigen_convolutions_leave_ynnpack_and_keep_the_numbers():
  """`cpu_convolutions=eigen` reaches XLA: no convolution runs as a YNNPACK fusion, gradients match to
  float32 rounding."""
  results = {}
  for setting in ('xla', 'eigen'):
    flags, _ = _cpu_flags(cpu_convolutions=setting, cpu_devices=1)
    env = dict(os.environ, XLA_FLAGS=flags)
    out = subprocess.run([sys.executable, '-c', _CONV_GRADIENT], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    results[setting] = json.loads(out.strip().splitlines()[-1])
  assert results['xla']['ynn'] and not results['eigen']['ynn']
  for default, eigen in zip(results['xla']['grads'], results['eigen']['grads']):
    default, eigen = np.asarray(default), np.asarray(eigen)
    # float32 sums of 256 products in another order: relative to the gradient's scale
    assert np.abs(eigen - default).max() <= 1e-5 * np.abs(default).max()


def test_a_failing_tensorboard_or_wandb_writer_never_stops_training(tmp_path, monkeypatch, caplog):
  """Issue 43, class 7: TensorBoard failing at a write, W&B failing to start: one warning each, the
  writes go on into metrics.jsonl."""
  from flaxtpu.io import events, writers
  from flaxtpu.settings import defaults

  def full_disk(self, step, scalars):
    raise OSError(28, 'No space left on device')

  def offline(*args, **kwargs):
    raise RuntimeError('wandb.init() timed out: the W&B server cannot be reached')

  monkeypatch.setattr(events.SummaryWriter, 'write_scalars', full_disk)
  monkeypatch.setattr(writers.WandbWriter, '__init__', offline)
  config = defaults.get_config()
  config.wandb.project = 'p'
  writer = writers.create_writer(str(tmp_path), is_main_process=True, config=config)
  for step in (1, 2):
    writer.write_scalars(step, {'train_loss': 0.5 / step})
  writer.flush()
  writer.close()
  assert metric_rows(str(tmp_path)) == [{'step': 1, 'train_loss': 0.5}, {'step': 2, 'train_loss': 0.25}]
  warnings = [r.getMessage() for r in caplog.records if 'training goes on without it' in r.getMessage()]
  assert warnings == [
      'Weights & Biases failed in its start (RuntimeError: wandb.init() timed out: the W&B server cannot '
      'be reached); training goes on without it (metrics.jsonl keeps every metric)',
      'TensorBoard failed in write_scalars (No space left on device); training goes on without it '
      '(metrics.jsonl keeps every metric)']
