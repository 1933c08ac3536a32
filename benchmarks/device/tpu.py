"""On-chip benchmark: flaxtpu beside tf.data and the Flax ImageNet example on one TPU host, in one run.

    python -m benchmarks.device.tpu --cifar /data/cifar10                # every row, ~8 min on a TPU v5e host
    python -m benchmarks.device.tpu --cifar /data/cifar10 --photos /data/photos --write-docs
    python -m benchmarks.device.tpu --cifar /data/cifar10 --only step,decode --quick

Each row sets a flaxtpu contestant beside its peer, measured in the same run
on the same host, in interleaved rounds whose order alternates (medians
reported):

  a. `step`: the device-resident train step, ResNet-50, bfloat16, batch 256
     at 224 px on one random batch that stays on the chip: the step the CLI
     compiles (`compile_plan.compile_on_zeros` on configs/imagenet_resnet50.py)
     against the Flax ImageNet example's ResNet-50 and SGD step
     (benchmarks/peers/flax_imagenet_resnet.py), both in one process. img/s and
     MFU: XLA's cost analysis of each compiled step over the chip's bf16 peak.
  b. `e2e`: end to end from a JPEG folder (`--photos`, DIR/train/<class>/*.jpg;
     generated at ImageNet-like 375-500 px when not given): the CLI on
     configs/imagenet_resnet50.py with dataset.cache=none, its steady img/s
     and input share from metrics.jsonl, against row a's device-resident
     rate (goal >= 0.95) and against tf.data (the classic TPU ResNet-50 input,
     `input_pipeline.tf_batches`) feeding the plain Flax step.
  c. `input`: the input pipeline alone on the same folder:
     `benchmarks.input.input_pipeline --folder`, flaxtpu against tf.data.
  d. `decode`: the CIFAR-10 JPEG folder (`--cifar`) decoded into memory:
     `pipeline.load` with dataset.cache=memory (no disk cache, then a warm
     decoded-array disk cache where the config has the key
     DECODED_CACHE_KEY) against tf.data's list_files -> read_file ->
     decode_jpeg -> batch into one uint8 array; the two arrays are compared
     pixel for pixel.
  e. `startup`: time to the first step of configs/cifar10.py on that folder
     with an empty compilation cache and a fresh workdir (cold), then with
     the same cache and a new workdir (warm); the decoded-array disk cache
     (where the config has it) starts empty too. Then the whole-run wall
     time and accuracy of configs/cifar10_fast.py with an empty compilation
     cache (cold: it fills it) and again (warm).

The Flax example's step runs on one chip; flaxtpu's uses every chip of the host, so on a host of
several chips compare per chip (the JSON has device_count). A TPU v5e host of one chip, which this
was written for, needs no such care.

Every row runs in its own process with a timeout (`--timeout-scale` stretches them all), so a
row that fails or hangs costs only its row; the JSON (`--out`) is written after every row and
holds what a stopped row had measured. Only one process at a time may hold the chip: the rows
run one after another, and those that need no chip (c, d) run with JAX_PLATFORMS=cpu.
Without a TPU the device rows (a, b, e) are skipped with the reason (`--any-platform` runs them
anyway, slowly, to check the script); c and d run on whatever data is given. `--write-docs`
replaces the "## On a TPU host" section at the end of docs/performance.md with the table
(`--from-json FILE` renders an earlier run's JSON without measuring).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from benchmarks.shared import harness

# The decoded-array disk cache's config key ('none' = off). Read defensively: a flaxtpu without the
# key gets the warm-cache measurements skipped with the reason.
DECODED_CACHE_KEY = 'dataset.decoded_cache_dir'
DECODED_CACHE_OFF = 'none'

# Peak dense bf16 FLOP/s per chip, by jax's device_kind (Google Cloud's TPU pages).
PEAK_BF16_FLOPS = {
    'TPU v2': 45e12, 'TPU v3': 123e12, 'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5e': 197e12,
    'TPU v5': 459e12, 'TPU v5p': 459e12, 'TPU v6 lite': 918e12, 'TPU v6e': 918e12,
}
# HBM bandwidth per chip, bytes/s (the same pages).
HBM_BYTES_PER_SEC = {
    'TPU v2': 700e9, 'TPU v3': 900e9, 'TPU v4': 1228e9, 'TPU v5 lite': 819e9, 'TPU v5e': 819e9,
    'TPU v5': 2765e9, 'TPU v5p': 2765e9, 'TPU v6 lite': 1640e9, 'TPU v6e': 1640e9,
}

ROWS = ('step', 'e2e', 'input', 'decode', 'startup')
LETTERS = dict(zip('abcde', ROWS))
DEVICE_ROWS = ('step', 'e2e', 'startup')
TITLES = {
    'step': 'a. device-resident train step',
    'e2e': 'b. end to end from a JPEG folder',
    'input': 'c. input pipeline alone',
    'decode': 'd. in-memory decode of CIFAR-10',
    'startup': 'e. time to first step',
}
DOCS = harness.ROOT / 'docs' / 'performance.md'
DOCS_HEADING = '## On a TPU host'


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What each row measures; `--quick` shrinks everything (a smoke run, in CI on CPU)."""
  batch: int = 256
  image_size: int = 224
  rounds: int = 3  # interleaved rounds of rows a, c, d
  step_steps: int = 30  # timed steps per contestant and round (a)
  e2e_rounds: int = 1  # each contestant in its own process per round (b)
  e2e_steps: int = 160
  e2e_log_every: int = 10
  e2e_skip_laps: int = 3  # the first laps hold the start-up: worker spawn, prefetch filling
  photos_classes: int = 100
  photos_per_class: int = 64
  photos_test_per_class: int = 2
  photos_sides: tuple = (375, 500)
  input_seconds: float = 3.0
  # Further benchmarks.input.input_pipeline flags: a shorter warm-up and GIL probe than its own defaults.
  input_extra: tuple = ('--warmup', '24', '--gil-batches', '4')
  fast_overrides: tuple = ()  # further flags for the cifar10_fast runs
  timeouts: tuple = (('probe', 180), ('photos', 300), ('step', 420), ('e2e', 480), ('input', 240),
                     ('decode', 300), ('startup', 540))


QUICK = Sizes(batch=16, image_size=64, rounds=1, step_steps=3, e2e_steps=12, e2e_log_every=3, e2e_skip_laps=1,
              photos_classes=2, photos_per_class=24, photos_test_per_class=2, photos_sides=(96, 160),
              input_seconds=0.5,
              input_extra=('--workers', '2', '--warmup', '2', '--max-batches', '4', '--gil-batches', '2'),
              fast_overrides=('--config.num_epochs=1', '--config.batch_size=64'),
              timeouts=(('probe', 120), ('photos', 120), ('step', 600), ('e2e', 600), ('input', 120),
                        ('decode', 120), ('startup', 600)))


def say(message: str) -> None:
  print(message, flush=True)


def median(values) -> Optional[float]:
  values = [v for v in values if v is not None]
  return harness.median(values) if values else None


def write_json(path: pathlib.Path, payload) -> None:
  """Atomically: a row killed mid-write leaves the previous version."""
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(path.name + '.partial')
  partial.write_text(json.dumps(payload, indent=2) + '\n', encoding='utf-8')
  os.replace(partial, path)


def fresh_dir(path: pathlib.Path) -> pathlib.Path:
  """`path` emptied (it is the benchmark's own scratch folder) and made."""
  shutil.rmtree(path, ignore_errors=True)
  path.mkdir(parents=True)
  return path


