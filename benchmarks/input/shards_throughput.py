"""Tar shards against an image folder: flaxtpu's streaming input throughput and peak RSS on the same images.

    python -m benchmarks.input.shards_throughput --folder /data/gen100k --shards /data/gen100k_shards  # 100k
    python -m benchmarks.input.shards_throughput --folder /tmp/gen2k --shards /tmp/gen2k_shards --n 2000 \\
        --seconds 3 --rounds 1                                                               # a smoke run
    # -> benchmarks/results/local/shards_throughput.json

The images: `--folder` (`train/<class>/*.jpg`, `test/<class>/*.jpg`), made
here by `python -m benchmarks.data.make_image_folder` when it does not exist
yet (`--n` train images over `--classes` classes, 1 test image per class:
mixed-size JPEGs, 64-320 px, ~7 KiB, see benchmarks/README.md), and the same
files as `--num-shards` WebDataset-style tar shards in `--shards`, made by
`python -m benchmarks.data.make_shards` when missing.

Each pipeline is `pipeline.load` (`dataset.cache=none`: streamed, headers scanned
first) and `loaders.train_batches` with the same workers, batch size, image size
and crop (the trainer's Inception-style random-resized crop to --image-size),
in a process of its own:

- `folder`: `dataset.folder`, `dataset.sampling=shuffle` (random file reads);
- `shards`: `dataset.shards`, `dataset.sampling=shards` (each process streams
  its shards in a seeded order, WebDataset-style);
- `shards_shuffle` (only with `--pipelines`): `dataset.shards` with the global
  shuffle, for what random access into the tars costs.

Every file (images and tars) is read once first, so each pipeline finds the
page cache warm. --rounds interleaved rounds (who goes first alternates) time
each pipeline's batches for at least --seconds after one cycle of warm-up
batches (`input_pipeline.time_batches`), sampling the resident memory of the
whole process tree (the pipeline and its grain workers, `input_memory.tree_memory`)
every --interval s. Reports medians: images/s, images per CPU-second (the
process tree's, `harness.cpu_load`), the cores other processes kept busy,
peak RSS (PSS) over the whole process and during the timed batches, and
`pipeline.load`'s time.

Exact resume: from the shards (sampling=shards), the batches of steps
[k, k+m) of an iterator started at step 0 are compared, image for image and
label for label, with those of a fresh iterator started at step k
(default k = one epoch's steps - 1, m = 3: across the epoch boundary).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import psutil

from benchmarks.input import input_memory, input_pipeline
from benchmarks.shared import harness

PIPELINES = {
    'folder': {'source': 'folder', 'sampling': 'shuffle'},
    'shards': {'source': 'shards', 'sampling': 'shards'},
    'shards_shuffle': {'source': 'shards', 'sampling': 'shuffle'},
}


# --- the data -------------------------------------------------------------------------------------


def make_folder(args) -> None:
  """The generated image folder, unless it exists."""
  if os.path.isdir(os.path.join(args.folder, 'train')):
    return
  per_class = max(1, args.n // args.classes)
  command = [sys.executable, '-m', 'benchmarks.data.make_image_folder', '--out', args.folder, '--classes',
             str(args.classes), '--train-per-class', str(per_class), '--test-per-class', '1']
  print(' '.join(command[1:]), flush=True)
  subprocess.run(command, cwd=harness.ROOT, check=True)


def shard_pattern(args, split: str = '{split}') -> str:
  """The `dataset.shards` pattern of the shards make_shards writes (--num-shards `SPLIT-0000.tar` ... per
  split)."""
  return os.path.join(args.shards, f'{split}-{{0000..{args.num_shards - 1:04d}}}.tar')


def make_shards(args) -> None:
  """The folder's images as --num-shards tar shards per split (benchmarks/data/make_shards.py), unless
  there."""
  if glob.glob(os.path.join(args.shards, 'train-*.tar')):
    return
  if not (harness.ROOT / 'benchmarks' / 'data' / 'make_shards.py').exists():
    raise SystemExit(f'error: no shards in {args.shards} and no benchmarks/data/make_shards.py to make them')
  command = [sys.executable, '-m', 'benchmarks.data.make_shards', args.folder, '--out', args.shards,
             '--shards', str(args.num_shards), '--workers', str(os.cpu_count() or 1)]
  print(' '.join(command[1:]), flush=True)
  subprocess.run(command, cwd=harness.ROOT, check=True)


def read_once(paths: list[str]) -> int:
  return input_pipeline.read_files(paths)


# --- one pipeline, in its own process -------------------------------------------------------------


def pipeline_config(args, pipeline: str):
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  spec = PIPELINES[pipeline]
  config = defaults.get_config()
  if spec['source'] == 'folder':
    config.dataset.folder = args.folder
  else:
    config.dataset.shards = shard_pattern(args)
  config.dataset.sampling = spec['sampling']
  config.dataset.cache = 'none'
  config.dataset.image_size = args.image_size
  config.batch_size = args.batch_size
  if args.workers is not None:
    config.input.workers = args.workers
  return config


def measure_child(args) -> None:
  """Loads the pipeline's data, prints LOADED, times its batches, prints one JSON line."""
  from flaxtpu.data import loaders, pipeline  # pylint: disable=g-import-not-at-top
  config = pipeline_config(args, args.child)
  with harness.cpu_load() as loading:
    dataset = pipeline.load(config)
  print('LOADED', flush=True)
  workers = dataset.workers
  period = max(1, workers) * input_pipeline.grain_threads_per_worker()
  max_batches = -(-args.max_batches // period) * period  # whole cycles (input_pipeline.time_batches)
  first = args.round * (period + 2 + max_batches)  # each round its own steps
  batches = loaders.train_batches(dataset, seed=0, batch_size=args.batch_size, first_step=first,
                                  last_step=first + period + 2 + max_batches)
  try:
    timed = input_pipeline.time_batches(batches, period + 2, args.seconds, max_batches, period)
  finally:
    batches.close()
  print(json.dumps({**timed, 'train_images': len(dataset.train), 'workers': workers, 'cycle_batches': period,
                    'data_load_seconds': loading['seconds'],
                    'data_load_cpu_seconds': loading['cpu_seconds']}))


def resume_child(args) -> None:
  """Steps [k, k+m) of an iterator from step 0 against a fresh one from step k: equal, batch for batch?"""
  from flaxtpu.data import loaders, pipeline  # pylint: disable=g-import-not-at-top
  dataset = pipeline.load(pipeline_config(args, 'shards'))
  steps_per_epoch = len(dataset.train) // args.batch_size
  k = args.resume_at if args.resume_at >= 0 else steps_per_epoch - 1
  m = args.resume_steps
  started = time.perf_counter()
  continuing = [batch for step, batch in enumerate(loaders.train_batches(
      dataset, seed=0, batch_size=args.batch_size, first_step=0, last_step=k + m)) if step >= k]
  fresh = list(loaders.train_batches(dataset, seed=0, batch_size=args.batch_size, first_step=k,
                                     last_step=k + m))
  equal = [bool(np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels))
           for a, b in zip(continuing, fresh)]
  differs = [bool(not np.array_equal(a.labels, b.labels)) for a, b in zip(continuing[:-1], continuing[1:])]
  print(json.dumps({'resume_at_step': k, 'steps_compared': m, 'steps_per_epoch': steps_per_epoch,
                    'batches_equal': equal, 'exact': len(equal) == m and all(equal),
                    'consecutive_batches_differ': differs, 'seconds': time.perf_counter() - started}))


