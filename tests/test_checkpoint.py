"""Checkpoints: exact resume, SIGTERM and SIGKILL, best-keeping, restore anywhere, bad input."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest

from configs import cifar10_resnet
from conftest import (
  ROOT,
  assert_same_state,
  cli_env,
  make_image_folder,
  make_mixed_folder,
  metric_rows,
  restore_checkpoint,
)
from flaxtpu.data import loaders, pipeline
from flaxtpu.io import lock
from flaxtpu.loop import train
from flaxtpu.weights import checkpoint


def _config(folder, **overrides):
  config = cifar10_resnet.get_config()  # BatchNorm, augmentation, momentum, schedule: all must resume
  config.dataset.folder = folder
  config.batch_size = 16
  config.num_train_steps = 12
  config.log_every_steps = 4
  config.eval_every_steps = 6
  config.checkpoint_every_steps = 3
  config.schedule.warmup_epochs = 1.0
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(scope='module')
def uninterrupted(image_folder, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('uninterrupted'))
  results = train.train_and_evaluate(_config(image_folder), workdir)
  return workdir, results


def _signal_at_step(monkeypatch, step_to_signal, sig=signal.SIGTERM):
  """Sends `sig` to this process when the data pipeline reaches a step (like a preemption)."""
  real = loaders.train_batches

  def batches(*args, **kwargs):
    for step, batch in enumerate(real(*args, **kwargs), kwargs['first_step'] + 1):
      if step == step_to_signal:
        os.kill(os.getpid(), sig)
      yield batch

  monkeypatch.setattr(loaders, 'train_batches', batches)


@pytest.mark.parametrize('stop_step, streamed', [
    (4, {}), (8, {'dataset.cache': 'none', 'input.workers': 2}),
    (8, {'dataset.cache': 'none', 'input.workers': 2, 'input.threads': True})])
def test_stopped_and_resumed_equals_uninterrupted(uninterrupted, image_folder, tmp_path, monkeypatch,
                                                 stop_step, streamed):
  reference_dir, reference = uninterrupted
  workdir = str(tmp_path)
  _signal_at_step(monkeypatch, stop_step)
  # Streamed from disk by worker processes (or threads), the batches equal the cached ones bit for bit.
  stopped = train.train_and_evaluate(_config(image_folder, **streamed), workdir)
  # The prefetcher runs ahead of the loop, so the stop lands a step or two before or after.
  assert 'stopped_at_step' in stopped and stopped['stopped_at_step'] < 12
  assert not os.path.exists(os.path.join(workdir, 'results.json'))
  monkeypatch.undo()
  results = train.train_and_evaluate(_config(image_folder, **streamed), workdir)
  assert_same_state(restore_checkpoint(workdir, 12), restore_checkpoint(reference_dir, 12))
  assert metric_rows(workdir) == metric_rows(reference_dir)
  for key in ('step', 'eval_accuracy', 'eval_loss', 'train_loss', 'train_accuracy'):
    assert results[key] == reference[key]


def _cli(workdir, folder, *extra):
  env = cli_env()
  return [sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10_resnet.py', f'--workdir={workdir}',
          f'--config.dataset.folder={folder}', '--config.batch_size=16', '--config.log_every_steps=4',
          '--config.eval_every_steps=6', '--config.checkpoint_every_steps=3',
          '--config.schedule.warmup_epochs=1.0', *extra], env


def _complete_steps(workdir):
  directory = os.path.join(workdir, 'checkpoints')
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []


def test_sigkill_mid_run_resumes_from_last_complete_checkpoint(uninterrupted, image_folder, tmp_path):
  reference_dir, _ = uninterrupted
  workdir = str(tmp_path)
  # Streamed with worker processes: the restart rebuilds the same batches from (seed, step).
  command, env = _cli(workdir, image_folder, '--config.num_train_steps=12', '--config.dataset.cache=none',
                      '--config.input.workers=2')
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while not _complete_steps(workdir) and process.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  input_workers = psutil.Process(process.pid).children(recursive=True)
  process.send_signal(signal.SIGKILL)
  process.wait()
  killed_at = _complete_steps(workdir)
  with open(os.path.join(workdir, lock.LOCK_FILE)) as f:  # the dead trainer's lock, left behind ...
    assert json.load(f)['pid'] == process.pid
  # The input workers die with the trainer instead of lingering as orphans.
  _, alive = psutil.wait_procs(input_workers, timeout=10)
  assert input_workers and not alive, alive
  assert killed_at, 'the run was killed before its first checkpoint: nothing to resume from'
  restart = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert restart.returncode == 0, restart.stderr[-3000:]
  assert f'resuming from step {killed_at[-1]}' in restart.stderr  # ... does not block the restart
  assert_same_state(restore_checkpoint(workdir, 12), restore_checkpoint(reference_dir, 12))
  assert metric_rows(workdir) == metric_rows(reference_dir)


def test_killed_between_final_checkpoint_and_results_rebuilds_them(uninterrupted, image_folder, tmp_path):
  import shutil
  reference_dir, reference = uninterrupted
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference_dir, workdir)
  for name in ('results.json', 'per_class.csv', 'curves.png'):  # what a kill right after the last save leaves
    os.remove(os.path.join(workdir, name))
  results = train.train_and_evaluate(_config(image_folder), workdir)
  with open(os.path.join(workdir, 'results.json')) as f:
    assert json.load(f) == results
  assert os.path.exists(os.path.join(workdir, 'curves.png'))
  with open(os.path.join(workdir, 'per_class.csv'), newline='') as f:
    rows = list(csv.DictReader(f))
  correct, support = sum(int(row['correct']) for row in rows), sum(int(row['support']) for row in rows)
  assert correct / support == pytest.approx(reference['eval_accuracy'], abs=1e-6)
  for key in ('step', 'eval_accuracy', 'eval_loss', 'train_loss', 'train_accuracy',
              'train_images_per_sec', 'memory_plan'):
    assert results[key] == reference[key], key
  assert results['train_images_per_sec'] > 0 and results['wall_time_s'] > 0


def _signal_when(monkeypatch, owner, name, sig=signal.SIGTERM):
  """Sends `sig` to this process as `owner.name` is called: a preemption in that phase."""
  real = getattr(owner, name)

  def wrapped(*args, **kwargs):
    os.kill(os.getpid(), sig)
    return real(*args, **kwargs)

  monkeypatch.setattr(owner, name, wrapped)


def test_sigterm_while_loading_data_stops_cleanly_before_training(image_folder, tmp_path, monkeypatch):
  workdir = str(tmp_path)
  _signal_when(monkeypatch, pipeline, 'load')
  assert train.train_and_evaluate(_config(image_folder), workdir) == {'stopped_at_step': 0}
  assert not _complete_steps(workdir) and not os.path.exists(os.path.join(workdir, 'results.json'))


def test_sigterm_during_the_final_save_still_writes_results(image_folder, tmp_path, monkeypatch):
  workdir = str(tmp_path)
  _signal_when(monkeypatch, checkpoint.Checkpoints, 'wait')
  results = train.train_and_evaluate(_config(image_folder, num_train_steps=6), workdir)
  assert results['step'] == 6 and 0.0 <= results['eval_accuracy'] <= 1.0
  with open(os.path.join(workdir, 'results.json')) as f:
    assert json.load(f)['eval_loss'] == results['eval_loss']
  assert _complete_steps(workdir)[-1] == 6


@pytest.mark.parametrize('phase', ['compile', 'final_eval'])
def test_sigterm_while_compiling_or_in_the_final_eval_leaves_a_resumable_workdir(
    phase, image_folder, tmp_path, monkeypatch):
  from flaxtpu.step import placing
  workdir = str(tmp_path)
  config = _config(image_folder, num_train_steps=6)
  if phase == 'compile':  # the step compiles while the state is made: the run stops before its first step
    _signal_when(monkeypatch, placing.Placement, 'compile_train_step')
    assert train.train_and_evaluate(config, workdir) == {'stopped_at_step': 0}
    assert _complete_steps(workdir) == []
  else:  # the last step's eval runs, then the final checkpoint and results are written
    _signal_when(monkeypatch, train, 'evaluate_splits')
    results = train.train_and_evaluate(config, workdir)
    assert results['step'] == 6 and _complete_steps(workdir)[-1] == 6
  monkeypatch.undo()
  resumed = train.train_and_evaluate(config, workdir)
  assert resumed['step'] == 6 and os.path.exists(os.path.join(workdir, 'results.json'))


def test_sigterm_saves_a_complete_checkpoint_and_exits_cleanly(image_folder, tmp_path):
  workdir = str(tmp_path)
  command, env = _cli(workdir, image_folder, '--config.num_train_steps=100000')
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
  for line in process.stderr:
    if 'step 4/100000' in line:
      break
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 0, stderr[-3000:]
  stopped = [line for line in stderr.splitlines() if 'stopped by SIGTERM at step' in line]
  assert len(stopped) == 1
  step = int(stopped[0].split('at step ')[1].split(';')[0])
  assert _complete_steps(workdir)[-1] == step
  state = restore_checkpoint(workdir, step)
  assert int(state['step']) == step
  assert not os.path.exists(os.path.join(workdir, 'results.json'))


def test_keeps_the_latest_n_plus_the_best(tmp_path):
  config = _config('unused', **{'checkpoint.keep': 2})
  checkpoints = checkpoint.Checkpoints(str(tmp_path), config)
  state = {'w': jnp.arange(4.0)}
  accuracies = {1: 0.1, 2: 0.5, 3: 0.3, 4: 0.2, 5: 0.4, 6: None}
  for step, accuracy in accuracies.items():
    metrics = None if accuracy is None else {'eval_accuracy': accuracy, 'eval_loss': 1 - accuracy}
    checkpoints.save(step, state, {'step': step}, metrics=metrics)
    checkpoints.wait()
  assert checkpoints.all_steps() == [2, 5, 6]  # best (0.5) + latest two
  assert checkpoints.best_step() == 2
  assert checkpoints.resolve('best') == 2 and checkpoints.resolve('latest') == 6
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"config.eval.checkpoint='4' is not a saved step .* \[2, 5, 6\]"):
    checkpoints.resolve('4')
  checkpoints.close()
  config.checkpoint.best_metric, config.checkpoint.best_mode = 'eval_loss', 'min'
  by_loss = checkpoint.Checkpoints(str(tmp_path / 'loss'), config)
  for step, accuracy in list(accuracies.items())[:5]:
    by_loss.save(step, state, {'step': step}, metrics={'eval_accuracy': accuracy, 'eval_loss': 1 - accuracy})
  by_loss.wait()
  assert by_loss.all_steps() == [2, 4, 5]
  by_loss.close()


def test_one_restore_reads_the_whole_state_or_any_part_into_the_targets_shardings(tmp_path):
  config = _config('unused')
  writer = checkpoint.Checkpoints(str(tmp_path), config)
  state = {'params': {'dense': {'kernel': jnp.arange(16.0).reshape(8, 2), 'bias': jnp.ones(2)}},
           'opt_state': {'count': jnp.array(3)}}
  writer.save(4, state, {'model': 'mlp', 'step': 4})
  writer.wait()
  writer.close()
  reader = checkpoint.Checkpoints(str(tmp_path), config, read_only=True)
  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Explicit,))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  whole, record = reader.restore(4, state, {'model': 'mlp'})
  assert record['step'] == 4 and jax.tree.all(jax.tree.map(np.array_equal, whole, state))
  part = {'params': {'dense': {'kernel': jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=sharded)}}}
  kernel = reader.restore(4, part, subset=True)[0]['params']['dense']['kernel']
  assert kernel.sharding == sharded and np.array_equal(kernel, state['params']['dense']['kernel'])
  with pytest.raises(checkpoint.CheckpointError, match="has model='mlp' but the config gives 'cnn'"):
    reader.restore(4, state, {'model': 'cnn'})
  with pytest.raises(checkpoint.UnreadableCheckpoint, match='cannot be restored'):
    reader.restore(4, part)  # a part of the state is read only as a subset
  assert reader.newest_readable(lambda step: step * 10) == (4, 40)
  reader.close()


def _eval_cli(workdir, folder, *extra):
  command, env = _cli(workdir, folder, '--mode=eval', *extra)
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('layout', [{'parallelism': 'pmap'}, {'mesh.fsdp': 4, 'mesh.fsdp_min_size': 1024}])
def test_checkpoint_from_8_devices_evaluates_the_same_on_1(layout, image_folder, tmp_path):
  workdir = str(tmp_path)
  results = train.train_and_evaluate(_config(image_folder, num_train_steps=6, **layout), workdir)
  with open(os.path.join(workdir, 'per_class.csv'), newline='') as f:  # made of the final eval's logits
    assert (sum(int(row['correct']) for row in csv.DictReader(f)) / 21
            == pytest.approx(results['eval_accuracy']))
  result = _eval_cli(workdir, image_folder, '--config.cpu_devices=1', '--config.eval_batch_size=8')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(workdir, 'eval.json')) as f:
    evaluation = json.load(f)
  assert evaluation['num_examples'] == 21 and evaluation['step'] == 6
  assert evaluation['eval_accuracy'] == pytest.approx(results['eval_accuracy'], abs=1e-6)
  assert evaluation['eval_loss'] == pytest.approx(results['eval_loss'], rel=1e-4)


def _snapshot(directory, ignore=(lock.LOCK_FILE,)):
  """Every file and its mtime (the lock, which names the last trainer, is not the run's data)."""
  return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
          for d, _, files in os.walk(directory) for f in files if f not in ignore}


