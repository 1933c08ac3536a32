"""Start-up: the time from the command to the first step, and what a run compiles (once, and from the
persistent compilation cache on the second run)."""

import collections
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cli_env
from flaxtpu.loop import progress

# The CLI with jax.monitoring listeners: each backend compile (a persistent-cache hit included) and each
# compilation-cache event is written to $EVENTS when the process exits.
WITH_LISTENERS = '''
import atexit, json, os, runpy, sys
from jax import monitoring
compiles, cache_events = [], {}
def on_duration(event, seconds, **kwargs):
  if event == '/jax/core/compile/backend_compile_duration':
    compiles.append(kwargs['fun_name'])
def on_event(event, **kwargs):
  if event.startswith('/jax/compilation_cache/'):
    cache_events[event] = cache_events.get(event, 0) + 1
monitoring.register_event_duration_secs_listener(on_duration)
monitoring.register_event_listener(on_event)
import logging
ahead = []  # how many programs had compiled when the CLI said it had compiled ahead
imported_at_first_step = []  # the libraries a run needs only later, imported by its first step
class Ahead(logging.Handler):
  def emit(self, record):
    if record.getMessage().startswith('compiled the train step ahead'):
      ahead.append(len(compiles))
    if record.getMessage().startswith('first step done'):
      imported_at_first_step.extend(m for m in ('orbax.checkpoint',) if m in sys.modules)
logging.getLogger().addHandler(Ahead())
def write_events():
  with open(os.environ['EVENTS'], 'w') as f:
    json.dump({'compiles': compiles, 'cache': cache_events, 'ahead': ahead[0] if ahead else 0,
               'imported_at_first_step': imported_at_first_step}, f)
atexit.register(write_events)
sys.argv[0] = 'flaxtpu.main'
runpy.run_module('flaxtpu.main', run_name='__main__')
'''

# 100 train examples in batches of 32: 3 steps an epoch, so 7 steps cross two epoch boundaries. 50 eval
# examples in batches of 16 end in a batch of 2 (padded). Log lines at 3, 6, 7 and a save at 5 merge
# windows of 3, 2 and 1 steps.
SHORT_RUN = ['--config=configs/digits.py', '--config.dataset.train_split=train[:100]',
             '--config.dataset.eval_split=test[:50]', '--config.batch_size=32', '--config.eval_batch_size=16',
             '--config.num_train_steps=7', '--config.log_every_steps=3', '--config.eval_every_steps=4',
             '--config.checkpoint_every_steps=5']
# flaxtpu's own compiled functions and their programs in a run (the rest are JAX's eager operations, one
# program per shape): merge_metrics merges the eval step's metrics; the train metrics window (loop/window.py)
# counts its first step and adds each later one, one program each.
OWN_PROGRAMS = {'jit(init_state)': 1, 'jit(train_step)': 1, 'jit(eval_step)': 1, 'jit(merge_metrics)': 1,
                'jit(_count_step)': 1, 'jit(_add_step)': 1}


# Where the data read is still going once the trainer is imported, the CLI compiles the first step's programs
# ahead (compile_plan.compile_ahead) and the run reads them back from the cache: once more each, as hits.
AHEAD_LINE = 'compiled the train step ahead'

# The data read held back, once listed, until the train step has been compiled ahead (at most WAIT s):
# the compile ahead happens whatever the machine's speed.
READ_AFTER_AHEAD = '''
import logging, threading
from flaxtpu.data import pipeline
compiled_ahead = threading.Event()
class Watch(logging.Handler):
  def emit(self, record):
    if record.getMessage().startswith('compiled the train step ahead'):
      compiled_ahead.set()
logging.getLogger().addHandler(Watch())
original_read = pipeline._read
def held_read(source, splits, spec, transform, eval_transform, listed):
  def then_wait(shape):
    listed(shape)
    compiled_ahead.wait(WAIT)
  return original_read(source, splits, spec, transform, eval_transform, then_wait)
pipeline._read = held_read
'''


