"""Planned per-device memory and step time of the train step for each remat policy.

    python benchmarks/memory_plan.py                                  # CPU-sized defaults
    python benchmarks/memory_plan.py --batch-size 256 --steps 20      # on a TPU/GPU, unchanged otherwise

For each (model, input size) and each `model.remat` policy it compiles the
real flaxtpu train step ahead of time (`--mode=plan` does the same), reads
the per-device bytes XLA plans (`compiled.memory_analysis()`), then times a
few steps on device-resident data (median step time after a warm-up step).
On CPU, XLA's scheduler does not turn remat into lower planned memory, so
the saving shows only on an accelerator; the recomputation shows everywhere
as a longer step.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CASES = {  # name -> (model, image size, classes)
    'resnet50_224': ('resnet50', 224, 1000),
    'resnet18_32': ('resnet18', 32, 10),
}
POLICIES = ('none', 'full', 'dots_saveable', 'nothing_saveable', 'dots_with_no_batch_dims_saveable')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--cases', nargs='+', default=list(CASES), choices=list(CASES))
  parser.add_argument('--policies', nargs='+', default=list(POLICIES), choices=POLICIES)
  parser.add_argument('--batch-size', type=int, default=0,
                      help='global batch (default: 256 on accelerators, 16 on CPU)')
  parser.add_argument('--steps', type=int, default=3, help='timed steps per policy')
  parser.add_argument('--cpu-devices', type=int, default=8)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'results', 'local', 'memory_plan.json'))
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={args.cpu_devices}')

  import jax  # pylint: disable=g-import-not-at-top

  from flaxtpu import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxtpu import defaults, parallel, steps  # pylint: disable=g-import-not-at-top

  batch_size = args.batch_size or (16 if jax.default_backend() == 'cpu' else 256)
  print(f'{parallel.describe_devices()}  jax {jax.__version__}  global batch {batch_size}  {args.dtype}')
  rows = []
  for case in args.cases:
    model_name, size, classes = CASES[case]
    for policy in args.policies:
      config = defaults.get_config()
      config.model.name, config.model.remat, config.dtype = model_name, policy, args.dtype
      config.batch_size, config.optimizer.name = batch_size, 'sgd'
      config_lib.validate(config)
      _, state, batch, step, plan = steps.compile_on_zeros(
          config, image_shape=(size, size, 3), num_classes=classes, num_train_examples=100 * batch_size)
      state, _ = step(state, batch)  # warm-up
      jax.block_until_ready(state)
      times = []
      for _ in range(args.steps):
        started = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - started)
      row = {'case': case, 'remat': policy, 'batch_size': batch_size, **plan,
             'step_seconds': statistics.median(times),
             'images_per_sec': batch_size / statistics.median(times)}
      rows.append(row)
      print(f'{case:14s} {policy:34s} args {plan["argument_bytes"] / 2**20:8.1f} MiB  '
            f'temp {plan["temp_bytes"] / 2**20:8.1f} MiB  total {plan["total_bytes"] / 2**20:8.1f} MiB  '
            f'step {row["step_seconds"] * 1000:8.1f} ms  compile {plan["compile_seconds"]:.1f}s', flush=True)
      del state, step
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump({'platform': jax.default_backend(), 'device_kind': jax.devices()[0].device_kind,
               'devices': jax.device_count(), 'jax': jax.__version__, 'rows': rows}, f, indent=2)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