def chip_env() -> dict:
  """For a process that may hold the accelerator: JAX picks it (JAX_PLATFORMS as the caller set it)."""
  env = harness.subprocess_env()
  env.update(PYTHONUNBUFFERED='1', TF_CPP_MIN_LOG_LEVEL='2', CUDA_VISIBLE_DEVICES='')
  return env


def cpu_env() -> dict:
  """For a process that must leave the chip alone (only one process may hold it)."""
  return {**chip_env(), 'JAX_PLATFORMS': 'cpu'}


def decoded_cache_key_present() -> bool:
  """Whether this flaxtpu's config has DECODED_CACHE_KEY (defaults.py imports no JAX)."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  node = defaults.get_config()
  for part in DECODED_CACHE_KEY.split('.'):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      return False
  return True


# --- running things ------------------------------------------------------------------------------------


def descendants(pid: int) -> list:
  """The processes `pid` started, and theirs (psutil where installed; else none: the group signal only)."""
  try:
    import psutil  # pylint: disable=g-import-not-at-top
    return psutil.Process(pid).children(recursive=True)
  except Exception:  # pylint: disable=broad-except  # no psutil, or the process is gone
    return []


def stop_tree(process: subprocess.Popen) -> None:
  """Ends `process` and everything it started: its process group, and the descendants that run in
  sessions of their own (a row's CLI runs, their input workers), listed before any of them ends.
  SIGTERM first (the CLI saves and stops), SIGKILL for what is left after a grace."""
  family = descendants(process.pid)
  for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(process.pid, sig)
    for member in family:
      with contextlib.suppress(Exception):
        member.send_signal(sig)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
      process.wait(grace)
    family = [member for member in family if _alive(member, deadline)]
    if process.poll() is not None and not family:
      return


def _alive(member, deadline: float) -> bool:
  with contextlib.suppress(Exception):
    member.wait(max(0.0, deadline - time.monotonic()))
    return False
  with contextlib.suppress(Exception):
    return member.is_running()
  return False


def run_process(command: list[str], *, env: dict, timeout: float, log: Optional[pathlib.Path] = None) -> int:
  """Runs `command` from the repo root in its own session; its output goes to `log` (else ours).
  Returns its exit status; TimeoutError (after stopping it and its children) past `timeout`."""
  with open(log, 'w', encoding='utf-8') if log else contextlib.nullcontext() as sink:
    process = subprocess.Popen(command, cwd=harness.ROOT, env=env, start_new_session=True,
                               stdout=sink, stderr=subprocess.STDOUT if sink else None)
    try:
      return process.wait(timeout)
    except subprocess.TimeoutExpired:
      stop_tree(process)
      raise TimeoutError(f'{" ".join(command[:4])} ... ran past {timeout:.0f} s and was stopped') from None
    except BaseException:  # Ctrl-C: leave no chip holder behind
      stop_tree(process)
      raise


def tail(log: pathlib.Path, lines: int = 15) -> str:
  with contextlib.suppress(OSError):
    return '\n'.join(log.read_text(encoding='utf-8', errors='replace').splitlines()[-lines:])
  return ''


def last_error_line(log: pathlib.Path) -> str:
  """The line that says what went wrong: flaxtpu's `error:` line, else the last non-empty one."""
  lines = [line.strip() for line in tail(log, 200).splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith('error:') or 'Error' in line.split(':')[0]]
  return (errors or lines or ['no output'])[-1][:400]


def run_cli(config: str, workdir: pathlib.Path, overrides: list[str], *, env: dict, timeout: float) -> dict:
  """One `python -m flaxtpu.main` run in a fresh `workdir`: results.json, the metrics.jsonl rows
  and the process's wall time (what benchmarks/device/startup.py's run_once reads, with any overrides)."""
  fresh_dir(workdir)
  log = workdir.parent / f'{workdir.name}.log'  # beside the workdir: the CLI owns what is inside
  command = [sys.executable, '-m', 'flaxtpu.main', f'--config={config}', f'--workdir={workdir}', *overrides]
  started = time.perf_counter()
  status = run_process(command, env=env, timeout=timeout, log=log)
  wall = time.perf_counter() - started
  if status:
    print(tail(log), flush=True)
    raise RuntimeError(f'flaxtpu.main {config} exited {status}: {last_error_line(log)} (log: {log})')
  results = json.loads((workdir / 'results.json').read_text(encoding='utf-8'))
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text(encoding='utf-8').splitlines()
          if line.strip()]
  return {'results': results, 'metrics': rows, 'process_wall_s': wall, 'log': str(log)}


# The CLI's start-up line: when (after the command) the trainer was imported, the devices were ready and
# the data was read; the first step waited for the last of them.
STARTUP_PARTS = ('trainer_imported_s', 'devices_ready_s', 'data_read_s')
STARTUP_LINE = re.compile(r'trainer imported ([\d.]+) s, devices ready ([\d.]+) s(?:, data read ([\d.]+) s)?')


def startup_parts(log: str) -> dict:
  """{'trainer_imported_s', 'devices_ready_s', 'data_read_s'} from a CLI run's log (those it says)."""
  try:
    found = STARTUP_LINE.search(pathlib.Path(log).read_text(encoding='utf-8', errors='replace'))
  except OSError:
    return {}
  if not found:
    return {}
  return {name: float(value) for name, value in zip(STARTUP_PARTS, found.groups()) if value is not None}


def chip_pause() -> None:
  """A program that opens the chip just after another let go of it can be refused: a moment between."""
  time.sleep(3)


# --- row a: the device-resident train step ------------------------------------------------------------


def device_facts() -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  kind = getattr(device, 'device_kind', '') or device.platform
  return {'platform': device.platform, 'device_kind': kind, 'device_count': jax.device_count(),
          'jax_version': jax.__version__, 'peak_bf16_flops': PEAK_BF16_FLOPS.get(kind)}


def use_compilation_cache(cache_dir: pathlib.Path) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_compilation_cache_dir', str(cache_dir))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)


def imagenet_config(sizes: Sizes):
  """configs/imagenet_resnet50.py at the benchmark's batch: the recipe the CLI trains ResNet-50 with."""
  from configs import imagenet_resnet50  # pylint: disable=g-import-not-at-top
  config = imagenet_resnet50.get_config()
  config.batch_size = config.eval_batch_size = sizes.batch
  config.dataset.image_size = sizes.image_size
  config.optimizer.learning_rate = 0.1 * sizes.batch / 256
  return config