# --- the parent: rounds, memory sampling ----------------------------------------------------------


def run_child(args, pipeline: str, round_index: int) -> dict:
  """One pipeline in a child process, its process tree's memory sampled until it exits."""
  command = [sys.executable, '-m', 'benchmarks.input.shards_throughput', '--child', pipeline, '--round',
             str(round_index), *child_flags(args)]
  peak = {'rss': 0, 'pss': 0, 'rss_timed': 0, 'processes': 0}
  lines, loaded = [], threading.Event()
  process = subprocess.Popen(command, cwd=harness.ROOT, env=harness.subprocess_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)

  def read_output():
    for line in process.stdout:
      lines.append(line)
      if line.startswith('LOADED'):
        loaded.set()

  reader = threading.Thread(target=read_output, daemon=True)
  reader.start()
  watched = psutil.Process(process.pid)
  while process.poll() is None:
    rss, pss, count = input_memory.tree_memory(watched)
    peak['rss'], peak['pss'] = max(peak['rss'], rss), max(peak['pss'], pss)
    peak['processes'] = max(peak['processes'], count)
    if loaded.is_set():
      peak['rss_timed'] = max(peak['rss_timed'], rss)
    time.sleep(args.interval)
  reader.join()
  if process.returncode:
    raise RuntimeError(f'{" ".join(command)} failed (exit {process.returncode}):\n{"".join(lines)[-4000:]}')
  result = json.loads(next(line for line in reversed(lines) if line.startswith('{')))
  mib = 2**20
  result.update(peak_rss_mib=peak['rss'] / mib, peak_pss_mib=peak['pss'] / mib,
                peak_rss_batches_mib=peak['rss_timed'] / mib, max_processes=peak['processes'])
  return result


