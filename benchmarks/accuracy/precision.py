"""bfloat16 beside float32 on a short recipe (issue 51's numerics): the same config, data and seeds
in each dtype, the accuracies side by side, and the gap between the dtypes' means beside the
spread of the seeds.

    python -m benchmarks.accuracy.precision --folder=/path/to/cifar10 --workdir=runs/precision
    python -m benchmarks.accuracy.precision --folder=... --config=configs/cifar10_resnet.py --seeds=0,1

Every number comes from the CLI (`flaxtpu.main`, a fresh process per run): results.json's
eval_accuracy, train_loss and train_images_per_sec. Runs already finished in --workdir are reused
(the CLI resumes a finished run to its results). What bfloat16 keeps in float32 is listed in
docs/performance.md ("bfloat16").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks.shared import harness

DTYPES = ('float32', 'bfloat16')


def run(args: argparse.Namespace, dtype: str, seed: int) -> dict:
  workdir = os.path.join(args.workdir, f'{dtype}_seed{seed}')
  command = [sys.executable, '-m', 'flaxtpu.main', f'--config={args.config}', f'--workdir={workdir}',
             f'--config.dataset.folder={args.folder}', f'--config.dtype={dtype}', f'--config.seed={seed}',
             '--config.compilation_cache_dir=none', *args.overrides]
  print('+', ' '.join(command[1:]), flush=True)
  subprocess.run(command, check=True, cwd=harness.ROOT, stdout=subprocess.DEVNULL if args.quiet else None,
                 env=harness.subprocess_env())
  with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
    results = json.load(f)
  keys = ('eval_accuracy', 'eval_loss', 'train_loss', 'train_images_per_sec', 'wall_time_s')
  return {key: results.get(key) for key in keys}


def summarise(runs: dict) -> dict:
  """Per dtype: mean and standard deviation of eval_accuracy over the seeds; then the gap."""
  summary = {}
  for dtype, rows in runs.items():
    accuracies = [row['eval_accuracy'] for row in rows]
    summary[dtype] = {'accuracies': accuracies, 'mean': statistics.mean(accuracies),
                      'stdev': statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0}
  if set(DTYPES) <= set(summary):
    summary['bfloat16_minus_float32'] = summary['bfloat16']['mean'] - summary['float32']['mean']
    summary['seed_stdev'] = max(summary[dtype]['stdev'] for dtype in DTYPES)
  return summary


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--folder', default=os.environ.get('FLAXTPU_CIFAR10', ''))
  parser.add_argument('--config', default='configs/cifar10.py')
  parser.add_argument('--workdir', default='runs/precision')
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated')
  parser.add_argument('--dtypes', default=','.join(DTYPES))
  parser.add_argument('--quiet', action='store_true')
  harness.out_argument(parser, 'precision.json')
  args, args.overrides = parser.parse_known_args()  # more --config.KEY=VALUE flags, for every run
  if unknown := [flag for flag in args.overrides if not flag.startswith('--config.')]:
    parser.error(f'unrecognized arguments: {" ".join(unknown)}')
  if not args.folder:
    raise SystemExit('error: give --folder=/path/to/cifar10 (split/class/image) or set FLAXTPU_CIFAR10')
  seeds = [int(seed) for seed in args.seeds.split(',')]
  runs = {dtype: [] for dtype in args.dtypes.split(',')}
  for seed in seeds:  # dtypes alternate, so a slower stretch of a shared machine hits both
    for dtype in runs:
      runs[dtype].append({'seed': seed, **run(args, dtype, seed)})
      print(f'  {dtype} seed {seed}: eval_accuracy {runs[dtype][-1]["eval_accuracy"]:.4f}', flush=True)
  summary = summarise(runs)
  for dtype in runs:
    print(f'{dtype:9s} {summary[dtype]["mean"]:.4f} +- {summary[dtype]["stdev"]:.4f} '
          f'({", ".join(f"{a:.4f}" for a in summary[dtype]["accuracies"])})')
  if 'bfloat16_minus_float32' in summary:
    print(f'bfloat16 - float32: {summary["bfloat16_minus_float32"]:+.4f} (seeds spread: stdev '
          f'{summary["seed_stdev"]:.4f})')
  harness.write_results(args.out, {'config': args.config, 'folder': args.folder, 'seeds': seeds,
                                   'overrides': args.overrides, 'runs': runs, 'summary': summary})


if __name__ == '__main__':
  main()
