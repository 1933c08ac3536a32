"""Two probes of an accelerator host's costs that the rows of `benchmarks/device/tpu.py` only show summed.

    python -m benchmarks.input.host_probes pages   # a fresh 38 MiB batch array against a reused one
    python -m benchmarks.input.host_probes gil     # whether starting the devices holds Python's GIL
    python -m benchmarks.input.host_probes stages --folder DIR   # a crop's stages, 1 process vs all cores
    python -m benchmarks.input.host_probes batches --folder DIR  # whole batches, 1 process vs all cores
    python -m benchmarks.input.host_probes shm  # a batch into a shared-memory block: plain vs populated
    python -m benchmarks.input.host_probes runtime # starting the accelerator's runtime under each setting
    python -m benchmarks.input.host_probes profile --folder DIR  # a training batch's time by function

`pages`: filling a new array the size of a batch (256 crops of 224 px) against refilling one
already touched, before and after `shared_blocks.keep_freed_memory`. Under gVisor (Cloud TPU hosts) every
first touch of a page is a costly fault; on a TPU v5e host 42.9 ms against 3.3 ms (docs/performance.md).

`gil`: a thread ticks every 5 ms while the main thread starts JAX's devices; its longest gap is how
long it could not run. On a TPU v5e host one gap of 4.4 s in a 6.1 s start: nothing in Python runs
beside the TPU runtime's start, which bounds the time to a first step.

`stages`: a training image's time by stage (read the file, parse the header, decode at the scale
the crop needs, resize the crop to 224 px) in one process, then in one process per core at once.
A stage that slows with every core busy points at the host (shared cores, the sandbox's system
calls), one slow alone at the code. On a TPU v5e host an image cost 1.3-1.5 ms alone and 2.5-2.8
CPU-ms with 13 workers busy, tf.data's 1.4-1.7 (docs/performance.md, the third round).

`batches`: the input workers' whole job, a training batch of 256 crops (`loaders._TrainLoader`) and
its copy into a shared-memory block, in one process and then in one per core at once, CPU and wall
time per image; then `workers.run` with one worker per core as training runs it, with the trainer's
copy out of the blocks, window by window (the workers' CPU, and the share of their wall time spent
building the window's batches), and when each worker began its first batch. Set beside `stages`, it
says what a batch costs beyond its images' stages.

`shm`: one process, then one per core at once, each writing a batch twice into shared-memory blocks
the parent made and touched: mapped as `multiprocessing` maps them, and mapped with every page in
place (`shared_blocks.attach`, MAP_POPULATE). On a TPU v5e host with 13 processes: the first write 127 ms
plain against 7 ms to map populated and 4 ms to write (docs/performance.md, the fourth round).

`profile`: what `batches` times whole, by function: training batches built under cProfile in one
process per core at once, each function's own time per image (the median over the processes);
the costs that a batch adds to its images' stages show here by name.

`runtime`: fresh interpreters that import JAX and start its devices, timed by part, under settings
that might skip work at the start (the TPU runtime's query of the cloud metadata server, the search
for other platforms' plugins), alternating over rounds; then one start with the TPU runtime's own
log at its most verbose, to see where its time goes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

BATCH_SHAPE = (256, 224, 224, 3)


def median_ms(function, repeats: int = 20) -> float:
  seconds = []
  for _ in range(repeats):
    started = time.perf_counter()
    function()
    seconds.append(time.perf_counter() - started)
  return 1e3 * statistics.median(seconds)


def pages() -> dict:
  from flaxtpu.data import shared_blocks  # pylint: disable=g-import-not-at-top
  source = np.random.default_rng(0).integers(0, 256, BATCH_SHAPE, dtype=np.uint8)
  reused = np.empty_like(source)
  result = {'fresh_ms': median_ms(lambda: np.array(source)),
            'reused_ms': median_ms(lambda: np.copyto(reused, source))}
  shared_blocks.keep_freed_memory(source.nbytes)
  result['fresh_after_keep_freed_memory_ms'] = median_ms(lambda: np.array(source))
  return result


def gil() -> dict:
  ticks, done = [], threading.Event()

  def tick() -> None:
    while not done.is_set():
      ticks.append(time.perf_counter())
      time.sleep(0.005)
  started = time.perf_counter()
  import jax  # pylint: disable=g-import-not-at-top
  imported = time.perf_counter()
  threading.Thread(target=tick, daemon=True).start()
  devices = jax.devices()
  ready = time.perf_counter()
  done.set()
  gaps = sorted((later - earlier for earlier, later in zip(ticks, ticks[1:])), reverse=True)
  return {'device': f'{devices[0].device_kind} x{len(devices)}', 'import_jax_s': imported - started,
          'devices_s': ready - imported, 'longest_gaps_s': gaps[:3],
          'stalled_s': sum(gap for gap in gaps if gap > 0.1)}


STAGES = ('read', 'header', 'decode', 'resize')
# tf.data's training crop of the same box (the Flax ImageNet example's): libjpeg-turbo decoding only
# the crop's rows and columns (`decode_and_crop_jpeg`), then the same resize.
TF_STAGES = ('tf_decode_and_crop', 'tf_resize')


def stage_times(paths: list[str], size: int = 224, with_tf: bool = False) -> dict:
  """Seconds per stage for each of `paths`, cropped as training crops them (seeded); `with_tf`:
  the same boxes through TensorFlow's crop-region decode too, image by image in the same process."""
  import cv2  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import preprocess  # pylint: disable=g-import-not-at-top
  cv2.setNumThreads(1)  # as in the input workers
  if with_tf:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
  rng = np.random.default_rng(0)
  times = {stage: [] for stage in STAGES + (TF_STAGES if with_tf else ())}
  for path in paths:
    started = time.perf_counter()
    data = preprocess.read_file(path)
    read = time.perf_counter()
    source = preprocess.open_source(data)
    parsed = time.perf_counter()
    width, height = preprocess.source_size(source)
    box = preprocess.random_crop_box(preprocess.crop_draws(rng, 1)[0], width, height, (0.08, 1.0),
                                     (3 / 4, 4 / 3))
    target = (int(np.ceil(size * width / (box[2] - box[0]))), int(np.ceil(size * height / (box[3] - box[1]))))
    pixels = preprocess._decoded(source, 3, target)  # pylint: disable=protected-access
    decoded = time.perf_counter()
    scale_x, scale_y = pixels.shape[1] / width, pixels.shape[0] / height
    left, right = preprocess._pixel_span(box[0] * scale_x, box[2] * scale_x, pixels.shape[1])  # pylint: disable=protected-access
    top, bottom = preprocess._pixel_span(box[1] * scale_y, box[3] * scale_y, pixels.shape[0])  # pylint: disable=protected-access
    crop = pixels[top:bottom, left:right]
    cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR)
    resized = time.perf_counter()
    for stage, seconds in zip(STAGES, (read - started, parsed - read, decoded - parsed, resized - decoded)):
      times[stage].append(seconds)
    if with_tf:
      started = time.perf_counter()
      window = [box[1], box[0], box[3] - box[1], box[2] - box[0]]
      crop = tf.io.decode_and_crop_jpeg(data, window, channels=3).numpy()
      decoded = time.perf_counter()
      cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR)
      times['tf_decode_and_crop'].append(decoded - started)
      times['tf_resize'].append(time.perf_counter() - decoded)
  return times


