"""Does host memory grow with the dataset? Peak RSS of a streaming CLI run on a big and a small image folder.

    python -m benchmarks.data.make_image_folder --out /data/gen1000  # 100,000 train images
    python -m benchmarks.data.make_image_folder --out /data/gen1000_small --train-per-class 10  # 10,000
    python -m benchmarks.input.input_memory --big /data/gen1000 --small /data/gen1000_small

Trains the same short run (`configs/cifar10.py`, the cnn, batch 64, --steps
steps at --image-size, `dataset.cache=none`, the compilation cache off, eval
and a checkpoint only at the last step) through `python -m flaxtpu.main` on
each folder, and samples every --interval s the resident memory of the whole
process tree (the trainer plus its grain worker processes), summed. RSS counts
pages that processes share once per process; PSS, which splits them, is
recorded too. Streaming holds the file list, not the pixels, so the two peaks
should be within 10% of each other although one folder has 10x the images.
Also reports the time to the first step (the trainer's own log line: data
scan, init, compile) and the peaks before and after it. With --rounds > 1 the
folders alternate and the medians are reported.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import psutil

from benchmarks.shared import harness

FIRST_STEP = re.compile(r'first step done ([\d.]+) s after the command')
DATA_LINE = re.compile(r'data: (\d+) train / (\d+) eval examples')


def tree_memory(process: psutil.Process) -> tuple[int, int, int]:
  """(RSS summed, PSS summed, process count) of a process and all its descendants."""
  rss = pss = count = 0
  try:
    members = [process, *process.children(recursive=True)]
  except psutil.Error:
    return 0, 0, 0
  for member in members:
    try:
      info = member.memory_full_info()  # Linux: also PSS (from /proc/PID/smaps_rollup)
    except psutil.AccessDenied:
      try:
        info = member.memory_info()
      except psutil.Error:
        continue
    except psutil.Error:
      continue
    rss += info.rss
    pss += getattr(info, 'pss', info.rss)
    count += 1
  return rss, pss, count


def run_once(folder: str, args, workdir: str) -> dict:
  """One CLI training run on `folder`, its process tree sampled until it exits."""
  command = [sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10.py', f'--workdir={workdir}',
             f'--config.dataset.folder={folder}', f'--config.dataset.image_size={args.image_size}',
             '--config.dataset.cache=none', f'--config.model.name={args.model}',
             f'--config.batch_size={args.batch_size}', f'--config.num_train_steps={args.steps}',
             f'--config.eval_every_steps={args.steps}', f'--config.checkpoint_every_steps={args.steps}',
             f'--config.log_every_steps={args.steps}', '--config.compilation_cache_dir=none']
  if args.workers is not None:
    command.append(f'--config.input.workers={args.workers}')
  log_path = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + '.log')
  peak = {'rss': 0, 'pss': 0, 'rss_before_first_step': 0, 'rss_after_first_step': 0, 'processes': 0,
          'rss_at_s': 0.0}
  seen_first_step, log_text = False, ''
  with open(log_path, 'w', encoding='utf-8') as log, open(log_path, encoding='utf-8') as tail:
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=harness.ROOT, env=harness.subprocess_env(), stdout=log,
                               stderr=subprocess.STDOUT)
    watched = psutil.Process(process.pid)
    while process.poll() is None:
      rss, pss, count = tree_memory(watched)
      log_text += tail.read()
      seen_first_step = seen_first_step or bool(FIRST_STEP.search(log_text))
      if rss > peak['rss']:
        peak['rss'], peak['rss_at_s'] = rss, time.perf_counter() - started
      phase = 'rss_after_first_step' if seen_first_step else 'rss_before_first_step'
      peak[phase] = max(peak[phase], rss)
      peak['pss'], peak['processes'] = max(peak['pss'], pss), max(peak['processes'], count)
      time.sleep(args.interval)
    wall = time.perf_counter() - started
    log_text += tail.read()
  if process.returncode != 0:
    raise RuntimeError(f'{" ".join(command)} failed (exit {process.returncode}); its output ends:\n'
                       f'{log_text[-3000:]}')
  first_step, examples = FIRST_STEP.search(log_text), DATA_LINE.search(log_text)
  mib = lambda value: value / 2**20
  return {'folder': folder, 'train_examples': int(examples[1]) if examples else None,
          'eval_examples': int(examples[2]) if examples else None,
          'peak_rss_mib': mib(peak['rss']), 'peak_pss_mib': mib(peak['pss']),
          'peak_rss_before_first_step_mib': mib(peak['rss_before_first_step']),
          'peak_rss_after_first_step_mib': mib(peak['rss_after_first_step']),
          'peak_rss_at_s': peak['rss_at_s'], 'max_processes': peak['processes'],
          'time_to_first_step_s': float(first_step[1]) if first_step else None, 'process_wall_s': wall}


def median_row(rows: list[dict]) -> dict:
  merged = dict(rows[0])
  for key, value in rows[0].items():
    if isinstance(value, (int, float)) and all(row[key] is not None for row in rows):
      merged[key] = harness.median(rows, key)
  return merged


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--big', required=True, help='image folder with many images (e.g. 100,000 train)')
  parser.add_argument('--small', required=True, help='the same kind of folder with fewer (e.g. 10,000)')
  parser.add_argument('--steps', type=int, default=50)
  parser.add_argument('--image-size', type=int, default=64)
  parser.add_argument('--batch-size', type=int, default=64)
  parser.add_argument('--model', default='cnn')
  parser.add_argument('--workers', type=int, default=None,
                      help='config.input.workers (default: the config\'s, one per core but one)')
  parser.add_argument('--interval', type=float, default=0.2, help='seconds between memory samples')
  parser.add_argument('--rounds', type=int, default=1, help='runs per folder, alternating; medians')
  harness.out_argument(parser, 'input_memory.json')
  args = parser.parse_args()

  runs = {'small': [], 'big': []}
  with tempfile.TemporaryDirectory() as tmp:
    for round_index in range(args.rounds):
      for name in ('small', 'big'):
        workdir = os.path.join(tmp, f'{name}_{round_index}')
        runs[name].append(run_once(getattr(args, name), args, workdir))
        row = runs[name][-1]
        print(f'  round {round_index + 1}/{args.rounds} {name}: peak RSS {row["peak_rss_mib"]:.0f} MiB, '
              f'first step after {row["time_to_first_step_s"]}s', flush=True)
  rows = {name: median_row(rows) for name, rows in runs.items()}
  small, big = rows['small'], rows['big']
  ratio = big['peak_rss_mib'] / small['peak_rss_mib']
  pss_ratio = big['peak_pss_mib'] / small['peak_pss_mib']
  result = {'steps': args.steps, 'image_size': args.image_size, 'batch_size': args.batch_size,
            'model': args.model, 'workers': args.workers, 'cpu_count': os.cpu_count(),
            'interval_s': args.interval, 'rounds': args.rounds, 'small': small, 'big': big,
            'peak_rss_ratio_big_over_small': ratio, 'peak_pss_ratio_big_over_small': pss_ratio,
            'within_10_percent': abs(ratio - 1) <= 0.10, 'runs': runs}
  for name, row in (('small', small), ('big', big)):
    print(f'{name:5s} {row["train_examples"] or 0:>9,} train images: '
          f'peak RSS {row["peak_rss_mib"]:7.0f} MiB (PSS {row["peak_pss_mib"]:6.0f}; '
          f'before / after the first step {row["peak_rss_before_first_step_mib"]:.0f}'
          f' / {row["peak_rss_after_first_step_mib"]:.0f}) over up to {row["max_processes"]} processes; '
          f'first step after {row["time_to_first_step_s"] or float("nan"):.1f} s, '
          f'process {row["process_wall_s"]:.1f} s')
  print(f'peak RSS big / small = {ratio:.3f} (PSS {pss_ratio:.3f}); goal within 10%: '
        f'{"yes" if result["within_10_percent"] else "NO"}')
  harness.write_results(args.out, result)


if __name__ == '__main__':
  main()