def row_step(args, sizes: Sizes, report: Callable[[dict], None]) -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import compile_plan  # pylint: disable=g-import-not-at-top

  use_compilation_cache(args.workdir / 'jax_cache')
  facts = device_facts()
  row = {**facts, 'model': 'resnet50', 'dtype': 'bfloat16', 'batch': sizes.batch,
         'image_size': sizes.image_size, 'steps_per_round': sizes.step_steps}
  say(f'  device: {facts["device_kind"]} x{facts["device_count"]} ({facts["platform"]}), '
      f'batch {sizes.batch} at {sizes.image_size} px, bfloat16')
  images, labels = flax_imagenet_resnet.random_batch(sizes.batch, sizes.image_size)

  def timed(build):
    started = time.perf_counter()
    return build(), time.perf_counter() - started

  # Both steps compile at once (XLA compiles outside the GIL): a cold cache costs one wait, not two.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    plain = pool.submit(timed, lambda: flax_imagenet_resnet.build(sizes.batch, sizes.image_size))
    (placement, flax_state, _, flax_step, plan), flax_seconds = timed(lambda: compile_plan.compile_on_zeros(
        imagenet_config(sizes), image_shape=(sizes.image_size, sizes.image_size, 3), num_classes=1000))
    say(f'  flaxtpu step compiled in {flax_seconds:.1f} s')
    (plain_state, plain_step, plain_flops), plain_seconds = plain.result()
    say(f'  Flax example step compiled in {plain_seconds:.1f} s (at the same time)')
  flaxtpu_batch = placement.put_train_batch((images, labels))
  plain_batch = jax.device_put(images), jax.device_put(labels)
  contestants = {
      'flaxtpu': {'call': lambda state: flax_step(state, flaxtpu_batch), 'state': flax_state,
                  'compile_seconds': flax_seconds, 'memory_plan': plan,
                  'flops_per_step': flax_imagenet_resnet.flops_of(flax_step)
                  if hasattr(flax_step, 'cost_analysis') else 0.0},
      'flax_example': {'call': lambda state: plain_step(state, *plain_batch), 'state': plain_state,
                       'compile_seconds': plain_seconds, 'flops_per_step': plain_flops}}

  def rate(entry) -> float:
    state = entry['state']
    for _ in range(2):  # the first runs after a compile allocate
      state, metrics = entry['call'](state)
      jax.block_until_ready(metrics)
    started = time.perf_counter()
    for _ in range(sizes.step_steps):  # dispatched back to back, as the CLI does on an accelerator
      state, metrics = entry['call'](state)
    jax.block_until_ready((state, metrics))
    entry['state'] = state
    return sizes.step_steps * sizes.batch / (time.perf_counter() - started)

  rates = {name: [] for name in contestants}
  for round_index in range(sizes.rounds):
    order = list(contestants) if round_index % 2 == 0 else list(contestants)[::-1]
    for name in order:
      rates[name].append(rate(contestants[name]))
      say(f'  round {round_index + 1}/{sizes.rounds} {name:13s} {rates[name][-1]:9,.0f} img/s')
    row.update(summarise_step(contestants, rates, sizes, facts['peak_bf16_flops']))
    report(row)
  return row


def summarise_step(contestants: dict, rates: dict, sizes: Sizes, peak: Optional[float]) -> dict:
  row = {}
  for name, entry in contestants.items():
    images_per_sec = median(rates[name])
    flops = entry['flops_per_step']
    row[name] = {'images_per_sec': images_per_sec, 'rounds': rates[name],
                 'compile_seconds': entry['compile_seconds'], 'flops_per_step': flops,
                 'flops_per_image': flops / sizes.batch,
                 'tflops_per_sec': flops * images_per_sec / sizes.batch / 1e12,
                 'mfu': flops * images_per_sec / sizes.batch / peak if peak and flops else None,
                 **({'memory_plan': entry['memory_plan']} if 'memory_plan' in entry else {})}
  row['ratio'] = row['flaxtpu']['images_per_sec'] / row['flax_example']['images_per_sec']
  return row


# --- row b: end to end from a JPEG folder -------------------------------------------------------------


def train_files(folder: str) -> tuple[list[str], list[int]]:
  """DIR/train/<class>/<image>: paths and class indices, classes in name order."""
  root = pathlib.Path(folder) / 'train'
  classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
  paths, labels = [], []
  for label, name in enumerate(classes):
    for path in sorted((root / name).iterdir()):
      if path.suffix.lower() in ('.jpg', '.jpeg'):
        paths.append(str(path))
        labels.append(label)
  return paths, labels


def steady(laps: list[dict], skip: int) -> dict:
  """Median images/s and input share of the laps after the first `skip` (start-up)."""
  kept = laps[skip:] or laps[-1:]
  return {'images_per_sec': median(lap['images_per_sec'] for lap in kept),
          'input_share': median(lap.get('input_wait_fraction') for lap in kept),
          'laps': len(kept)}


def flaxtpu_e2e(args, sizes: Sizes, workdir: pathlib.Path, timeout: float) -> dict:
  run = run_cli('configs/imagenet_resnet50.py', workdir, [
      f'--config.dataset.folder={args.photos}', '--config.dataset.cache=none',
      '--config.dataset.train_split=train', '--config.dataset.eval_split=test',
      f'--config.dataset.image_size={sizes.image_size}', '--config.dtype=bfloat16',
      f'--config.batch_size={sizes.batch}', f'--config.eval_batch_size={sizes.batch}',
      f'--config.optimizer.learning_rate={0.1 * sizes.batch / 256}',
      f'--config.num_train_steps={sizes.e2e_steps}', f'--config.log_every_steps={sizes.e2e_log_every}',
      # Evaluated and saved at the end only, as an ImageNet epoch (5,004 steps) would be: with an epoch
      # of 25 steps the recipe's per-epoch evaluation and checkpoint held a third of some laps (2026-12-05).
      f'--config.eval_every_steps={sizes.e2e_steps}', f'--config.checkpoint_every_steps={sizes.e2e_steps}',
      f'--config.compilation_cache_dir={args.workdir / "jax_cache"}'], env=chip_env(), timeout=timeout)
  laps = [row for row in run['metrics'] if 'images_per_sec' in row]
  return {**steady(laps, sizes.e2e_skip_laps), 'laps_images_per_sec': [lap['images_per_sec'] for lap in laps],
          'train_images_per_sec': run['results'].get('train_images_per_sec'),
          'time_to_first_step_s': run['results'].get('time_to_first_step_s'),
          'process_wall_s': run['process_wall_s']}