def stages(folder: str, images: int, processes: list[int], with_tf: bool = False) -> dict:
  paths = sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                 if name.lower().endswith(('.jpg', '.jpeg')))[:images]
  if not paths:
    raise SystemExit(f'error: no JPEGs under {folder}')
  for path in paths:  # into the page cache: the rounds time decoding, not the disk
    with open(path, 'rb') as f:
      f.read()
  result = {}
  for count in processes:
    with multiprocessing.get_context('spawn').Pool(count) as pool:
      pool.starmap(stage_times, [(paths[:8], 224, with_tf)] * count)  # started and warm
      runs = pool.starmap(stage_times, [(paths, 224, with_tf)] * count)
    medians = {stage: 1e3 * statistics.median(seconds for run in runs for seconds in run[stage])
               for stage in runs[0]}
    medians['total'] = sum(medians[stage] for stage in STAGES)
    if with_tf:
      medians['tf_total'] = medians['read'] + sum(medians[stage] for stage in TF_STAGES)
    result[f'{count}_processes_ms'] = medians
  return result


def _folder_loader(folder: str, batch_size: int):
  """The train loader training builds for a JPEG folder at 224 px, `cache=none`."""
  from configs import cifar10  # pylint: disable=g-import-not-at-top
  from flaxtpu.data import loaders, pipeline, sampling  # pylint: disable=g-import-not-at-top
  config = cifar10.get_config()
  config.dataset.folder, config.dataset.image_size, config.dataset.cache = folder, 224, 'none'
  dataset = pipeline.load(config)
  chosen = sampling.sampler(dataset, seed=0, batch_size=batch_size, process_index=0, process_count=1)
  return loaders._TrainLoader(dataset.train, dataset.transform, chosen, dataset.skip_corrupt)  # pylint: disable=protected-access