@pytest.fixture(scope='module')
def finished(image_folder, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('finished'))
  train.train_and_evaluate(_config(image_folder, num_train_steps=6), workdir)
  return workdir


def _assert_one_error(result, *fragments):
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, result.stderr[-3000:]
  for fragment in fragments:
    assert fragment in errors[0], errors[0]
  assert 'Traceback' not in result.stderr


def test_checkpoint_of_another_model_is_refused_and_nothing_changes(finished, image_folder):
  before = _snapshot(finished)
  result = _eval_cli(finished, image_folder, '--config.model.name=resnet32')
  _assert_one_error(result, "has model='resnet20' but the config gives 'resnet32'", finished)
  command, env = _cli(finished, image_folder, '--config.model.name=cnn', '--config.num_train_steps=12')
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  # Training on is refused before anything is read, naming the key and the ways out (resume_changes.py).
  _assert_one_error(result, "cannot be resumed with this config (model.name 'resnet20' -> 'cnn')",
                    'a new --workdir', f'--config.init_from.checkpoint={finished}/checkpoints')
  assert _snapshot(finished) == before


def test_resuming_with_another_optimizer_names_the_changed_keys(finished, image_folder):
  before = _snapshot(finished)
  command, env = _cli(finished, image_folder, '--config.optimizer.name=rmsprop',
                      '--config.num_train_steps=12')
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  _assert_one_error(result, 'checkpoint step 6 in', "(optimizer.name 'sgd' -> 'rmsprop')",
                    'resume with the old values')
  assert _snapshot(finished) == before