def run_counting_compiles(workdir, cache_dir, events, *overrides, hold_read_s=0):
  env = cli_env()  # the CLI picks the devices
  program = (READ_AFTER_AHEAD.replace('WAIT', str(hold_read_s)) if hold_read_s else '') + WITH_LISTENERS
  result = subprocess.run([sys.executable, '-c', program, *SHORT_RUN, *overrides, f'--workdir={workdir}',
                           f'--config.compilation_cache_dir={cache_dir}'],
                          cwd=ROOT, env={**env, 'EVENTS': str(events)}, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(events) as f:
    return json.load(f), result.stderr


def _first_step_programs(run: list) -> int:
  """How many of the run's compiles came before its first step: up to the later of its state's init and its
  train step, which compile side by side (placing.StepAhead), in either order."""
  return max(run.index('jit(train_step)'), run.index('jit(init_state)')) + 1


def test_second_run_compiles_nothing_and_eval_or_a_partial_batch_compiles_once(tmp_path):
  cache_dir = tmp_path / 'cache'
  first, log = run_counting_compiles(tmp_path / 'first', cache_dir, tmp_path / 'first.json')
  # Compiled ahead where the data read outlasted the imports here: up to its first step the run then read
  # its programs back (see the test below).
  run = first['compiles'][first['ahead']:]
  # Whatever the last train or eval batch, or the length of a log window: each program once.
  assert {name: collections.Counter(run)[name] for name in OWN_PROGRAMS} == OWN_PROGRAMS, run
  # Every program went into the cache, however small or quick to compile.
  hits = first['cache'].get('/jax/compilation_cache/cache_hits', 0)
  assert hits == (_first_step_programs(run) if first['ahead'] else 0), first
  assert first['cache'].get('/jax/compilation_cache/cache_misses') == len(first['compiles']) - hits, first
  assert 'first step done' in log and 'after the command' in log
  assert first['imported_at_first_step'] == []  # orbax: imported after it, for the first save
  assert sorted(os.listdir(tmp_path / 'first' / 'checkpoints')) == ['5', '7']
  with open(tmp_path / 'first' / 'results.json') as f:
    assert json.load(f)['time_to_first_step_s'] > 0

  # A new workdir on the same cache: the same programs, every one read from the cache.
  second, _ = run_counting_compiles(tmp_path / 'second', cache_dir, tmp_path / 'second.json')
  assert set(second['compiles']) == set(first['compiles'])  # how many times: whether either compiled ahead
  assert second['cache'].get('/jax/compilation_cache/cache_misses', 0) == 0, second
  assert second['cache'].get('/jax/compilation_cache/cache_hits') == len(second['compiles']), second


def test_the_first_step_compiles_while_the_data_is_read_and_the_run_reads_it_back(tmp_path):
  first, log = run_counting_compiles(tmp_path / 'run', tmp_path / 'cache', tmp_path / 'events.json',
                                     hold_read_s=60)
  assert AHEAD_LINE in log, log[-3000:]
  ahead, run = first['compiles'][:first['ahead']], first['compiles'][first['ahead']:]
  assert {'jit(init_state)', 'jit(train_step)'} <= set(ahead), ahead
  assert {name: collections.Counter(run)[name] for name in OWN_PROGRAMS} == OWN_PROGRAMS, run
  # Up to its first step the run compiled nothing new: what it compiled there (its state's init and train
  # step) it read from the cache, the rest (the sample's augmentation) it had in memory already. Every
  # program after it (the eval step, the metrics) is new.
  before_first_step = _first_step_programs(run)
  assert first['cache'].get('/jax/compilation_cache/cache_hits') == before_first_step, (first, run)
  misses = first['cache'].get('/jax/compilation_cache/cache_misses')
  assert misses == len(first['compiles']) - before_first_step, first
  lines = log.splitlines()
  ahead = next(i for i, line in enumerate(lines) if AHEAD_LINE in line)
  assert ahead < next(i for i, line in enumerate(lines) if 'data read in' in line)


def test_nothing_compiles_ahead_where_the_step_needs_more_than_the_listing(tmp_path):
  # normalize=standardize: the step's numbers come from the train images' pixels.
  events, log = run_counting_compiles(tmp_path / 'run', tmp_path / 'cache', tmp_path / 'events.json',
                                      '--config.dataset.normalize=standardize', hold_read_s=2)
  assert AHEAD_LINE not in log
  assert events['cache'].get('/jax/compilation_cache/cache_hits', 0) == 0, events


def test_process_start_time_is_when_the_command_started():
  script = ('import time; typed = time.time(); from flaxtpu.loop import progress; '
            'print(typed - progress.process_start_time(fallback=0.0))')
  result = subprocess.run([sys.executable, '-c', script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
  # The interpreter's own start-up lies between the process's start and the script's first line.
  assert -0.05 < float(result.stdout) < 2.0


def test_process_start_time_falls_back_where_proc_is_missing(monkeypatch):
  def no_proc(*args, **kwargs):
    raise FileNotFoundError('/proc/self/stat')

  monkeypatch.setattr(progress, 'open', no_proc, raising=False)
  assert progress.process_start_time(fallback=123.0) == 123.0


def test_time_to_first_step_counts_from_the_command(monkeypatch, caplog):
  clock_time = [1000.0]
  monkeypatch.setattr(progress.time, 'time', lambda: clock_time[0])
  record = progress.Progress()
  clock = progress.TrainClock(first_step=0, progress=record, started=996.0, command_started=990.0)
  clock_time[0] += 2.0
  with caplog.at_level('INFO'):
    clock.step_done(step_metrics=None, wait=False)
  assert record.time_to_first_step_s == pytest.approx(12.0)
  assert 'first step done 12.0 s after the command (6.0 s after training started' in caplog.text
  # A resumed attempt logs its own start-up; the record keeps the first attempt's.
  clock_time[0] = time.time()
  resumed = progress.TrainClock(first_step=5, progress=record, started=clock_time[0] - 3.0,
                                command_started=clock_time[0] - 4.0)
  with caplog.at_level('INFO'):
    resumed.step_done(step_metrics=None, wait=False)
  assert 'first step done 4.0 s after the command (3.0 s after' in caplog.text
  assert record.time_to_first_step_s == pytest.approx(12.0)


# The CLI with pipeline.load watched: how often it runs, in which thread, and whether the trainer had
# been imported when it began; it sleeps 1 s, as a slow disk would, and says when it returns.
WATCHING_LOAD = '''
import json, os, runpy, sys, time
from flaxtpu.data import pipeline
loads = []
original = pipeline.load
def watched(config, *args, **kwargs):
  import threading
  began = {'thread': threading.current_thread().name, 'trainer_imported': 'flaxtpu.loop.train' in sys.modules}
  dataset = original(config, *args, **kwargs)
  time.sleep(1.0)
  loads.append(began)
  print('pipeline.load returned', file=sys.stderr, flush=True)
  return dataset
pipeline.load = watched
sys.argv[0] = 'flaxtpu.main'
try:
  runpy.run_module('flaxtpu.main', run_name='__main__')
finally:
  with open(os.environ['LOADS'], 'w') as f:
    json.dump(loads, f)
'''


def test_the_cli_reads_the_data_once_while_jax_and_the_trainer_import(tmp_path):
  env = cli_env()
  loads = tmp_path / 'loads.json'
  result = subprocess.run([sys.executable, '-c', WATCHING_LOAD, *SHORT_RUN, f'--workdir={tmp_path / "run"}',
                           f'--config.compilation_cache_dir={tmp_path / "cache"}'],
                          cwd=ROOT, env={**env, 'LOADS': str(loads)}, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  # Once: train_and_evaluate takes the CLI's dataset instead of reading it again. In a thread of its
  # own, begun before the trainer was imported (JAX imports and the devices start meanwhile), and read
  # before the main thread first asks for the devices (the line naming them).
  assert json.loads(loads.read_text()) == [
      {'thread': 'flaxtpu-data-read', 'trainer_imported': False}]
  lines = result.stderr.splitlines()
  returned = next(i for i, line in enumerate(lines) if 'pipeline.load returned' in line)
  named = next(i for i, line in enumerate(lines) if ' on platform=cpu' in line)
  assert returned < named
  # The compilation cache's entries are zstd frames (zstandard is a dependency; zlib was 8x slower to
  # write a large step).
  entries = [path for path in (tmp_path / 'cache').iterdir() if path.name.endswith('-cache')]
  assert len(entries) >= 3 and {path.read_bytes()[:4] for path in entries} == {b'\x28\xb5\x2f\xfd'}


def test_waiting_for_a_batch_while_the_last_step_runs_counts_as_the_step(monkeypatch):
  # With asynchronous dispatch the loop asks for the next batch while the chip runs the step before:
  # a wait that ends before that step does is the chip's time, not the input's (a TPU host's steady
  # laps showed "input 13%" at 98% of the device-resident step rate before).
  clock = progress.TrainClock(first_step=0, progress=progress.Progress())
  step_done = [False]
  monkeypatch.setattr(progress, '_ready', lambda outputs: step_done[0])
  with clock.timing('input', in_flight={'loss': 'running'}):
    time.sleep(0.2)
  step_done[0] = True
  with clock.timing('input', in_flight={'loss': 'done'}):
    time.sleep(0.1)
  with clock.timing('input'):  # the first batch: nothing in flight
    time.sleep(0.1)
  assert clock._split['step'] >= 0.2 and 0.2 <= clock._split['input'] < 0.3, clock._split
  # Real outputs: ready once computed.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  monkeypatch.undo()
  assert progress._ready({'loss': jnp.ones(3).block_until_ready(), 'count': 3})


# Each config's programs, lowered at small shapes without compiling (the state abstract: its shapes and
# shardings, nothing initialised): their StableHLO hashed (no debug info, as the persistent cache's key
# leaves it out).
LOWER_EVERY_CONFIG = '''
import hashlib, importlib, json, pathlib, sys
import jax
import numpy as np
from flaxtpu.settings.lengths import run_length
from flaxtpu.step import parallel, placing, steps
hashes = {}
for path in sorted(pathlib.Path('configs').glob('[!_]*.py')):
  config = importlib.import_module(f'configs.{path.stem}').get_config()
  config.batch_size = config.eval_batch_size = 8
  size = config.dataset.image_size or 32
  shape = (size, size, 3)
  task = steps.create_task(config, num_classes=10, image_shape=shape, mean=np.full(3, 0.5, np.float32),
                           std=np.full(3, 0.25, np.float32), length=run_length(config, 1000))
  placement = placing.place(task, parallel.make_mesh(config), config)
  state = placement.abstract_state
  images, labels = np.zeros((8, *shape), np.uint8), np.zeros((8,), np.int32)
  train = placement.train_step.lower(state, placement.put_train_batch((images, labels)))
  evaluate = placement.eval_step.lower(state, placement.put_eval_batch((images, labels, np.ones(8, bool))))
  init = jax.jit(lambda seed: steps.init_state(task, seed), static_argnums=0).lower(config.seed)
  hashes[path.stem] = [hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()
                       for lowered in (train, evaluate, init)]
print(json.dumps(hashes))
'''


def test_every_config_lowers_to_the_same_programs_in_every_process():
  # A program built in an order that follows a set of strings changes with each process's hashing
  # (PYTHONHASHSEED), and the persistent cache then misses in every other run: cifar10_fast.py's train
  # step did (its learning-rate groups), recompiling for 18 s in a warm run on a TPU v5e.
  env = cli_env()
  # The three processes at once: each is one Python thread tracing.
  processes = [subprocess.Popen([sys.executable, '-c', LOWER_EVERY_CONFIG], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**env, 'PYTHONHASHSEED': seed, 'JAX_PLATFORMS': 'cpu'})
               for seed in ('1', '2', '3')]
  hashes = []
  for process in processes:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    hashes.append(json.loads(stdout.strip().splitlines()[-1]))
  assert len(hashes[0]) >= 8, hashes[0]  # every config in configs/
  assert hashes[0] == hashes[1] == hashes[2], [
      name for name in hashes[0] if not hashes[0][name] == hashes[1][name] == hashes[2][name]]
