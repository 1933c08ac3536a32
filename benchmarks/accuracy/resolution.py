"""Issue 41's resolution levers on CIFAR-10 (`configs/cifar10.py`, the Keras-twin CNN): progressive
resizing (`augment.train_sizes`) beside a fixed size at equal steps (accuracy, images/s, wall time),
and the train-test resolution effect: each trained run scored at several `eval.image_size` values.

    python -m benchmarks.accuracy.resolution --folder=/path/to/cifar10 --workdir=runs/resolution
    python -m benchmarks.accuracy.resolution --folder=... --steps=1200 --runs=fixed_32,progressive_16_24_32 \
        --skip_evals --workdir=runs/resolution_1200

Every number comes from the CLI (`flaxtpu.main` in a fresh process per run and per evaluation):
results.json's eval_accuracy and train_images_per_sec, eval.json's eval_accuracy. Runs already
finished in --workdir are reused (the CLI resumes a finished run to its results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.shared import harness

# name -> augment.train_sizes ('' = the pipeline's 32 px throughout)
RUNS = {
    'fixed_32': '',
    'progressive_16_24_32': '((0.0, 16), (0.5, 24), (0.75, 32))',
    'fixed_24': '((0.0, 24),)',  # trained at 24 px (every batch resized down), scored at several sizes
}
EVAL_SIZES = {'fixed_32': (24, 28, 32, 36, 40), 'fixed_24': (20, 24, 28, 32)}


def _cli(workdir: str, args: argparse.Namespace, *extra: str) -> None:
  command = [sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10.py', f'--workdir={workdir}',
             f'--config.dataset.folder={args.folder}', f'--config.dataset.train_split=train[:{args.train}]',
             f'--config.dataset.eval_split=test[:{args.eval}]', f'--config.num_train_steps={args.steps}',
             f'--config.eval_every_steps={args.steps}', f'--config.checkpoint_every_steps={args.steps}',
             '--config.log_every_steps=50', '--config.compilation_cache_dir=none', *extra]
  print('+', ' '.join(command[1:]), flush=True)
  subprocess.run(command, check=True, cwd=harness.ROOT, stdout=subprocess.DEVNULL if args.quiet else None)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--folder', default=os.environ.get('FLAXTPU_CIFAR10', ''))
  parser.add_argument('--workdir', default='runs/resolution')
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--train', type=int, default=20000)  # train[:N]
  parser.add_argument('--eval', type=int, default=2000)  # test[:N]
  parser.add_argument('--out', default=os.path.join(harness.ROOT, 'benchmarks', 'results', 'local',
                                                     'resolution.json'))
  parser.add_argument('--runs', default=','.join(RUNS), help='which of ' + ', '.join(RUNS))
  parser.add_argument('--skip_evals', action='store_true', help='no eval.image_size sweep')
  parser.add_argument('--quiet', action='store_true')
  args = parser.parse_args()
  if not args.folder:
    raise SystemExit('error: give --folder=/path/to/cifar10 (split/class/image) or set FLAXTPU_CIFAR10')
  measured = {'settings': {'config': 'configs/cifar10.py', 'train_split': f'train[:{args.train}]',
                           'eval_split': f'test[:{args.eval}]', 'steps': args.steps, 'batch_size': 128}}
  for name in args.runs.split(','):
    sizes = RUNS[name]
    workdir = os.path.join(args.workdir, name)
    _cli(workdir, args, *([f'--config.augment.train_sizes={sizes}'] if sizes else []))
    with open(os.path.join(workdir, 'results.json')) as f:
      results = json.load(f)
    keys = ('eval_accuracy', 'eval_loss', 'train_loss', 'train_images_per_sec', 'wall_time_s',
            'train_image_sizes')
    row = {key: results.get(key) for key in keys}
    row['eval_at'] = {}
    for size in () if args.skip_evals else EVAL_SIZES.get(name, ()):
      _cli(workdir, args, '--mode=eval', f'--config.eval.image_size={size}')
      with open(os.path.join(workdir, 'eval.json')) as f:
        row['eval_at'][size] = json.load(f)['eval_accuracy']
    measured[name] = row
    print(name, json.dumps(row), flush=True)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(measured, f, indent=1)
  print('wrote', args.out)


if __name__ == '__main__':
  main()