def test_checkpoint_for_another_class_count_is_refused(finished, tmp_path):
  other = make_image_folder(tmp_path / 'five', classes=('a', 'b', 'c', 'd', 'e'), train_per_class=4,
                            test_per_class=2)
  before = _snapshot(finished)
  # Classes are matched by name (the checkpoint's list): folders it never saw are named, nothing is scored.
  _assert_one_error(_eval_cli(finished, other), f"split 'test' of {other} has class folders the model is not "
                    'trained on: a (2 images)', "the model's 3 classes are cat, dog, frog")
  assert _snapshot(finished) == before


def _truncate(workdir, step):
  """Cuts every sizeable file of a checkpoint in half: a disk that filled, a copy cut short."""
  for directory, _, names in os.walk(os.path.join(workdir, 'checkpoints', str(step), 'state')):
    for name in names:
      path = os.path.join(directory, name)
      if os.path.getsize(path) > 1000:
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 2)


def test_unreadable_latest_checkpoint_falls_back_to_the_newest_readable(finished, image_folder, tmp_path):
  import shutil
  workdir = str(tmp_path / 'copy')
  shutil.copytree(finished, workdir)
  _truncate(workdir, 6)
  checkpoints = os.path.join(workdir, 'checkpoints')
  before = _snapshot(checkpoints)
  result = _eval_cli(workdir, image_folder)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'checkpoints/6 cannot be restored' in result.stderr and 'falling back' in result.stderr
  with open(os.path.join(workdir, 'eval.json')) as f:
    assert json.load(f)['step'] == 3
  assert _snapshot(checkpoints) == before  # evaluation reads the checkpoints, never changes them

  # Training resumes from step 3, sets the unreadable step aside (kept, renamed) and saves 6 again.
  command, env = _cli(workdir, image_folder, '--config.num_train_steps=6')
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'resuming from step 3' in result.stderr
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', '6' + checkpoint.UNREADABLE_SUFFIX))
  assert _complete_steps(workdir) == [3, 6] and int(restore_checkpoint(workdir, 6)['step']) == 6


