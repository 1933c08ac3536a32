"""Is the input pipeline ever what the train step waits on? Images/s of each, side by side.

    python benchmarks/input_pipeline.py [--data ../shared/datasets/cifar10] [--model resnet20]

The pipeline is everything between the in-memory uint8 arrays and the
augmented float batch on the devices: index by (seed, step), slice, the
prefetch thread, host -> device transfer into the batch sharding, and the
jitted augmentation (crop + flip + normalise). Decoding is done once before
timing, as in training. The step is flaxtpu's real train step (which also
augments) on the same batches. Interleaved repeats, medians.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data', default=os.path.join(ROOT, '..', 'shared', 'datasets', 'cifar10'))
  parser.add_argument('--model', default='resnet20')
  parser.add_argument('--batch-size', type=int, default=128)
  parser.add_argument('--batches', type=int, default=40, help='pipeline batches per repeat')
  parser.add_argument('--steps', type=int, default=10, help='train steps per repeat')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--cpu-devices', type=int, default=8)
  parser.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'results', 'input_pipeline.json'))
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={args.cpu_devices}')

  import jax  # pylint: disable=g-import-not-at-top

  from configs import cifar10_resnet  # pylint: disable=g-import-not-at-top
  from flaxtpu import augment, data, parallel, steps  # pylint: disable=g-import-not-at-top
  from flaxtpu.config import run_length  # pylint: disable=g-import-not-at-top

  config = cifar10_resnet.get_config()  # crop + flip + standardise: the heaviest recipe
  config.dataset.folder, config.model.name, config.batch_size = args.data, args.model, args.batch_size
  dataset = data.load(config)
  length = run_length(config, len(dataset.train))
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length)
  placement = steps.place(task, parallel.make_mesh(config), config)
  state = steps.create_state(task, placement, config.seed)

  @jax.jit
  def augment_on_device(key, images):
    positions = jax.numpy.arange(images.shape[0])
    return augment.normalize(augment.augment_batch(key, images, positions, task.augment), task.mean, task.std)

  def device_batches(first_step, count):
    return data.prefetch(placement.put_train_batch(tuple(batch)[:2]) for batch in data.train_batches(
        dataset.train, seed=0, batch_size=args.batch_size, first_step=first_step, last_step=first_step + count))

  def pipeline_rate(first_step):
    key = jax.random.PRNGKey(0)
    started = time.perf_counter()
    for images, _ in device_batches(first_step, args.batches):
      out = augment_on_device(key, images)
    jax.block_until_ready(out)
    return args.batches * args.batch_size / (time.perf_counter() - started)

  step_fn, _ = placement.compile_train_step(state, next(device_batches(0, 1)))

  def step_rate(state, first_step):
    batches = list(device_batches(first_step, args.steps))  # already on device: time the step only
    jax.block_until_ready(batches)
    started = time.perf_counter()
    for batch in batches:
      state, _ = step_fn(state, batch)
      jax.block_until_ready(state)
    return state, args.steps * args.batch_size / (time.perf_counter() - started)

  pipeline_rate(0)  # warm-up: compile the augmentation, fill caches
  state, _ = step_rate(state, 0)
  pipeline, step = [], []
  for repeat in range(args.repeats):
    pipeline.append(pipeline_rate(1000 * (repeat + 1)))
    state, rate = step_rate(state, 1000 * (repeat + 1))
    step.append(rate)
  result = {'model': args.model, 'batch_size': args.batch_size, 'devices': jax.device_count(),
            'pipeline_images_per_sec': statistics.median(pipeline),
            'step_images_per_sec': statistics.median(step),
            'pipeline_repeats': pipeline, 'step_repeats': step}
  result['ratio'] = result['pipeline_images_per_sec'] / result['step_images_per_sec']
  print(f'input pipeline {result["pipeline_images_per_sec"]:9.0f} img/s   train step ({args.model}) '
        f'{result["step_images_per_sec"]:7.0f} img/s   pipeline / step = {result["ratio"]:.1f}x')
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=2)


if __name__ == '__main__':
  main()