def child_flags(args) -> list[str]:
  flags = ['--folder', args.folder, '--shards', args.shards, '--num-shards', str(args.num_shards),
           '--image-size', str(args.image_size), '--batch-size', str(args.batch_size), '--seconds',
           str(args.seconds), '--max-batches', str(args.max_batches), '--resume-at', str(args.resume_at),
           '--resume-steps', str(args.resume_steps)]
  return flags + (['--workers', str(args.workers)] if args.workers is not None else [])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--folder', required=True, help='the image folder (made here when missing)')
  parser.add_argument('--shards', required=True, help='the folder of tar shards (made here when missing)')
  parser.add_argument('--n', type=int, default=100_000, help='train images, when the folder is made here')
  parser.add_argument('--classes', type=int, default=1000, help='classes, when the folder is made here')
  parser.add_argument('--num-shards', type=int, default=64, help='tar shards per split')
  parser.add_argument('--pipelines', default='folder,shards',
                      help=f'comma-separated, of {", ".join(PIPELINES)}')
  parser.add_argument('--image-size', type=int, default=64)
  parser.add_argument('--batch-size', type=int, default=128)
  parser.add_argument('--workers', type=int, default=None, help="input worker processes (default: flaxtpu's)")
  parser.add_argument('--seconds', type=float, default=10,
                      help='time each pipeline at least this long per round')
  parser.add_argument('--max-batches', type=int, default=400, help='... and at most this many batches')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--interval', type=float, default=0.2, help='seconds between memory samples')
  parser.add_argument('--resume-at', type=int, default=-1,
                      help="exact-resume check's k (-1: an epoch's steps - 1)")
  parser.add_argument('--resume-steps', type=int, default=3, help="exact-resume check's m")
  parser.add_argument('--no-resume-check', action='store_true')
  harness.out_argument(parser, 'shards_throughput.json')
  parser.add_argument('--child', choices=(*PIPELINES, 'resume'), help=argparse.SUPPRESS)  # internal
  parser.add_argument('--round', type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child == 'resume':
    return resume_child(args)
  if args.child:
    return measure_child(args)
  pipelines = [name for name in args.pipelines.split(',') if name]
  if unknown := set(pipelines) - set(PIPELINES):
    parser.error(f'--pipelines: unknown {sorted(unknown)}; choose from {", ".join(PIPELINES)}')
  args.folder, args.shards = os.path.abspath(args.folder), os.path.abspath(args.shards)
  make_folder(args)
  if not args.no_resume_check or any(PIPELINES[name]['source'] == 'shards' for name in pipelines):
    make_shards(args)
  files = [str(p) for p in pathlib.Path(args.folder).rglob('*') if p.is_file()]
  tars = sorted(glob.glob(os.path.join(args.shards, '*.tar')))
  started = time.perf_counter()
  size = read_once(files) + read_once(tars)
  print(f'{len(files):,} image files and {len(tars)} tar files ({size / 2**20:,.0f} MiB) read once first, '
        f'into the page cache: {time.perf_counter() - started:.1f} s', flush=True)

  measured = {name: [] for name in pipelines}
  for round_index in range(args.rounds):
    for name in (pipelines if round_index % 2 == 0 else pipelines[::-1]):
      row = run_child(args, name, round_index)
      measured[name].append(row)
      print(f'  round {round_index + 1}/{args.rounds} {name:14s} {row["images_per_sec"]:8,.0f} img/s  '
            f'{row["images_per_cpu_second"]:6,.0f} per CPU-s  peak RSS {row["peak_rss_mib"]:6,.0f} MiB '
            f'(during batches {row["peak_rss_batches_mib"]:,.0f})  load {row["data_load_seconds"]:.1f} s  '
            f'(others kept {row["other_cpu_load"]:.1f} cores busy)', flush=True)
  result = {'folder': args.folder, 'shards': shard_pattern(args, 'train'), 'num_shards': args.num_shards,
            'train_images': measured[pipelines[0]][0]['train_images'], 'image_size': args.image_size,
            'batch_size': args.batch_size, 'seconds': args.seconds, 'rounds': args.rounds,
            'cpu_count': os.cpu_count(), 'pipelines': {}}
  keys = ('images_per_sec', 'images_per_cpu_second', 'other_cpu_load', 'peak_rss_mib', 'peak_pss_mib',
          'peak_rss_batches_mib', 'data_load_seconds')
  print(f'{"pipeline":14s} {"img/s":>8s} {"per CPU-s":>9s} {"peak RSS MiB":>12s} {"(batches)":>9s} '
        f'{"PSS MiB":>8s} {"load s":>7s} {"others":>6s}')
  for name, rows in measured.items():
    medians = {key: harness.median(rows, key) for key in keys}
    result['pipelines'][name] = {**PIPELINES[name], **medians, 'workers': rows[0]['workers'], 'rounds': rows}
    print(f'{name:14s} {medians["images_per_sec"]:8,.0f} {medians["images_per_cpu_second"]:9,.0f} '
          f'{medians["peak_rss_mib"]:12,.0f} {medians["peak_rss_batches_mib"]:9,.0f} '
          f'{medians["peak_pss_mib"]:8,.0f} '
          f'{medians["data_load_seconds"]:7.1f} {medians["other_cpu_load"]:6.2f}')
  if 'folder' in measured and 'shards' in measured:
    folder, shards = result['pipelines']['folder'], result['pipelines']['shards']
    result['shards_over_folder'] = {key: shards[key] / max(folder[key], 1e-9) for key in keys}
    print(f'shards / folder: {result["shards_over_folder"]["images_per_sec"]:.2f}x the images/s, '
          f'{result["shards_over_folder"]["peak_rss_mib"]:.2f}x the peak RSS (medians of {args.rounds} '
          f'interleaved rounds of >= {args.seconds:g} s, batches of {args.batch_size} at '
          f'{args.image_size}x{args.image_size})')
  if not args.no_resume_check:
    command = [sys.executable, '-m', 'benchmarks.input.shards_throughput', '--child', 'resume',
               *child_flags(args)]
    output = subprocess.run(command, cwd=harness.ROOT, env=harness.subprocess_env(), capture_output=True,
                            text=True)
    if output.returncode:
      result['resume'] = {'error': (output.stdout + output.stderr)[-4000:]}
      print(f'exact resume from shards: FAILED to run:\n{result["resume"]["error"]}', file=sys.stderr)
    else:
      result['resume'] = json.loads(next(line for line in reversed(output.stdout.splitlines())
                                         if line.startswith('{')))
      r = result['resume']
      k, m = r['resume_at_step'], r['steps_compared']
      print(f'exact resume from shards: steps [{k}, {k + m}) '
            f'of a fresh iterator {"equal" if r["exact"] else "NOT equal"} to a continuing one\'s '
            f'({r["steps_per_epoch"]} steps per epoch)')
  harness.write_results(args.out, result)
  if 'error' in result.get('resume', {}) or not result.get('resume', {'exact': True})['exact']:
    sys.exit(1)


if __name__ == '__main__':
  main()
