"""Cost of the on-device augmentations per batch: none, crop + flip, RandAugment, AugMix, colour
jitter + blur; the augmentation alone and the whole CIFAR-10 train step (configs/cifar10.py's CNN).

    python -m benchmarks.device.augment_cost [--steps 10] [--rounds 3] [--settings crop+flip,augmix]
    # -> benchmarks/results/local/augment_cost.json

Batch 128 of 32x32x3 images on one CPU device. Each setting is compiled once
(its compile seconds reported), then `--rounds` rounds in which every setting
runs `--steps` times (the order rotates each round), so machine noise hits all
alike: the median ms per batch of `augment.augment_batch` on random pixels and
of the jitted train step (on zeros), and the train step's ratio to crop + flip
(or to the first setting, without it).
"""

import argparse
import time

import numpy as np

from benchmarks.shared import harness

SETTINGS = {
    'none': {},
    'crop+flip': {'augment.crop_padding': 4, 'augment.flip': True},
    'randaugment': {'augment.crop_padding': 4, 'augment.flip': True, 'augment.policy': 'randaugment'},
    'augmix': {'augment.crop_padding': 4, 'augment.flip': True, 'augment.policy': 'augmix'},
    'color_jitter+blur': {'augment.crop_padding': 4, 'augment.flip': True, 'augment.color_jitter': 0.4,
                          'augment.blur': 0.5, 'augment.blur_kernel': 5},
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--settings', default=','.join(SETTINGS), help='comma-separated names of SETTINGS')
  harness.out_argument(parser, 'augment_cost.json')
  args = parser.parse_args()
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp

  from configs import cifar10
  from flaxtpu.augmentation import augment
  from flaxtpu.step import compile_plan
  images = jnp.asarray(np.random.default_rng(0).integers(0, 256, (128, 32, 32, 3), np.uint8))
  positions = jnp.arange(128)
  entries = []
  for name in args.settings.split(','):
    overrides = SETTINGS[name]
    config = cifar10.get_config()
    config.update_from_flattened_dict({'compilation_cache_dir': 'none', **overrides})
    started = time.perf_counter()
    augment_fn = jax.jit(lambda key, x, c=config.augment: augment.augment_batch(key, x, positions, c))
    jax.block_until_ready(augment_fn(jax.random.PRNGKey(0), images))
    augment_compile = time.perf_counter() - started
    started = time.perf_counter()
    _, state, batch, step, _ = compile_plan.compile_on_zeros(config, image_shape=(32, 32, 3), num_classes=10)
    step_compile = time.perf_counter() - started
    print(f'{name}: compiled in {augment_compile:.0f} s (augmentation) and {step_compile:.0f} s (train step)',
          flush=True)
    entries.append(dict(name=name, augment_fn=augment_fn, state=state, batch=batch, step=step,
                        augment_compile_s=augment_compile, step_compile_s=step_compile, augment_ms=[],
                        step_ms=[]))
  with harness.cpu_load() as load:
    for round_index in range(args.rounds):
      shift = round_index % len(entries)
      for entry in entries[shift:] + entries[:shift]:
        key = jax.random.PRNGKey(round_index)
        seconds = harness.timings(lambda e=entry: jax.block_until_ready(e['augment_fn'](key, images)),
                                  args.steps)
        entry['augment_ms'].append(1000 * harness.median(seconds))
        harness.train_step_ms(entry, args.steps)
  reference = harness.median(next((e for e in entries if e['name'] == 'crop+flip'), entries[0])['step_ms'])
  rows = [{'augmentation': e['name'], 'augment_ms_per_batch': round(harness.median(e['augment_ms']), 1),
           'train_step_ms': round(harness.median(e['step_ms']), 1),
           'step_ratio_to_crop_flip': round(harness.median(e['step_ms']) / reference, 3),
           'augment_compile_s': round(e['augment_compile_s'], 1),
           'step_compile_s': round(e['step_compile_s'], 1)} for e in entries]
  for row in rows:
    print(f"{row['augmentation']:>18}  augment {row['augment_ms_per_batch']:7.1f} ms  step "
          f"{row['train_step_ms']:7.1f} ms ({row['step_ratio_to_crop_flip']:.2f}x)  compile "
          f"{row['augment_compile_s']:.0f} s / {row['step_compile_s']:.0f} s")
  harness.write_results(args.out, {'model': 'cnn', 'batch_size': 128, 'image_size': 32, 'devices': 1,
                                   'steps': args.steps, 'rounds': args.rounds, 'rows': rows, 'load': load})


if __name__ == '__main__':
  main()
