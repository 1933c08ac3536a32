"""Long runs: nothing the loop does per step, per save or per evaluation grows with the steps since the
last log line (a soak of the embedded digits), and a resume with another config says what it changed."""

import logging
import os
import statistics
import time

import psutil
import pytest

from configs import digits
from flaxtpu.loop import resume_changes, train
from flaxtpu.step import placing
from flaxtpu.weights import checkpoint


def _config(**overrides):
  config = digits.get_config()
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


def _count_host_metric_reads(monkeypatch) -> list:
  """Patches placement so that each read of train metrics to the host is counted; returns the list that
  each checkpoint save appends the count since the last save to."""
  reads, per_save = [0], []
  real_place, real_save = placing.place, checkpoint.Checkpoints.save

  def place(*args, **kwargs):
    placement = real_place(*args, **kwargs)
    to_host = placement.to_host_metrics

    def counted(collection):
      reads[0] += 1
      return to_host(collection)

    placement.to_host_metrics = counted
    return placement

  def save(self, step, *args, **kwargs):
    per_save.append(reads[0])
    reads[0] = 0
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(placing, 'place', place)
  monkeypatch.setattr(checkpoint.Checkpoints, 'save', save)
  return per_save


@pytest.fixture(scope='module')
def long_interval_run(tmp_path_factory):
  """60 steps, a checkpoint every 10, no log line until the last step."""
  workdir = str(tmp_path_factory.mktemp('long_interval'))
  with pytest.MonkeyPatch.context() as monkeypatch:
    per_save = _count_host_metric_reads(monkeypatch)
    results = train.train_and_evaluate(_config(num_train_steps=60, log_every_steps=100_000,
                                               checkpoint_every_steps=10, eval_every_steps=30), workdir)
  return workdir, results, per_save


def test_a_save_reads_the_train_metrics_once_however_many_steps_since_the_last_log_line(long_interval_run):
  _, results, per_save = long_interval_run
  assert results['step'] == 60
  # One read for the window saved in the record (its NaN check is one int on the side), whether 10 or
  # 50 steps have passed since the window began; before the last save, the run's only log line read it
  # and emptied it. (A list of every step's metrics, checked one by one: 11, 21, 31, 41, 51, 1.)
  assert per_save == [1, 1, 1, 1, 1, 1], per_save


def test_a_resume_with_a_longer_run_says_what_it_changes(long_interval_run, caplog):
  workdir, _, _ = long_interval_run
  config = _config(num_train_steps=90, log_every_steps=100_000, checkpoint_every_steps=10,
                   eval_every_steps=30, **{'optimizer.learning_rate': 0.001})
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(config, workdir)
  assert results['step'] == 90
  lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith('resume:')]
  # digits' cosine schedule from 3e-3 over 60 steps ends at 0 at step 60; over 90 steps with a peak of
  # 1e-3 it stands at 1e-3 x (1 + cos(pi x 60 / 90)) / 2 = 2.5e-4 at step 60.
  assert lines == ['resume: num_train_steps 60 -> 90: 60 -> 90 steps; learning rate at step 60 0 -> 0.00025',
                   'resume: optimizer.learning_rate 0.003 -> 0.001'], lines


def test_a_resume_with_another_model_is_refused_before_anything_is_read(long_interval_run):
  workdir, _, _ = long_interval_run
  before = sorted(os.listdir(os.path.join(workdir, 'checkpoints')))
  with pytest.raises(resume_changes.ResumeRefused,
                     match=r"cannot be resumed with this config \(model.name 'cnn' -> 'resnet20'\).*"
                           r'a new --workdir.*--config.init_from.checkpoint='):
    train.train_and_evaluate(_config(num_train_steps=200, **{'model.name': 'resnet20'}), workdir)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == before


def test_which_keys_a_resume_refuses():
  changed = {'model.name': ('a', 'b'), 'model.remat': ('none', 'full'), 'model.dropout': (0.0, 0.1),
             'num_epochs': (30.0, 182.0), 'batch_size': (128, 256), 'optimizer.name': ('sgd', 'adam')}
  assert resume_changes.refused(changed, 'jit') == ['model.name', 'optimizer.name']
  assert resume_changes.refused(changed, 'pmap') == ['model.name', 'optimizer.name', 'batch_size']


def test_a_long_run_with_rare_log_lines_keeps_its_epoch_time_memory_and_files_flat(tmp_path, monkeypatch):
  """24 epochs of 44 steps, an evaluation and a checkpoint after each, one log line at the end: the time of
  an epoch, the process's RSS and its open files must not grow with the steps since the last log line.
  (A loop that kept every step's metrics and read them at each save: epochs 1 s -> 7 s by the 24th.)"""
  process, seen = psutil.Process(), []
  real_evaluate = train._Loop.evaluate

  def evaluate(self, step, state):
    state = real_evaluate(self, step, state)
    seen.append((time.perf_counter(), process.memory_info().rss, process.num_fds()))
    return state

  monkeypatch.setattr(train._Loop, 'evaluate', evaluate)
  results = train.train_and_evaluate(_config(num_epochs=24.0, log_every_steps=100_000), str(tmp_path))
  assert results['step'] == 24 * 44 and len(seen) == 24
  epochs = [later[0] - earlier[0] for earlier, later in zip(seen, seen[1:])]
  early, late = statistics.median(epochs[1:8]), statistics.median(epochs[-7:])
  print(f"epoch seconds {epochs}")
  assert late < 1.5 * early + 0.25, (early, late, epochs)
  rss_growth = seen[-1][1] - seen[3][1]
  assert rss_growth < 64 * 2**20, rss_growth
  assert seen[-1][2] <= seen[3][2] + 2, [files for _, _, files in seen]