def batch_times(loader, steps: range) -> dict:
  """Per batch of `steps`: the wall and CPU seconds of building it, then of handing it over in a
  shared-memory block (a worker's `shared_blocks.packed`; from the second batch on, built in the block
  as a worker builds it, nothing left to copy but the labels)."""
  from multiprocessing import shared_memory  # pylint: disable=g-import-not-at-top

  import cv2  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import shared_blocks  # pylint: disable=g-import-not-at-top
  cv2.setNumThreads(1)
  times = {'build_wall': [], 'build_cpu': [], 'pack_wall': [], 'pack_cpu': []}
  block = None
  try:
    for step in steps:
      wall, cpu = time.perf_counter(), time.process_time()
      with shared_blocks.building_in(block):  # as a worker builds it: in its block, from the second on
        batch = loader(step)
      built_wall, built_cpu = time.perf_counter(), time.process_time()
      if block is None:
        size = shared_blocks.packed_size(batch)
        block = shared_memory.SharedMemory(create=True, size=size + size // 8)
        shared_blocks.keep_freed_memory(block.size)
      shared_blocks.packed(batch, block)
      times['build_wall'].append(built_wall - wall)
      times['build_cpu'].append(built_cpu - cpu)
      times['pack_wall'].append(time.perf_counter() - built_wall)
      times['pack_cpu'].append(time.process_time() - built_cpu)
  finally:
    if block is not None:
      block.close()
      block.unlink()
  return times


def batches(folder: str, processes: list[int], batch_size: int = 256, steps: int = 6,
            buffer: int = 4) -> dict:
  from flaxtpu.data import workers  # pylint: disable=g-import-not-at-top
  loader = _folder_loader(folder, batch_size)
  result = {}
  for count in processes:
    with multiprocessing.get_context('spawn').Pool(count) as pool:
      pool.starmap(batch_times, [(loader, range(1))] * count)  # started and warm
      runs = pool.starmap(batch_times, [(loader, range(1 + i * steps, 1 + (i + 1) * steps))
                                        for i in range(count)])
    result[f'{count}_processes_ms_per_image'] = {
        key: 1e3 * statistics.median(seconds for run in runs for seconds in run[key]) / batch_size
        for key in runs[0]}
  # As training runs it: one worker per core, the trainer copying each batch out of its block; the
  # rate and the workers' CPU per image in successive windows of one batch per worker from the first.
  import psutil  # pylint: disable=g-import-not-at-top
  count, windows = max(processes), 10
  me = psutil.Process()

  def cpu(processes_now) -> float:
    total = 0.0
    for process in processes_now:
      try:
        total += sum(process.cpu_times()[:2])
      except psutil.Error:
        pass
    return total

  started = time.time()
  iterator = workers.run(_Stamped(loader), range((windows + 1) * count), count, buffer=buffer,
                         result_bytes=batch_size * 224 * 224 * 3 + 64)
  stamps = [next(iterator)[-1]]
  children = me.children(recursive=True)
  rows = []
  for _ in range(windows):
    wall, main, used = time.perf_counter(), time.process_time(), cpu(children)
    for _ in range(count):
      stamps.append(next(iterator)[-1])
    images = count * batch_size
    seconds = time.perf_counter() - wall
    rows.append({'images_per_sec': images / seconds,
                 'workers_cpu_ms_per_image': 1e3 * (cpu(children) - used) / images,
                 'trainer_cpu_ms_per_image': 1e3 * (time.process_time() - main) / images,
                 # the window's batches: the share of the workers' wall time spent building them
                 'workers_busy': sum(end - start for _, start, end in stamps[-count:]) / (count * seconds)})
  iterator.close()
  result[f'workers.run_{count}_buffer_{buffer}_windows'] = rows
  # When each worker began its first batch, from the pool's start: the workers' own start-up.
  first = {}
  for pid, start, _ in stamps:
    first.setdefault(int(pid), float(start - started))
  result[f'workers.run_{count}_first_batch_start_s'] = sorted(first.values())
  return result


class _Stamped:
  """The loader, each batch followed by [pid, start, end] of its building in the worker (wall clock)."""

  def __init__(self, loader):
    self.loader = loader

  def __call__(self, step):
    start = time.time()
    batch = self.loader(step)
    return (*batch, np.array([os.getpid(), start, time.time()]))


def profiled_batches(loader, steps: range) -> dict:
  """Each function's own seconds building `steps` of `loader` under cProfile, and the batches' images."""
  import cProfile  # pylint: disable=g-import-not-at-top
  import pstats  # pylint: disable=g-import-not-at-top

  import cv2  # pylint: disable=g-import-not-at-top
  cv2.setNumThreads(1)
  loader(steps[0])  # warm: the first batch's pages and imports
  profiler = cProfile.Profile()
  images = 0
  profiler.enable()
  for step in steps[1:]:
    images += len(loader(step).labels)
  profiler.disable()
  own = {}
  for (path, line, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
    where = f'{name} ({os.path.basename(path)}:{line})' if line else name
    own[where] = own.get(where, 0.0) + tottime
  return {'images': images, 'own_seconds': own}


def profile(folder: str, processes: int, batch_size: int = 256, steps: int = 5, top: int = 15) -> dict:
  loader = _folder_loader(folder, batch_size)
  with multiprocessing.get_context('spawn').Pool(processes) as pool:
    runs = pool.starmap(profiled_batches, [(loader, range(1 + i * (steps + 1), 1 + (i + 1) * (steps + 1)))
                                           for i in range(processes)])
  per_image = {}
  for where in set().union(*(run['own_seconds'] for run in runs)):
    per_image[where] = 1e3 * statistics.median(run['own_seconds'].get(where, 0.0) / run['images']
                                               for run in runs)
  ranked = sorted(per_image.items(), key=lambda item: -item[1])
  return {f'{processes}_processes_ms_per_image_total': sum(per_image.values()),
          f'{processes}_processes_ms_per_image_by_function': dict(ranked[:top])}


def shm_writes(names: list[str]) -> dict:
  """Milliseconds to map, write once and write again a batch into the blocks `names` (two mapped
  plain, two populated)."""
  from multiprocessing import shared_memory  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import shared_blocks  # pylint: disable=g-import-not-at-top
  source = np.ones(int(np.prod(BATCH_SHAPE)), np.uint8)
  result = {}
  for how, name in zip(('plain', 'populated', 'plain', 'populated'), names):
    started = time.perf_counter()
    block = shared_memory.SharedMemory(name) if how == 'plain' else shared_blocks.attach(name)
    mapped = time.perf_counter()
    np.ndarray(source.shape, np.uint8, buffer=block.buf)[:] = source
    written = time.perf_counter()
    np.ndarray(source.shape, np.uint8, buffer=block.buf)[:] = source
    again = time.perf_counter()
    block.close()
    for key, seconds in (('map', mapped - started), ('first_write', written - mapped),
                         ('second_write', again - written)):
      result.setdefault(f'{how}_{key}', []).append(1e3 * seconds)
  return result


def shm(processes: list[int]) -> dict:
  from multiprocessing import shared_memory  # pylint: disable=g-import-not-at-top
  size = int(np.prod(BATCH_SHAPE)) * 9 // 8  # as the input workers size their blocks
  result = {}
  for count in processes:
    blocks = [shared_memory.SharedMemory(create=True, size=size) for _ in range(4 * count)]
    try:
      for block in blocks:  # the parent's pages exist, as after the first batches of a pass
        np.ndarray(size, np.uint8, buffer=block.buf)[:] = 0
      with multiprocessing.get_context('spawn').Pool(count) as pool:
        runs = pool.map(shm_writes, [[block.name for block in blocks[4 * i:4 * i + 4]] for i in range(count)])
    finally:
      for block in blocks:
        block.close()
        block.unlink()
    result[f'{count}_processes_ms'] = {key: statistics.median(ms for run in runs for ms in run[key])
                                       for key in runs[0]}
  return result


def _premapped(mib: int) -> dict:
  """The TPU runtime's host buffer for transfers, mapped at its start (4 GiB by default)."""
  size = str(mib << 20)
  return {'TPU_PREMAPPED_BUFFER_SIZE': size, 'TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES': size}


# Settings that might shorten the start, each on top of the inherited environment.
# (On a TPU v5e host TPU_SKIP_MDS_QUERY=1 and JAX_PLATFORMS=tpu changed nothing: 6.5-8.4 s each.)
RUNTIME_SETTINGS = {'default': {}, 'premapped_1024m': _premapped(1024), 'premapped_256m': _premapped(256),
                    'premapped_64m': _premapped(64)}
# Then a batch (256 crops of 224 px, uint8) to the device: alone, and two at once, as training
# keeps one batch in flight beside the one being put.
_START = """
import time
began = time.time()
import jax
imported = time.time()
devices = jax.devices()
ready = time.time()
import json, statistics
import numpy as np
batch = np.ones((256, 224, 224, 3), np.uint8)
jax.device_put(batch).block_until_ready()
one, two = [], []
for _ in range(7):
  started = time.perf_counter()
  jax.device_put(batch).block_until_ready()
  one.append(time.perf_counter() - started)
  started = time.perf_counter()
  for put in [jax.device_put(batch), jax.device_put(batch + 1)]:
    put.block_until_ready()
  two.append(time.perf_counter() - started)
print(json.dumps({'import_jax_s': imported - began, 'devices_s': ready - imported,
                  'platform': devices[0].platform, 'put_batch_ms': 1e3 * statistics.median(one),
                  'put_two_batches_ms': 1e3 * statistics.median(two)}))
"""


def _start(setting: dict) -> tuple[subprocess.CompletedProcess, float]:
  """`_START` in a fresh interpreter under `setting`: the finished process and its wall seconds."""
  began = time.time()
  done = subprocess.run([sys.executable, '-c', _START], env={**os.environ, **setting},
                        capture_output=True, text=True, timeout=300, check=False)
  return done, round(time.time() - began, 2)


def runtime(rounds: int = 2, log: str | None = None) -> dict:
  result = {}
  for _ in range(rounds):
    for name, setting in RUNTIME_SETTINGS.items():
      done, wall = _start(setting)
      if done.returncode:
        result.setdefault(name, []).append({'failed': done.stderr.strip().splitlines()[-1:]})
        continue
      parts = next(json.loads(line) for line in done.stdout.splitlines() if line.startswith('{'))
      result.setdefault(name, []).append({'wall_s': wall, **{
          key: round(value, 2) if isinstance(value, float) else value for key, value in parts.items()}})
  done, result['verbose_wall_s'] = _start({'TPU_STDERR_LOG_LEVEL': '0', 'TPU_MIN_LOG_LEVEL': '0',
                                           'TF_CPP_MIN_LOG_LEVEL': '0', 'TF_CPP_MAX_VLOG_LEVEL': '1'})
  if log:
    with open(log, 'w') as f:
      f.write(done.stderr)
  return result


def _shown(value) -> str:
  return f'{value:,.3f}' if isinstance(value, float) else str(value)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('probe', choices=('pages', 'gil', 'stages', 'batches', 'shm', 'runtime', 'profile'))
  parser.add_argument('--folder', help='stages: a folder of JPEGs (the first --images, sorted); '
                      'batches, profile: an image folder DIR/train/<class>/*.jpg')
  parser.add_argument('--images', type=int, default=400)
  parser.add_argument('--processes', default=f'1,{os.cpu_count() or 1}',
                      help='stages, batches, shm: process counts, comma-separated')
  parser.add_argument('--buffer', type=int, default=4,
                      help='batches: results in flight beyond one per worker (input.prefetch)')
  parser.add_argument('--tf', action='store_true',
                      help="stages: beside each image, tf.data's crop-region decode of the same box")
  parser.add_argument('--log', help="runtime: where to write the verbose start's log")
  args = parser.parse_args()
  if args.probe == 'stages':
    if not args.folder:
      parser.error('stages needs --folder')
    result = stages(args.folder, args.images, [int(count) for count in args.processes.split(',')],
                    with_tf=args.tf)
  elif args.probe == 'batches':
    if not args.folder:
      parser.error('batches needs --folder')
    result = batches(args.folder, [int(count) for count in args.processes.split(',')], buffer=args.buffer)
  elif args.probe == 'profile':
    if not args.folder:
      parser.error('profile needs --folder')
    result = profile(args.folder, max(int(count) for count in args.processes.split(',')))
  elif args.probe == 'runtime':
    result = runtime(log=args.log)
  elif args.probe == 'shm':
    result = shm([int(count) for count in args.processes.split(',')])
  else:
    result = pages() if args.probe == 'pages' else gil()
  for key, value in result.items():
    if isinstance(value, dict):
      shown = [f'{stage} {ms:.3f}' for stage, ms in value.items()]  # a long ranking: a line each
      value = ''.join(f'\n  {item}' for item in shown) if len(shown) > 6 else ', '.join(shown)
    elif isinstance(value, list) and value and isinstance(value[0], dict):
      value = '\n  ' + '\n  '.join(', '.join(f'{key} {_shown(number)}' for key, number in row.items())
                                    for row in value)
    print(f'{key}: {[round(v, 3) for v in value] if isinstance(value, list) else value}')


if __name__ == '__main__':
  main()