def test_a_fallback_never_replaces_a_newer_result(finished, image_folder, tmp_path):
  """Issue 43, class 4: export, eval and predict falling back past a damaged step 6 keep step 6's results."""
  import shutil

  from flaxtpu.exporters import export
  from flaxtpu.modes import eval as eval_mode
  from flaxtpu.modes import predict
  from flaxtpu.settings.errors import UserError
  workdir = str(tmp_path / 'copy')
  shutil.copytree(finished, workdir)
  _truncate(workdir, 6)
  os.makedirs(os.path.join(workdir, 'export'))
  results = {os.path.join(workdir, 'export', 'export.json'): '{"step": 6}',
             os.path.join(workdir, 'eval.json'): '{"step": 6, "eval_accuracy": 1.0}',
             str(tmp_path / 'predictions.csv'): 'path,class_1\n'}  # a CSV records no step: kept too
  for path, text in results.items():
    with open(path, 'w') as f:
      f.write(text)
  config = _config(image_folder, **{'predict.input': os.path.join(image_folder, 'test', 'cat'),
                                    'predict.output_csv': str(tmp_path / 'predictions.csv')})
  for write, result in ((export.export_checkpoint, 'export'), (eval_mode.evaluate_checkpoint, 'eval.json'),
                        (predict.predict, 'predictions.csv')):
    with pytest.raises(UserError, match=rf"checkpoints/6 cannot be read, so this would write step 3's result "
                                        rf"over \S*{result}, which holds (step 6|a step it does not record); "
                                        r'.* pass --config.eval.checkpoint=3 to replace it'):
      write(config, workdir)
  assert {path: open(path).read() for path in results} == results
  # Asked for by number, step 3's result replaces it; a result of step 3 or older is no reason to refuse.
  config.eval.checkpoint = '3'
  assert len(predict.predict(config, workdir)) == 7
  config.eval.checkpoint = 'latest'
  with open(os.path.join(workdir, 'eval.json'), 'w') as f:
    f.write('{"step": 3}')
  assert eval_mode.evaluate_checkpoint(config, workdir)['step'] == 3


