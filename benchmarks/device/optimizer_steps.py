"""Train-step time of every optimizer of experiments/cifar10_optimizers.py, side by side in one process.

    python -m benchmarks.device.optimizer_steps [--steps 10] [--rounds 3]
    # -> benchmarks/results/local/optimizer_steps.json

ResNet-20 at batch 128 on 32x32x3 zeros, jit over 8 CPU devices: each sweep
run's config (optimizer, rate, decay, its own keys) compiled once with
`compile_plan.compile_on_zeros`, then `--rounds` rounds in which every optimizer
takes `--steps` steps (the order rotates each round), so that machine noise
hits all alike. Prints the median ms per step and its ratio to the recipe's
SGD + Nesterov; the optimizer's share of a step is what differs (the forward
and backward passes are the same).
"""

import argparse

from benchmarks.shared import harness


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--rounds', type=int, default=3)
  harness.out_argument(parser, 'optimizer_steps.json')
  args = parser.parse_args()
  harness.cpu_devices(8)
  # pylint: disable=g-import-not-at-top
  from experiments import cifar10_optimizers
  from flaxtpu.step import compile_plan
  compiled = []
  for overrides in cifar10_optimizers.get_sweep():
    config = cifar10_optimizers.get_config()
    config.update_from_flattened_dict(overrides)
    config.compilation_cache_dir = 'none'
    _, state, batch, step, _ = compile_plan.compile_on_zeros(config, image_shape=(32, 32, 3), num_classes=10)
    name = overrides['optimizer.name'] + (' (no momentum)' if overrides.get('optimizer.momentum') == 0.0
                                          else '')
    compiled.append({'name': name, 'state': state, 'batch': batch, 'step': step, 'step_ms': []})
  with harness.cpu_load() as load:
    for round_index in range(args.rounds):
      order = compiled[round_index % len(compiled):] + compiled[:round_index % len(compiled)]
      for entry in order:
        harness.train_step_ms(entry, args.steps)
  reference = harness.median(compiled[0]['step_ms'])
  rows = [{'optimizer': entry['name'], 'ms_per_step': round(harness.median(entry['step_ms']), 1),
           'ratio_to_sgd_nesterov': round(harness.median(entry['step_ms']) / reference, 3),
           'rounds_ms': [round(ms, 1) for ms in entry['step_ms']]} for entry in compiled]
  for row in rows:
    print(f"{row['optimizer']:>22}  {row['ms_per_step']:8.1f} ms/step  {row['ratio_to_sgd_nesterov']:.3f}x")
  harness.write_results(args.out, {'model': 'resnet20', 'batch_size': 128, 'devices': 8, 'steps': args.steps,
                                   'rounds': args.rounds, 'rows': rows, 'load': load})


if __name__ == '__main__':
  main()
