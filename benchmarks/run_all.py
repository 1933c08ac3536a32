"""`make bench`: every side-by-side benchmark, one after another, results in benchmarks/results/local/.

    python -m benchmarks.run_all            # the quick set (about 15 minutes on 2 cores)
    python -m benchmarks.run_all --full     # adds resnet20 throughput and ResNet-50 memory plans

Every benchmark runs from a fresh clone with no data beyond the repository
(the CIFAR-10 input benchmark also runs when FLAXTPU_CIFAR10 names an image
folder). A benchmark that fails is reported and the rest still run; the exit
status is 1 if any failed. The committed results in benchmarks/results/ are
only replaced on purpose: copy them from local/ or pass --out to a script.
"""

import argparse
import os
import subprocess
import sys

from benchmarks.shared import harness


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--full', action='store_true')
  args = parser.parse_args()
  models = ['cnn', 'resnet20'] if args.full else ['cnn']
  cases = ['resnet18_32', 'resnet50_224'] if args.full else ['resnet18_32']
  failed = []
  for name, script_args in (
      ('device.throughput', ['--models', *models]),
      ('input.input_pipeline', ['--mode', 'cifar']),
      ('device.startup', []),
      ('device.checkpoint_cost', []),
      ('device.memory_plan', ['--cases', *cases]),
  ) + ((('device.conv_lowering', []),) if args.full else ()):
    command = f'python -m benchmarks.{name}'
    if name == 'input.input_pipeline' and not os.environ.get('FLAXTPU_CIFAR10'):
      print(f'== {command} skipped: set FLAXTPU_CIFAR10 to a CIFAR-10 image folder', flush=True)
      continue
    print(f'== {command} {" ".join(script_args)}', flush=True)
    returncode = subprocess.run([sys.executable, '-m', f'benchmarks.{name}', *script_args],
                                cwd=harness.ROOT).returncode
    if returncode:
      failed.append(f'{name} (exit {returncode})')
      print(f'== {command} FAILED with exit status {returncode}; going on', flush=True)
  if failed:
    print(f'error: {len(failed)} benchmark(s) failed: {", ".join(failed)}', file=sys.stderr)
    sys.exit(1)
  print('== all benchmarks done; results in benchmarks/results/local/', flush=True)


if __name__ == '__main__':
  main()