def test_no_readable_checkpoint_is_one_line_and_nothing_is_deleted(finished, image_folder, tmp_path):
  import shutil
  workdir = str(tmp_path / 'copy')
  shutil.copytree(finished, workdir)
  _truncate(workdir, 3)
  _truncate(workdir, 6)
  before = _snapshot(workdir)
  _assert_one_error(_eval_cli(workdir, image_folder), 'no checkpoint in', 'can be read (steps 6, 3',
                    'nothing was deleted')
  command, env = _cli(workdir, image_folder, '--config.num_train_steps=6')
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  _assert_one_error(result, 'no checkpoint in', 'nothing was deleted')
  assert _snapshot(workdir) == before


def test_a_failed_save_stops_with_one_line_and_keeps_the_previous_checkpoint(image_folder, tmp_path,
                                                                             monkeypatch):
  import errno

  import orbax.checkpoint as ocp
  real_save = ocp.handlers.JsonCheckpointHandler._save_fn

  async def disk_full_at_step_6(self, item, directory):
    if isinstance(item, dict) and item.get('data_position', {}).get('next_step') == 6:
      raise OSError(errno.ENOSPC, 'No space left on device')
    return await real_save(self, item, directory)

  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, '_save_fn', disk_full_at_step_6)
  workdir = str(tmp_path)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'saving checkpoint step 6 in .* failed \(.*No space left on device\); '
                           r'checkpoint step 3 is intact'):
    train.train_and_evaluate(_config(image_folder, num_train_steps=9), workdir)
  assert _complete_steps(workdir) == [3]
  assert int(restore_checkpoint(workdir, 3)['step']) == 3
  assert not os.path.exists(os.path.join(workdir, 'results.json'))


