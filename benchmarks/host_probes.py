"""Two probes of an accelerator host's costs that the rows of `benchmarks/tpu.py` only show summed.

    python -m benchmarks.host_probes pages   # a fresh 38 MiB batch array against a reused one
    python -m benchmarks.host_probes gil     # whether starting the devices holds Python's GIL
    python -m benchmarks.host_probes stages --folder DIR   # a training crop's stages, 1 process vs all cores

`pages`: filling a new array the size of a batch (256 crops of 224 px) against refilling one
already touched, before and after `workers.keep_freed_memory`. Under gVisor (Cloud TPU hosts) every
first touch of a page is a costly fault; on a TPU v5e host 42.9 ms against 3.3 ms (docs/performance.md).

`gil`: a thread ticks every 5 ms while the main thread starts JAX's devices; its longest gap is how
long it could not run. On a TPU v5e host one gap of 4.4 s in a 6.1 s start: nothing in Python runs
beside the TPU runtime's start, which bounds the time to a first step.

`stages`: a training image's time by stage (read the file, parse the header, decode at the scale
the crop needs, resize the crop to 224 px) in one process, then in one process per core at once.
A stage that slows with every core busy points at the host (shared cores, the sandbox's system
calls), one slow alone at the code. On a TPU v5e host an image cost 1.3-1.5 ms alone and 2.5-2.8
CPU-ms with 13 workers busy, tf.data's 1.4-1.7 (docs/performance.md, the third round).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
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
  from flaxtpu.data import workers  # pylint: disable=g-import-not-at-top
  source = np.random.default_rng(0).integers(0, 256, BATCH_SHAPE, dtype=np.uint8)
  reused = np.empty_like(source)
  result = {'fresh_ms': median_ms(lambda: np.array(source)),
            'reused_ms': median_ms(lambda: np.copyto(reused, source))}
  workers.keep_freed_memory(source.nbytes)
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


def stage_times(paths: list[str], size: int = 224) -> dict:
  """Seconds per stage for each of `paths`, cropped as training crops them (seeded)."""
  import cv2  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import preprocess  # pylint: disable=g-import-not-at-top
  cv2.setNumThreads(1)  # as in the input workers
  rng, times = np.random.default_rng(0), {stage: [] for stage in STAGES}
  for path in paths:
    started = time.perf_counter()
    data = preprocess.read_file(path)
    read = time.perf_counter()
    source = preprocess.open_source(data)
    parsed = time.perf_counter()
    width, height = preprocess.source_size(source)
    box = preprocess.random_crop_box(rng, width, height, (0.08, 1.0), (3 / 4, 4 / 3))
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
  return times


def stages(folder: str, images: int, processes: list[int]) -> dict:
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
      pool.map(stage_times, [paths[:8]] * count)  # started and warm
      runs = pool.map(stage_times, [paths] * count)
    result[f'{count}_processes_ms'] = {
        stage: 1e3 * statistics.median(seconds for run in runs for seconds in run[stage]) for stage in STAGES}
    result[f'{count}_processes_ms']['total'] = sum(result[f'{count}_processes_ms'].values())
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('probe', choices=('pages', 'gil', 'stages'))
  parser.add_argument('--folder', help='stages: a folder of JPEGs (the first --images, sorted)')
  parser.add_argument('--images', type=int, default=400)
  parser.add_argument('--processes', default=f'1,{os.cpu_count() or 1}',
                      help='stages: process counts, comma-separated')
  args = parser.parse_args()
  if args.probe == 'stages':
    if not args.folder:
      parser.error('stages needs --folder')
    result = stages(args.folder, args.images, [int(count) for count in args.processes.split(',')])
  else:
    result = pages() if args.probe == 'pages' else gil()
  for key, value in result.items():
    if isinstance(value, dict):
      value = ', '.join(f'{stage} {ms:.3f}' for stage, ms in value.items())
    print(f'{key}: {[round(v, 3) for v in value] if isinstance(value, list) else value}')


if __name__ == '__main__':
  main()