def tf_e2e_worker(args, sizes: Sizes) -> dict:
  """tf.data's TPU ResNet-50 input feeding the plain Flax step, timed in laps as train.py times its own."""
  import collections  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], 'GPU')  # TensorFlow must never take accelerator memory
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks.input import input_pipeline  # pylint: disable=g-import-not-at-top
  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top

  use_compilation_cache(args.workdir / 'jax_cache')  # row a's program: loaded, not compiled again
  config = imagenet_config(sizes)
  paths, labels = train_files(args.photos)
  needed = (sizes.e2e_steps + 1) * sizes.batch
  rng = np.random.default_rng(0)
  order = np.concatenate([rng.permutation(len(paths)) for _ in range(-(-needed // len(paths)))])[:needed]
  batches = input_pipeline.tf_batches(tf, [paths[i] for i in order], [labels[i] for i in order], sizes.batch,
                                      sizes.image_size, tuple(config.augment.crop_area),
                                      tuple(config.augment.crop_aspect))
  started = time.time()
  state, step, _ = flax_imagenet_resnet.build(sizes.batch, sizes.image_size)
  queue = collections.deque()  # two batches on their way to the chip, as the example's prefetch_to_device

  def next_batch():
    while len(queue) < 2:
      images, batch_labels = next(batches)
      queue.append((jax.device_put(images), jax.device_put(batch_labels.astype(np.int32))))
    return queue.popleft()

  laps, waited = [], 0.0
  state, metrics = step(state, *next_batch())
  jax.block_until_ready(metrics)
  first_step = time.time() - started
  lap_start = time.perf_counter()
  for index in range(1, sizes.e2e_steps):
    fetch = time.perf_counter()
    batch = next_batch()
    waited += time.perf_counter() - fetch
    state, metrics = step(state, *batch)
    if index % sizes.e2e_log_every == 0 or index == sizes.e2e_steps - 1:
      jax.block_until_ready(metrics)
      seconds, lap_steps = time.perf_counter() - lap_start, index - (laps[-1]['step'] if laps else 0)
      laps.append({'step': index, 'images_per_sec': lap_steps * sizes.batch / seconds,
                   'input_wait_fraction': waited / seconds})
      lap_start, waited = time.perf_counter(), 0.0
  return {**steady(laps, sizes.e2e_skip_laps), 'laps_images_per_sec': [lap['images_per_sec'] for lap in laps],
          'build_and_first_step_s': first_step}


def tf_e2e(args, sizes: Sizes, timeout: float) -> dict:
  out = args.workdir / 'e2e' / 'tf_data.json'
  out.unlink(missing_ok=True)
  log = args.workdir / 'e2e' / 'tf_data.log'
  command = [sys.executable, '-m', 'benchmarks.device.tpu', '--worker', 'tf_e2e', '--row-out', str(out),
             *common_flags(args)]
  status = run_process(command, env=chip_env(), timeout=timeout, log=log)
  if status or not out.exists():
    print(tail(log), flush=True)
    raise RuntimeError(f'tf.data + Flax step exited {status}: {last_error_line(log)} (log: {log})')
  return json.loads(out.read_text(encoding='utf-8'))


def row_e2e(args, sizes: Sizes, report: Callable[[dict], None]) -> dict:
  from benchmarks.input import input_pipeline  # pylint: disable=g-import-not-at-top
  paths, _ = train_files(args.photos)
  started = time.perf_counter()
  size = input_pipeline.read_files(paths)  # both contestants find the files in the page cache
  say(f'  {args.photos}: {len(paths):,} train JPEGs ({size / 2**20:,.0f} MiB) read once into the page '
      f'cache in {time.perf_counter() - started:.1f} s; {sizes.e2e_steps} steps of {sizes.batch} at '
      f'{sizes.image_size} px per run')
  timeout = args.timeout_scale * dict(sizes.timeouts)['e2e'] / 2 / sizes.e2e_rounds
  row = {'photos': args.photos, 'train_images': len(paths), 'batch': sizes.batch,
         'image_size': sizes.image_size, 'steps': sizes.e2e_steps, 'log_every_steps': sizes.e2e_log_every,
         'skipped_laps': sizes.e2e_skip_laps, 'flaxtpu': [], 'tf_data': [],
         'device_resident_images_per_sec': args.step_rate}
  runners = {'flaxtpu': lambda r: flaxtpu_e2e(args, sizes, args.workdir / 'e2e' / f'flaxtpu_{r}', timeout),
             'tf_data': lambda r: tf_e2e(args, sizes, timeout)}
  for round_index in range(sizes.e2e_rounds):
    for name in (list(runners) if round_index % 2 == 0 else list(runners)[::-1]):
      chip_pause()
      row[name].append(runners[name](round_index))
      measured = row[name][-1]
      say(f'  round {round_index + 1}/{sizes.e2e_rounds} {name:8s} {measured["images_per_sec"]:9,.0f} img/s '
          f'steady, input share {100 * (measured["input_share"] or 0):.0f}% '
          f'(laps: {", ".join(f"{v:,.0f}" for v in measured["laps_images_per_sec"])})')
      report(row)
  for name in runners:
    row[f'{name}_images_per_sec'] = median(r['images_per_sec'] for r in row[name])
    row[f'{name}_input_share'] = median(r['input_share'] for r in row[name])
  row['ratio_over_tf_data'] = row['flaxtpu_images_per_sec'] / row['tf_data_images_per_sec']
  if args.step_rate:
    row['ratio_over_device_resident'] = row['flaxtpu_images_per_sec'] / args.step_rate
  return row


# --- row c: the input pipeline alone --------------------------------------------------------------------


def row_input(args, sizes: Sizes, report: Callable[[dict], None]) -> dict:
  del report  # one child process: its JSON is the row
  out = args.workdir / 'input_pipeline.json'
  out.unlink(missing_ok=True)
  command = [sys.executable, '-m', 'benchmarks.input.input_pipeline', '--folder', args.photos,
             '--image-size', str(sizes.image_size), '--batch-size', str(sizes.batch),
             '--seconds', str(sizes.input_seconds), '--rounds', str(sizes.rounds), '--out', str(out),
             *sizes.input_extra]
  say(f'  {shlex.join(command[1:])}')
  status = run_process(command, env=cpu_env(), timeout=args.timeout_scale * dict(sizes.timeouts)['input'])
  if status:
    raise RuntimeError(f'benchmarks.input.input_pipeline exited {status}')
  measured = json.loads(out.read_text(encoding='utf-8'))
  row = {'photos': args.photos, 'image_size': sizes.image_size, 'batch': sizes.batch,
         'workers': measured['workers'], 'cpu_count': measured['cpu_count'], 'rounds': measured['rounds'],
         'train_images': measured['train_images'], 'json': str(out)}
  for name in ('flaxtpu', 'flaxtpu_threads', 'tf_data'):
    row[f'{name}_images_per_sec'] = measured[name]['images_per_sec']
    row[f'{name}_cpu_ms_per_image'] = 1e3 * measured[name]['cpu_seconds_per_image']
    row[f'{name}_other_cpu_load'] = measured[name]['other_cpu_load']
  row['ratio_over_tf_data'] = measured['ratio_flaxtpu_over_tf_data']
  row['threads_ratio_over_tf_data'] = measured['ratio_flaxtpu_threads_over_tf_data']
  return row


# --- row d: decoding CIFAR-10 into memory ---------------------------------------------------------------


def cifar_config(folder: str, decoded_cache: Optional[str]):
  """configs/cifar10.py on the folder, decoded into memory; the eval split one image, so the train
  split's 50,000 are what is timed."""
  from configs import cifar10  # pylint: disable=g-import-not-at-top
  config = cifar10.get_config()
  config.dataset.folder, config.dataset.cache = folder, 'memory'
  config.dataset.eval_split = 'train[:1]'
  if decoded_cache is not None:
    section, key = DECODED_CACHE_KEY.rsplit('.', 1)
    config[section][key] = decoded_cache
  return config


def flaxtpu_decode(folder: str, decoded_cache: Optional[str]):
  """Seconds of `pipeline.load` (listing, header checks, decode in worker processes) and its array."""
  from flaxtpu.data import pipeline  # pylint: disable=g-import-not-at-top
  config = cifar_config(folder, decoded_cache)
  started = time.perf_counter()
  dataset = pipeline.load(config)
  seconds = time.perf_counter() - started
  return seconds, dataset.train.images


def flaxtpu_paths(folder: str) -> list[str]:
  """The files of the train split in the order flaxtpu's array holds them."""
  from flaxtpu.data import sources  # pylint: disable=g-import-not-at-top
  from flaxtpu.data.spec import DatasetSpec  # pylint: disable=g-import-not-at-top
  spec = DatasetSpec.of(cifar_config(folder, None))
  split, _, _ = sources.get(spec).splits(spec.train_split, spec.eval_split, None)
  return [os.path.abspath(split.load(index)[0]) for index in range(len(split))]


def tf_decode(tf, folder: str, batch_size: int = 1024):
  """tf.data: list_files -> read_file -> decode_jpeg (map AUTOTUNE) -> batch -> one uint8 array.
  INTEGER_ACCURATE: libjpeg-turbo's islow IDCT, Pillow's default (TensorFlow's own is the faster,
  less exact ifast), so both decode the same pixels the same way."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  started = time.perf_counter()
  root = os.path.join(os.path.abspath(folder), 'train')
  patterns = [os.path.join(root, '*', f'*.{ext}') for ext in ('jpg', 'jpeg', 'JPG', 'JPEG')]
  files = tf.data.Dataset.list_files(patterns, shuffle=False)

  def decode(path):
    return path, tf.io.decode_jpeg(tf.io.read_file(path), channels=3, dct_method='INTEGER_ACCURATE')

  dataset = files.map(decode, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size)
  dataset = dataset.prefetch(tf.data.AUTOTUNE)
  paths, chunks = [], []
  for batch_paths, images in dataset.as_numpy_iterator():
    paths.extend(os.fsdecode(path) for path in batch_paths)
    chunks.append(images)
  images = np.concatenate(chunks)
  return time.perf_counter() - started, paths, images


def compare(flaxtpu_images, flaxtpu_order: list[str], tf_images, tf_order: list[str]) -> dict:
  """Pixel-for-pixel: tf.data's array put in flaxtpu's file order, then the differences."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  where = {path: index for index, path in enumerate(tf_order)}
  missing = [path for path in flaxtpu_order if path not in where]
  if missing or len(tf_order) != len(flaxtpu_order):
    return {'same_files': False, 'only_flaxtpu': len(missing),
            'only_tf_data': len(set(tf_order) - set(flaxtpu_order))}
  reordered = tf_images[[where[path] for path in flaxtpu_order]]
  difference = np.abs(flaxtpu_images.astype(np.int16) - reordered.astype(np.int16))
  return {'same_files': True, 'shape_equal': flaxtpu_images.shape == reordered.shape,
          'pixels_equal': bool(np.array_equal(flaxtpu_images, reordered)),
          'max_abs_difference': int(difference.max()) if difference.size else 0,
          'differing_values': int(np.count_nonzero(difference))}


def row_decode(args, sizes: Sizes, report: Callable[[dict], None]) -> dict:
  import logging  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], 'GPU')
  # The one-image eval split's warning (its classes are missing) says nothing about the decode.
  logging.getLogger().setLevel(logging.ERROR)

  files_listed = len(flaxtpu_paths(args.cifar))
  with_key = decoded_cache_key_present()
  off = DECODED_CACHE_OFF if with_key else None
  row = {'cifar': args.cifar, 'files': files_listed, 'cpu_count': os.cpu_count(), 'rounds': sizes.rounds,
         'decoded_cache_key': DECODED_CACHE_KEY, 'flaxtpu_seconds': [], 'tf_data_seconds': []}
  say(f'  {args.cifar}: {files_listed:,} train JPEGs; {os.cpu_count()} cores')
  arrays = {}
  for round_index in range(sizes.rounds):
    order = ('flaxtpu', 'tf_data') if round_index % 2 == 0 else ('tf_data', 'flaxtpu')
    for name in order:
      if name == 'flaxtpu':
        seconds, images = flaxtpu_decode(args.cifar, off)
        arrays.setdefault('flaxtpu', images)
      else:
        seconds, paths, images = tf_decode(tf, args.cifar)
        arrays.setdefault('tf_data', (paths, images))
      row[f'{name}_seconds'].append(seconds)
      say(f'  round {round_index + 1}/{sizes.rounds} {name:8s} {seconds:7.2f} s  '
          f'{len(images) / seconds:9,.0f} img/s  ({len(images):,} images {images.shape[1:]})')
    report(row)
  row['flaxtpu_images'], row['tf_data_images'] = len(arrays['flaxtpu']), len(arrays['tf_data'][1])
  tf_paths, tf_images = arrays['tf_data']
  row.update(compare(arrays['flaxtpu'], flaxtpu_paths(args.cifar), tf_images, tf_paths))
  say(f'  arrays: flaxtpu {arrays["flaxtpu"].shape}, tf.data {arrays["tf_data"][1].shape}; pixels equal: '
      f'{row.get("pixels_equal")}, max |difference| {row.get("max_abs_difference")}')
  for name in ('flaxtpu', 'tf_data'):
    row[f'{name}_median_seconds'] = median(row[f'{name}_seconds'])
    row[f'{name}_images_per_sec'] = row[f'{name}_images'] / row[f'{name}_median_seconds']
  row['ratio_over_tf_data'] = row['tf_data_median_seconds'] / row['flaxtpu_median_seconds']
  report(row)

  if not with_key:
    row['disk_cache_skipped'] = f'this flaxtpu has no config key {DECODED_CACHE_KEY}'
    say(f'  warm disk cache: skipped ({row["disk_cache_skipped"]})')
    return row
  cache_dir = fresh_dir(args.workdir / 'decoded_cache')
  row['disk_cache_fill_seconds'], filled = flaxtpu_decode(args.cifar, str(cache_dir))
  say(f'  flaxtpu filling the disk cache {row["disk_cache_fill_seconds"]:7.2f} s')
  row['disk_cache_warm_seconds'] = []
  for round_index in range(sizes.rounds):
    seconds, warm = flaxtpu_decode(args.cifar, str(cache_dir))
    row['disk_cache_warm_seconds'].append(seconds)
    say(f'  round {round_index + 1}/{sizes.rounds} flaxtpu, warm disk cache {seconds:7.2f} s  '
        f'{len(warm) / seconds:9,.0f} img/s')
  row['disk_cache_warm_median_seconds'] = median(row['disk_cache_warm_seconds'])
  row['disk_cache_equal'] = bool(np.array_equal(filled, arrays['flaxtpu']) and np.array_equal(warm, filled))
  row['disk_cache_ratio_over_tf_data'] = row['tf_data_median_seconds'] / row['disk_cache_warm_median_seconds']
  return row


# --- row e: time to the first step, cold and warm -------------------------------------------------------


def row_startup(args, sizes: Sizes, report: Callable[[dict], None]) -> dict:
  root = fresh_dir(args.workdir / 'startup')
  timeout = args.timeout_scale * dict(sizes.timeouts)['startup'] / 3  # a run may take a third
  extra = [f'--config.{DECODED_CACHE_KEY}={root / "decoded_cache"}'] if decoded_cache_key_present() else []
  row = {'cifar': args.cifar, 'decoded_cache': bool(extra)}

  def first_step(name: str, cache: pathlib.Path) -> dict:
    # As benchmarks/device/startup.py's run_once: one step, the eval split at batch 1000.
    chip_pause()
    run = run_cli('configs/cifar10.py', root / name, [
        f'--config.dataset.folder={args.cifar}', '--config.num_train_steps=1',
        '--config.eval_batch_size=1000', f'--config.compilation_cache_dir={cache}', *extra],
        env=chip_env(), timeout=timeout)
    results = run['results']
    measured = {'time_to_first_step_s': results.get('time_to_first_step_s'),
                'compile_seconds': (results.get('memory_plan') or {}).get('compile_seconds'),
                'process_wall_s': run['process_wall_s'], **startup_parts(run['log'])}
    say(f'  cifar10.py {name:5s} first step after {measured["time_to_first_step_s"] or 0:6.1f} s (train-step '
        f'compile {measured["compile_seconds"] or 0:5.1f} s), process {measured["process_wall_s"]:6.1f} s; '
        + ', '.join(f'{part[:-2].replace("_", " ")} {measured[part]:.1f} s' for part in STARTUP_PARTS
                    if part in measured))
    return measured

  def whole_run(name: str, cache: pathlib.Path) -> dict:
    chip_pause()
    run = run_cli('configs/cifar10_fast.py', root / name, [
        f'--config.dataset.folder={args.cifar}', f'--config.compilation_cache_dir={cache}', *extra,
        *sizes.fast_overrides], env=chip_env(), timeout=timeout)
    results = run['results']
    measured = {'eval_accuracy': results.get('eval_accuracy'), 'wall_time_s': results.get('wall_time_s'),
                'time_to_first_step_s': results.get('time_to_first_step_s'),
                'train_images_per_sec': results.get('train_images_per_sec'), 'steps': results.get('step'),
                'process_wall_s': run['process_wall_s']}
    say(f'  cifar10_fast.py {name[5:]:4s} accuracy {100 * (measured["eval_accuracy"] or 0):.2f}% after '
        f'{measured["steps"]} steps, run wall {measured["wall_time_s"] or 0:.1f} s, process '
        f'{measured["process_wall_s"]:.1f} s (first step after '
        f'{measured["time_to_first_step_s"] or 0:.1f} s)')
    return measured

  cnn_cache, fast_cache = root / 'jax_cache_cifar10', root / 'jax_cache_fast'
  for name, measure in (('cold', lambda: first_step('cold', cnn_cache)),
                        ('warm', lambda: first_step('warm', cnn_cache)),
                        ('fast_cold', lambda: whole_run('fast_cold', fast_cache)),
                        ('fast_warm', lambda: whole_run('fast_warm', fast_cache))):
    row[name] = measure()
    report(row)
  return row


# --- the driver: one process per row -----------------------------------------------------------------


ROW_FUNCTIONS = {'step': row_step, 'e2e': row_e2e, 'input': row_input, 'decode': row_decode,
                 'startup': row_startup}


def common_flags(args) -> list[str]:
  """What a row's child process needs of this run's flags."""
  flags = ['--cifar', args.cifar or '', '--workdir', str(args.workdir),
           '--timeout-scale', str(args.timeout_scale)]
  if args.photos:
    flags += ['--photos', args.photos]
  if args.quick:
    flags.append('--quick')
  if args.step_rate:
    flags += ['--step-rate', str(args.step_rate)]
  return flags


def partial_row(args, name: str) -> dict:
  """What the row's process has reported so far (see `child`)."""
  try:
    return json.loads((args.workdir / f'row_{name}.json').read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return {}


def run_row(name: str, args, sizes: Sizes) -> dict:
  """The row in a child process (own session) with a timeout; whatever it reported survives a failure."""
  out = args.workdir / f'row_{name}.json'
  out.unlink(missing_ok=True)
  timeout = args.timeout_scale * dict(sizes.timeouts)[name]
  env = chip_env() if name in DEVICE_ROWS else cpu_env()
  command = [sys.executable, '-m', 'benchmarks.device.tpu', '--row', name, '--row-out', str(out),
             *common_flags(args)]
  started = time.perf_counter()
  error = None
  try:
    status = run_process(command, env=env, timeout=timeout)
    if status:
      error = f'exit status {status}'
  except TimeoutError:
    error = f'timed out after {timeout:.0f} s (the limit for this row)'
  row = partial_row(args, name)
  if error and 'error' not in row:
    row['error'] = error
  elif error:
    row['error'] = f'{row["error"]}; {error}'
  row['row_seconds'] = time.perf_counter() - started
  return row


def child(args, sizes: Sizes) -> None:
  """A row (or a worker) in this process: writes what it has measured to --row-out as it goes."""
  out = args.row_out

  def report(row: dict) -> None:
    write_json(out, row)

  if args.worker == 'tf_e2e':
    write_json(out, tf_e2e_worker(args, sizes))
    return
  try:
    row = ROW_FUNCTIONS[args.row](args, sizes, report)
  except Exception as error:  # the row's error goes into the JSON: the driver carries on
    partial = json.loads(out.read_text(encoding='utf-8')) if out.exists() else {}
    partial['error'] = f'{type(error).__name__}: {error}'
    write_json(out, partial)
    raise
  report(row)


def probe_device(timeout: float) -> dict:
  """The platform and device kind JAX picks, from a child process (the parent never holds the chip)."""
  code = ('import json, jax; d = jax.devices()[0]; print(json.dumps({"platform": d.platform, '
          '"device_kind": getattr(d, "device_kind", d.platform), "device_count": jax.device_count(), '
          '"jax_version": jax.__version__}))')
  try:
    done = subprocess.run([sys.executable, '-c', code], cwd=harness.ROOT, env=chip_env(), timeout=timeout,
                          capture_output=True, text=True)
  except subprocess.TimeoutExpired:
    return {'platform': 'unknown', 'error': f'jax.devices() took over {timeout:.0f} s'}
  if done.returncode:
    last = (done.stderr.strip().splitlines() or [f'exit {done.returncode}'])[-1]
    return {'platform': 'unknown', 'error': last}
  facts = json.loads(done.stdout.strip().splitlines()[-1])
  facts['peak_bf16_flops'] = PEAK_BF16_FLOPS.get(facts['device_kind'])
  return facts


def make_photos(args, sizes: Sizes) -> str:
  """An ImageNet-like JPEG folder (sides 375-500 px) generated into the workdir; a rerun reuses it."""
  low, high = sizes.photos_sides
  out = args.workdir / f'photos_{sizes.photos_classes}x{sizes.photos_per_class}_{low}-{high}'
  command = [sys.executable, '-m', 'benchmarks.data.make_image_folder', '--out', str(out),
             '--classes', str(sizes.photos_classes), '--train-per-class', str(sizes.photos_per_class),
             '--test-per-class', str(sizes.photos_test_per_class), '--min-side', str(low),
             '--max-side', str(high)]
  say(f'== photos: generating {out} (python -m benchmarks.data.make_image_folder)')
  status = run_process(command, env=cpu_env(), timeout=args.timeout_scale * dict(sizes.timeouts)['photos'])
  if status:
    raise RuntimeError(f'make_image_folder exited {status}')
  return str(out)


def folder_size(folder: str) -> dict:
  """How many train JPEGs the folder has and their mean size (ImageNet's average ~110 KiB)."""
  paths, _ = train_files(folder)
  total = sum(os.path.getsize(path) for path in paths)
  return {'train_images': len(paths), 'mean_kib': total / max(len(paths), 1) / 1024}


def selected_rows(only: str) -> list[str]:
  if not only:
    return list(ROWS)
  rows = []
  for word in only.replace(' ', '').split(','):
    name = LETTERS.get(word, word)
    if name not in ROWS:
      raise SystemExit(f'error: --only {word!r}: rows are {", ".join(ROWS)} (or a-e)')
    rows.append(name)
  return [row for row in ROWS if row in rows]


def previous_rows(out: pathlib.Path, device: dict, selected: list[str]) -> tuple[dict, dict]:
  """With --only: the other rows of an earlier run on the same kind of device, kept (a long run can be
  split over several commands; each row says which command measured it), and the description of the
  photos that its rows b and c read (none where this run measures them again)."""
  try:
    previous = json.loads(out.read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return {}, {}
  if (previous.get('device') or {}).get('device_kind') != device.get('device_kind'):
    return {}, {}
  rows = {name: row for name, row in (previous.get('rows') or {}).items()
          if name in ROWS and name not in selected}
  photos = previous.get('photos') or {} if {'e2e', 'input'} & set(rows) else {}
  return rows, photos


def drive(args, sizes: Sizes) -> dict:
  command = 'python -m benchmarks.device.tpu ' + shlex.join(sys.argv[1:])
  today = datetime.date.today().isoformat()
  results = {'command': command, 'date': today, 'quick': args.quick,
             'host': {'cpu_count': os.cpu_count(), 'machine': platform.machine(),
                      'python': platform.python_version()},
             'rows': {}}
  say(f'== {command}')
  device = probe_device(args.timeout_scale * dict(sizes.timeouts)['probe'])
  results['device'] = device
  on_tpu = device.get('platform') == 'tpu'
  reason = '' if on_tpu or args.any_platform else (
      f'no TPU: jax sees {device.get("platform")}' + (f' ({device["error"]})' if device.get('error') else ''))
  say(f'== device: {device.get("device_kind", "?")} x{device.get("device_count", "?")} '
      f'({device.get("platform")}); {os.cpu_count()} host cores'
      + (f'; device rows skipped: {reason}' if reason else ''))
  selected = selected_rows(args.only)
  if args.only:
    results['rows'], photos = previous_rows(args.out, device, selected)
    if photos:
      results['photos'] = photos
    if results['rows']:
      say(f'== keeping rows {", ".join(results["rows"])} of the earlier run in {args.out}')
  write_json(args.out, results)

  def record(name: str, row: dict) -> None:
    results['rows'][name] = {**row, 'command': command, 'date': today}
    write_json(args.out, results)

  for name in selected:
    if name in DEVICE_ROWS and reason:
      say(f'== {TITLES[name]}: skipped ({reason})')
      record(name, {'skipped': reason})
      continue
    if name in ('decode', 'startup') and not args.cifar:
      say(f'== {TITLES[name]}: skipped (no --cifar folder given)')
      record(name, {'skipped': 'no --cifar folder given'})
      continue
    if name in ('e2e', 'input') and not args.photos:
      try:
        args.photos = make_photos(args, sizes)
        results['photos'] = {'folder': args.photos, 'generated': True, 'sides': list(sizes.photos_sides),
                             **folder_size(args.photos)}
      except (RuntimeError, TimeoutError) as error:
        say(f'== {TITLES[name]}: no --photos, and generating them failed: {error}')
        record(name, {'error': f'no --photos, and generating them failed: {error}'})
        continue
    args.step_rate = ((results['rows'].get('step') or {}).get('flaxtpu') or {}).get('images_per_sec')
    say(f'== {TITLES[name]}')
    try:
      row = run_row(name, args, sizes)
    except (KeyboardInterrupt, SystemExit):  # what the row had measured goes into the JSON first
      record(name, {**partial_row(args, name), 'error': 'stopped before the row ended (SIGTERM or Ctrl-C)'})
      raise
    say(f'== {TITLES[name]}: ' + (f'FAILED: {row["error"]}' if row.get('error') else 'done')
        + f' in {row["row_seconds"]:.0f} s')
    record(name, row)
  return results


# --- the table ------------------------------------------------------------------------------------------


def _rate(value: Optional[float], unit: str = 'img/s') -> str:
  return f'{value:,.0f} {unit}' if value else '-'


def _ratio(value: Optional[float]) -> str:
  return f'{value:.2f}x' if value else '-'


def _seconds(value: Optional[float]) -> str:
  if value is None:
    return '-'
  return f'{value:.1f} s' if value >= 10 else f'{value:.2f} s'


def _mfu(entry: dict) -> str:
  return f', MFU {100 * entry["mfu"]:.1f}%' if entry.get('mfu') else ''


def table_rows(results: dict) -> list[tuple[str, ...]]:
  """(row, flaxtpu, peer, flaxtpu / peer, goal) for every measured line; skips and errors as such."""
  lines = []
  rows = results.get('rows', {})
  for name in ROWS:
    row = rows.get(name)
    if row is None:
      continue
    if row.get('skipped'):
      lines.append((TITLES[name], f'skipped: {row["skipped"]}', '', '', ''))
      continue
    if row.get('error') and not _has_numbers(name, row):
      lines.append((TITLES[name], f'failed: {row["error"]}', '', '', ''))
      continue
    lines.extend(_lines_of(name, row))
    if row.get('error'):
      lines.append((f'{TITLES[name]} (incomplete)', f'stopped: {row["error"]}', '', '', ''))
  return lines


def _has_numbers(name: str, row: dict) -> bool:
  keys = {'step': 'ratio', 'e2e': 'ratio_over_tf_data', 'input': 'ratio_over_tf_data',
          'decode': 'ratio_over_tf_data', 'startup': 'cold'}
  return keys[name] in row


def _lines_of(name: str, row: dict) -> list[tuple[str, ...]]:
  if name == 'step':
    flax, plain = row['flaxtpu'], row['flax_example']
    return [(f'{TITLES[name]}: ResNet-50, bf16, batch {row["batch"]} at {row["image_size"]} px',
             _rate(flax['images_per_sec']) + _mfu(flax),
             f'Flax ImageNet example: {_rate(plain["images_per_sec"])}{_mfu(plain)}', _ratio(row['ratio']),
             '>= 1.0')]
  if name == 'e2e':
    lines = [(f'{TITLES[name]}: CLI, imagenet_resnet50.py, cache=none, {row["train_images"]:,} JPEGs',
              f'{_rate(row["flaxtpu_images_per_sec"])}, input {100 * (row["flaxtpu_input_share"] or 0):.0f}%',
              f'tf.data + Flax example step: {_rate(row["tf_data_images_per_sec"])}, input '
              f'{100 * (row["tf_data_input_share"] or 0):.0f}%', _ratio(row['ratio_over_tf_data']), '>= 1.0')]
    if row.get('ratio_over_device_resident'):
      lines.append((f'{TITLES[name]}: beside row a', _rate(row['flaxtpu_images_per_sec']),
                    f'flaxtpu device-resident: {_rate(row["device_resident_images_per_sec"])}',
                    _ratio(row['ratio_over_device_resident']), '>= 0.95'))
    return lines
  if name == 'input':
    return [(f'{TITLES[name]}: {row["train_images"]:,} JPEGs, decode + random-resized crop to '
             f'{row["image_size"]} px, {row["workers"]} workers', f'{_rate(row["flaxtpu_images_per_sec"])} '
             f'(threads {_rate(row["flaxtpu_threads_images_per_sec"])})',
             f'tf.data: {_rate(row["tf_data_images_per_sec"])}', _ratio(row['ratio_over_tf_data']), '>= 1.0')]
  if name == 'decode':
    equal = ('pixels equal' if row.get('pixels_equal') else
             f'max difference {row.get("max_abs_difference")}' if row.get('same_files') else 'files differ')
    lines = [(f'{TITLES[name]}: {row["flaxtpu_images"]:,} JPEGs into one array, no disk cache ({equal})',
              f'{_seconds(row["flaxtpu_median_seconds"])} ({_rate(row["flaxtpu_images_per_sec"])})',
              f'tf.data: {_seconds(row["tf_data_median_seconds"])} ({_rate(row["tf_data_images_per_sec"])})',
              _ratio(row['ratio_over_tf_data']), '>= 1.0')]
    if row.get('disk_cache_warm_median_seconds'):
      lines.append((f'{TITLES[name]}: warm decoded-array disk cache',
                    _seconds(row['disk_cache_warm_median_seconds']),
                    f'tf.data: {_seconds(row["tf_data_median_seconds"])}',
                    _ratio(row['disk_cache_ratio_over_tf_data']), '>= 1.0'))
    elif row.get('disk_cache_skipped'):
      lines.append((f'{TITLES[name]}: warm decoded-array disk cache', f'skipped: {row["disk_cache_skipped"]}',
                    '', '', ''))
    return lines
  lines = []
  for key, label in (('cold', 'cold (empty compilation cache, fresh workdir)'),
                     ('warm', 'warm (same cache, new workdir)')):
    if key in row:
      lines.append((f'{TITLES[name]}, cifar10.py: {label}', _seconds(row[key]['time_to_first_step_s']),
                    '', '', ''))
  for key, label in (('fast_cold', 'cold'), ('fast_warm', 'warm')):
    if key in row:
      fast = row[key]
      lines.append((f'e. cifar10_fast.py whole run, {label}',
                    f'{_seconds(fast["process_wall_s"])} wall, {100 * (fast["eval_accuracy"] or 0):.2f}% '
                    f'after {fast["steps"]} steps', '', '', ''))
  return lines


def provenance(results: dict, key: str) -> list[str]:
  """The distinct commands (or dates) that measured the rows, in row order: one unless --only split
  the run."""
  rows = results.get('rows', {})
  values = [rows[name].get(key) for name in ROWS if name in rows] + [results.get(key)]
  return list(dict.fromkeys(value for value in values if value)) or ['?']


def notes(results: dict) -> list[str]:
  """What to keep in mind reading the table: where rows b and c's JPEGs came from, other load on the
  host during the input rounds."""
  lines = []
  photos = results.get('photos') or {}
  if photos.get('generated') and photos.get('mean_kib'):
    low, high = photos['sides']
    lines += [f'Rows b and c read a generated folder (`python -m benchmarks.data.make_image_folder`): '
              f'{photos["train_images"]:,} train',
              f'JPEGs of {low}-{high} px a side, {photos["mean_kib"]:.0f} KiB on average (ImageNet\'s '
              'average ~110 KiB: real photos cost more to read and decode).', '']
  row = results.get('rows', {}).get('input') or {}
  busy = {name: row.get(f'{name}_other_cpu_load') for name in ('flaxtpu', 'flaxtpu_threads', 'tf_data')}
  if any(load and load > 0.25 for load in busy.values()):
    cores = ', '.join(f'{name} {load:.1f}' for name, load in busy.items() if load is not None)
    lines += [f'Row c ran beside other work: other processes kept cores busy during its rounds ({cores};',
              'medians), so read its ratio as rough.', '']
  return lines


def render_section(results: dict) -> str:
  device = results.get('device', {})
  host = results.get('host', {})
  peak = device.get('peak_bf16_flops')
  lines = [
      DOCS_HEADING, '',
      '`python -m benchmarks.device.tpu` runs flaxtpu beside its peers on one accelerator host, in one run',
      '(its docstring has the details): (a) the device-resident ResNet-50 train step against the Flax',
      'ImageNet example\'s model and SGD step (`benchmarks/peers/flax_imagenet_resnet.py`); (b) training end',
      'to end from a JPEG folder with the CLI (`dataset.cache=none`) against tf.data feeding that same Flax',
      'step, and against row a\'s device-resident rate; (c) the input pipeline alone',
      '(`benchmarks/input/input_pipeline.py`) against tf.data; (d) the CIFAR-10 JPEG folder decoded into one',
      'array against tf.data (and from a',
      f'warm decoded-array disk cache, where the config has `{DECODED_CACHE_KEY}`); (e) the time to the',
      'first step with a cold and a warm compilation cache, and `configs/cifar10_fast.py`\'s whole run.',
      'Each row runs in its own process with a time limit; its contestants alternate over interleaved',
      'rounds and the medians are shown. Ratios are flaxtpu\'s speed over the peer\'s (above 1: flaxtpu',
      'is faster). MFU: the FLOPs of XLA\'s cost analysis of each compiled step, per second, over the',
      'chip\'s dense bf16 peak' + (f' ({peak / 1e12:.0f} TFLOP/s).' if peak else '.'),
      'In row d tf.data decodes with `dct_method=\'INTEGER_ACCURATE\'`, the IDCT Pillow uses, so the two',
      'arrays are compared value for value (TensorFlow\'s default, `INTEGER_FAST`, is up to 5 levels off).',
      'Without a TPU the device rows (a, b, e) are skipped, saying why. `--only` measures some rows again',
      'and keeps the others; every command that measured a row is listed.', '',
      f'Measured on {device.get("device_kind", "?")} x{device.get("device_count", "?")} '
      f'({device.get("platform", "?")}, jax {device.get("jax_version", "?")}), '
      f'{host.get("cpu_count", "?")} host cores, {", ".join(provenance(results, "date"))}'
      + (', `--quick` sizes' if results.get('quick') else '') + ':', '',
      *(f'    {command}' for command in provenance(results, 'command')), '',
      '| row | flaxtpu | peer | flaxtpu / peer | goal |',
      '| --- | --- | --- | --- | --- |',
  ]
  for row in table_rows(results):
    lines.append('| ' + ' | '.join(cell.replace('|', '/') for cell in row) + ' |')
  lines += ['', *notes(results), 'Numbers, per round, in the run\'s JSON (`benchmarks/results/tpu.json` by '
            'default).', '']
  return '\n'.join(lines)


def write_docs(results: dict, docs: pathlib.Path) -> None:
  """Replaces the "## On a TPU host" section (to the next `## ` heading or the end) or appends it."""
  text = docs.read_text(encoding='utf-8') if docs.exists() else ''
  section = render_section(results)
  start = text.find('\n' + DOCS_HEADING + '\n')
  if start < 0:
    text = text.rstrip('\n') + '\n\n' + section
  else:
    end = text.find('\n## ', start + 1)
    text = text[:start + 1] + section.rstrip('\n') + ('\n\n' + text[end + 1:] if end >= 0 else '')
  docs.write_text(text.rstrip('\n') + '\n', encoding='utf-8')
  say(f'wrote the "{DOCS_HEADING}" section of {docs}')


def print_table(results: dict) -> None:
  say('')
  for row, flaxtpu, peer, ratio, goal in table_rows(results):
    say(f'{row}\n    flaxtpu: {flaxtpu}' + (f'\n    peer:    {peer}' if peer else '')
        + (f'\n    flaxtpu / peer: {ratio} (goal {goal})' if ratio else ''))


def exit_on_sigterm() -> None:
  """SIGTERM (a stopped row, a job scheduler) ends this process through Python, so whatever it runs
  is stopped too (run_process); Python's default would leave it running, holding the chip."""

  def leave(signum, frame):
    del frame
    raise SystemExit(128 + signum)

  signal.signal(signal.SIGTERM, leave)


def main() -> None:
  exit_on_sigterm()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--cifar', default='', help='the CIFAR-10 JPEG folder (train/<class>/*.jpg): rows d, e')
  parser.add_argument('--photos', default='', help='a JPEG folder DIR/train/<class>/*.jpg for rows b, c '
                      '(default: an ImageNet-like one generated into --workdir)')
  parser.add_argument('--out', type=pathlib.Path, help='the JSON, written after every row',
                      default=harness.ROOT / 'benchmarks' / 'results' / 'tpu.json')
  parser.add_argument('--only', default='', help=f'rows, comma-separated: {", ".join(ROWS)} (or a-e)')
  parser.add_argument('--quick', action='store_true', help='tiny sizes: a smoke run (CI, on CPU)')
  parser.add_argument('--write-docs', action='store_true',
                      help=f'replace the "{DOCS_HEADING}" section of docs/performance.md with the table')
  parser.add_argument('--docs', type=pathlib.Path, default=DOCS, help='the page --write-docs writes')
  parser.add_argument('--from-json', type=pathlib.Path,
                      help='print (and with --write-docs, write) an earlier run\'s JSON; measures nothing')
  parser.add_argument('--workdir', type=pathlib.Path,
                      default=pathlib.Path(tempfile.gettempdir()) / 'flaxtpu_bench_tpu',
                      help='scratch: generated photos, workdirs, compilation caches (kept for reruns)')
  parser.add_argument('--timeout-scale', type=float, default=1.0, help='multiplies every row\'s time limit')
  parser.add_argument('--any-platform', action='store_true',
                      help='run the device rows without a TPU too (slow on a CPU; checks the script)')
  parser.add_argument('--row', choices=ROWS, help=argparse.SUPPRESS)
  parser.add_argument('--worker', choices=('tf_e2e',), help=argparse.SUPPRESS)
  parser.add_argument('--row-out', type=pathlib.Path, help=argparse.SUPPRESS)
  parser.add_argument('--step-rate', type=float, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.workdir = args.workdir.resolve()
  sizes = QUICK if args.quick else Sizes()
  if args.row or args.worker:
    child(args, sizes)
    return
  if args.from_json:
    results = json.loads(args.from_json.read_text(encoding='utf-8'))
  else:
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.cifar, args.photos = (os.path.abspath(path) if path else '' for path in (args.cifar, args.photos))
    results = drive(args, sizes)  # writes --out after every row
    say(f'wrote {args.out}')
  print_table(results)
  if args.write_docs:
    write_docs(results, args.docs)


if __name__ == '__main__':
  main()
