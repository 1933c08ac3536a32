"""Planned per-device memory and step time of the train step for each remat policy.

    python -m benchmarks.device.memory_plan                                  # CPU-sized defaults
    python -m benchmarks.device.memory_plan --batch-size 256 --steps 20  # on a TPU/GPU, unchanged otherwise

For each (model, input size) and each `model.remat` policy it compiles the
real flaxtpu train step ahead of time (`--mode=plan` does the same), reads
the per-device bytes XLA plans (`compiled.memory_analysis()`), then times a
few steps on device-resident data (median step time after a warm-up step).
On CPU, XLA's scheduler does not turn remat into lower planned memory, so
the saving shows only on an accelerator; the recomputation shows everywhere
as a longer step.
"""

import argparse
import time

from benchmarks.shared import harness

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
  harness.out_argument(parser, 'memory_plan.json')
  args = parser.parse_args()
  harness.cpu_devices(args.cpu_devices)

  import jax  # pylint: disable=g-import-not-at-top

  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import compile_plan, parallel  # pylint: disable=g-import-not-at-top
  from flaxtpu.validation import config as config_lib  # pylint: disable=g-import-not-at-top

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
      _, state, batch, step, plan = compile_plan.compile_on_zeros(
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
             'step_seconds': harness.median(times), 'images_per_sec': batch_size / harness.median(times)}
      rows.append(row)
      print(f'{case:14s} {policy:34s} args {plan["argument_bytes"] / 2**20:8.1f} MiB  '
            f'temp {plan["temp_bytes"] / 2**20:8.1f} MiB  total {plan["total_bytes"] / 2**20:8.1f} MiB  '
            f'step {row["step_seconds"] * 1000:8.1f} ms  compile {plan["compile_seconds"]:.1f}s', flush=True)
      del state, step
  harness.write_results(args.out, {'platform': jax.default_backend(),
                                   'device_kind': jax.devices()[0].device_kind,
                                   'devices': jax.device_count(), 'jax': jax.__version__, 'rows': rows})


if __name__ == '__main__':
  main()
