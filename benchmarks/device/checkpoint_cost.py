"""What an asynchronous orbax save costs the training loop: step time with and without a save in flight.

    python -m benchmarks.device.checkpoint_cost [--model resnet20] [--cpu-devices 8]

Times the real train step on device-resident data: steps with no save, the
blocking part of `Checkpoints.save` (copying arrays off the devices before
the background write), and steps while the background write is in flight.
"""

import argparse
import tempfile
import time

from benchmarks.shared import harness


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='resnet20')
  parser.add_argument('--batch-size', type=int, default=128)
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--saves', type=int, default=3)
  parser.add_argument('--cpu-devices', type=int, default=8)
  harness.out_argument(parser, 'checkpoint_cost.json')
  args = parser.parse_args()
  harness.cpu_devices(args.cpu_devices)
  import jax  # pylint: disable=g-import-not-at-top

  from configs import cifar10_resnet  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import compile_plan  # pylint: disable=g-import-not-at-top
  from flaxtpu.weights import checkpoint  # pylint: disable=g-import-not-at-top

  config = cifar10_resnet.get_config()
  config.model.name, config.batch_size = args.model, args.batch_size
  placement, state, batch, step_fn, _ = compile_plan.compile_on_zeros(config, image_shape=(32, 32, 3),
                                                                       num_classes=10)

  def timed_step(state):
    started = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    return state, time.perf_counter() - started

  for _ in range(2):
    state, _ = timed_step(state)
  quiet, during, blocking, in_flight_steps = [], [], [], []
  with tempfile.TemporaryDirectory() as workdir:
    checkpoints = checkpoint.Checkpoints(workdir, config)
    for save in range(args.saves):
      for _ in range(args.steps):
        state, seconds = timed_step(state)
        quiet.append(seconds)
      started = time.perf_counter()
      checkpoints.save(100 + save, placement.to_saveable(state), {'step': save})
      blocking.append(time.perf_counter() - started)
      steps_while_saving = 0
      while checkpoints.is_saving() and steps_while_saving < 50:
        state, seconds = timed_step(state)
        during.append(seconds)
        steps_while_saving += 1
      in_flight_steps.append(steps_while_saving)
      checkpoints.wait()
    checkpoints.close()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(placement.to_saveable(state)))
  result = {'model': args.model, 'batch_size': args.batch_size, 'devices': jax.device_count(),
            'state_mib': state_bytes / 2**20,
            'step_ms_without_save': 1000 * harness.median(quiet),
            'step_ms_with_save_in_flight': 1000 * harness.median(during) if during else None,
            'save_call_blocking_ms': 1000 * harness.median(blocking),
            'steps_while_save_in_flight': in_flight_steps}
  print(f'{args.model}: state {result["state_mib"]:.1f} MiB; step {result["step_ms_without_save"]:.0f} ms '
        f'without a save, {result["step_ms_with_save_in_flight"] or float("nan"):.0f} ms with one in flight '
        f'({in_flight_steps} steps overlapped); '
        f'save() blocks the loop {result["save_call_blocking_ms"]:.0f} ms')
  harness.write_results(args.out, result)


if __name__ == '__main__':
  main()
