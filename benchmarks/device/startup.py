"""Time to the first train step, cold and warm, with JAX's persistent compilation cache.

    python -m benchmarks.device.startup                                  # the embedded digits recipe
    FLAXTPU_CIFAR10=/path/to/cifar10 python -m benchmarks.device.startup  # ResNet-20 on a CIFAR-10 folder

Runs the CLI twice on one fresh cache directory (the first run fills it, the
second reads it), and once more with the cache off, all for one step. Reports
`time_to_first_step_s` from results.json (data, init, compile, first step)
and the whole process wall time (which adds Python and library imports).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.shared import harness


def run_once(config: str, data: str, cache_dir: str, workdir: str) -> dict:
  started = time.perf_counter()
  data_args = [f'--config.dataset.folder={data}', '--config.eval_batch_size=1000'] if data else []
  subprocess.run([sys.executable, '-m', 'flaxtpu.main', f'--config={config}', f'--workdir={workdir}',
                  '--config.num_train_steps=1', f'--config.compilation_cache_dir={cache_dir}', *data_args],
                 cwd=harness.ROOT, env=harness.subprocess_env(), check=True, capture_output=True)
  wall = time.perf_counter() - started
  with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
    results = json.load(f)
  return {'time_to_first_step_s': results['time_to_first_step_s'],
          'compile_seconds': results['memory_plan']['compile_seconds'], 'process_wall_s': wall}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  cifar10 = os.environ.get('FLAXTPU_CIFAR10', '')
  parser.add_argument('--data', default=cifar10, help='an image folder (default: $FLAXTPU_CIFAR10; '
                      'none: the embedded digits)')
  parser.add_argument('--config', default='configs/cifar10_resnet.py' if cifar10 else 'configs/digits.py')
  harness.out_argument(parser, 'startup.json')
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, 'cache')
    rows = {
        'cache_off': run_once(args.config, args.data, 'none', os.path.join(tmp, 'off')),
        'cold_cache': run_once(args.config, args.data, cache, os.path.join(tmp, 'cold')),
        'warm_cache': run_once(args.config, args.data, cache, os.path.join(tmp, 'warm')),
    }
  for name, row in rows.items():
    print(f'{name:11s} first step after {row["time_to_first_step_s"]:6.1f}s '
          f'(train-step compile {row["compile_seconds"]:5.1f}s), process {row["process_wall_s"]:6.1f}s')
  harness.write_results(args.out, {'config': args.config, **rows})


if __name__ == '__main__':
  main()