def test_a_bad_image_mid_run_lets_the_save_in_flight_complete(tmp_path):
  folder = make_mixed_folder(tmp_path / 'data', train_per_class=30)
  bad = tmp_path / 'data' / 'train' / 'cat' / '009.jpg'
  content = bad.read_bytes()
  bad.write_bytes(content[:len(content) * 3 // 4])  # decoded only when a batch draws it: step 3 here
  workdir = str(tmp_path / 'run')
  env = cli_env()
  result = subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10.py', f'--workdir={workdir}',
       f'--config.dataset.folder={folder}', '--config.dataset.image_size=16', '--config.dataset.cache=none',
       '--config.input.workers=2', '--config.batch_size=8', '--config.num_train_steps=60',
       '--config.checkpoint_every_steps=2', '--config.log_every_steps=2',
       '--config.compilation_cache_dir=none'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 2
  assert f'error: cannot decode image {bad} (OSError: image file is truncated' in result.stderr
  assert 'step 2/60' in result.stderr  # the error came while step 2's asynchronous save was in flight
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == ['2']  # ... which completed: no *-tmp left
  assert int(restore_checkpoint(workdir, 2)['step']) == 2


def test_one_trainer_per_workdir_and_eval_alongside(image_folder, tmp_path):
  workdir = str(tmp_path)
  # Keep every checkpoint: the live run must not delete the one the evaluation is reading.
  command, env = _cli(workdir, image_folder, '--config.num_train_steps=100000',
                      '--config.checkpoint.keep=100000')
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
  for line in process.stderr:
    if 'step 4/100000' in line:
      break
  try:
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    _assert_one_error(second, f'--workdir={workdir} is in use by a live trainer (pid {process.pid} on host')
    while not _complete_steps(workdir):
      time.sleep(0.1)
    evaluation = _eval_cli(workdir, image_folder)  # reading a live run's checkpoints is allowed
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
  finally:
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=120)
  assert process.returncode == 0


def test_missing_checkpoint_step_and_unwritable_workdir(finished, image_folder, tmp_path):
  _assert_one_error(_eval_cli(finished, image_folder, '--config.eval.checkpoint=5'),
                    "config.eval.checkpoint='5' is not a saved step")
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  command, env = _cli(str(blocker / 'run'), image_folder, '--config.num_train_steps=2')
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  _assert_one_error(result, f'--workdir={blocker}/run cannot be created')
  assert blocker.read_text() == 'not a directory'


def test_a_nan_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(image_folder, tmp_path):
  from configs import cifar10
  config = cifar10.get_config()
  config.dataset.folder = image_folder
  config.update_from_flattened_dict({
      'batch_size': 16, 'num_train_steps': 9, 'log_every_steps': 4, 'checkpoint_every_steps': 2,
      'eval_every_steps': 100, 'optimizer.name': 'sgd', 'optimizer.learning_rate': 1e30,
      'schedule.warmup_epochs': 1.0, 'compilation_cache_dir': 'none'})  # lr 0 at step 1, then huge
  workdir = str(tmp_path)
  with pytest.raises(train.TrainingDiverged,
                     match=r'loss became NaN/Inf at step 3; likely causes: a learning rate too high '
                           r'\(optimizer.learning_rate=1e\+30.*the last good checkpoint, '
                           r'step 2 in .* is intact'):
    train.train_and_evaluate(config, workdir)
  assert _complete_steps(workdir) == [2]
  state = restore_checkpoint(workdir, 2)
  assert int(state['step']) == 2
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state['params']))
  assert not os.path.exists(os.path.join(workdir, 'results.json'))
