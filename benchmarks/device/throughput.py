"""Training throughput of flaxtpu against its own floor and against Keras and PyTorch, in one run.

    python -m benchmarks.device.throughput                       # cnn and resnet20, every contestant
    python -m benchmarks.device.throughput --models cnn --repeats 3

Contestants, all at the same global batch (128) and input shape (32x32x3):
  flaxtpu_loop_jit    the real CLI loop (data pipeline, augmentation, logging), jit over 8 CPU devices
  flaxtpu_loop_pmap   the same with parallelism=pmap
  flaxtpu_step        a bare jitted train step on device-resident data, 8 CPU devices (the loop's floor)
  flaxtpu_step_1dev   the same on XLA's single CPU device: flaxtpu before the fast CPU path
  keras_tf            Keras 3, TensorFlow backend, jit_compile=True       (benchmarks/shared/peers.py)
  keras_tf_nojit      Keras 3, TensorFlow backend, no XLA (oneDNN kernels)
  keras_jax           Keras 3, JAX backend
  torch               PyTorch eager (optional: pip install -e '.[bench]')
Each contestant runs in its own process; repeats are interleaved (every
contestant once per round) so that machine noise hits all alike; the table
gives medians and ratios flaxtpu / peer, and each rate as GFLOP/s and as a
share of numpy's SGEMM on the same cores (measured in every round too). A
training image costs 3x the forward pass's FLOPs (XLA's cost analysis).
Also: batch-64 predict latency of flaxtpu's jitted predict vs Keras'
`@tf.function(jit_compile=True)` predict.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.shared import harness, peers

STEPS = {'cnn': 40, 'resnet20': 8}
RECIPES = {'cnn': 'configs/cifar10.py', 'resnet20': 'configs/cifar10_resnet.py'}


def _env(devices: int, model: str = '') -> dict:
  """XLA's flags for `devices` CPU devices and, for `model`, its recipe's
  `cpu_convolutions` (as the CLI sets)."""
  env = harness.subprocess_env(devices)
  if model:  # what the CLI adds to these flags for the recipe (the device count above stays)
    from flaxtpu import main as main_lib  # pylint: disable=g-import-not-at-top
    env['XLA_FLAGS'], _ = main_lib.cpu_xla_flags(_recipe(model), 'train', env['XLA_FLAGS'])
  return env


def _recipe(model: str):
  """The config of RECIPES[model], the file the loop contestants train with."""
  module = importlib.import_module(RECIPES[model].removesuffix('.py').replace('/', '.'))
  return module.get_config()


def synthetic_folder(root: str, per_class: int) -> str:
  """A CIFAR-shaped image folder (10 classes of random 32x32 PNGs): content does not matter here."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  for split, count in (('train', per_class), ('test', 13)):
    for label in range(10):
      folder = os.path.join(root, split, f'class{label}')
      os.makedirs(folder, exist_ok=True)
      for i in range(count):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(f'{folder}/{i}.png')
  return root


def measure_loop(model: str, parallelism: str, folder: str, steps: int) -> float:
  """Median images/s of the CLI's logged intervals after the first (which warms up)."""
  with tempfile.TemporaryDirectory() as workdir:
    subprocess.run(
        [sys.executable, '-m', 'flaxtpu.main', f'--config={RECIPES[model]}', f'--workdir={workdir}',
         f'--config.dataset.folder={folder}', f'--config.parallelism={parallelism}',
         f'--config.num_train_steps={steps}', f'--config.log_every_steps={max(1, steps // 8)}',
         f'--config.eval_every_steps={steps}', f'--config.checkpoint_every_steps={steps}'],
        cwd=harness.ROOT, env=_env(8), check=True, capture_output=True)
    with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
      rates = [row['images_per_sec'] for row in map(json.loads, f) if 'images_per_sec' in row]
  return harness.median(rates[1:])


def train_flops_per_image(model: str) -> float:
  """3x the forward pass's FLOPs per image (forward + two backward GEMMs),
  as XLA's cost analysis counts them."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from flaxtpu import models  # pylint: disable=g-import-not-at-top
  net = models.create(model, num_classes=10, image_shape=(32, 32, 3))
  images = jnp.zeros((8, 32, 32, 3))
  variables = net.init(jax.random.PRNGKey(0), images[:1], train=False)
  forward = jax.jit(lambda v, x: net.apply(v, x, train=False)).lower(variables, images)
  return 3 * forward.cost_analysis()['flops'] / len(images)


def measure_in_subprocess(mode: str, model: str, devices: int, steps: int) -> float:
  out = subprocess.run([sys.executable, '-m', 'benchmarks.device.throughput', f'--worker={mode}',
                        f'--models={model}', f'--steps={steps}'],
                       cwd=harness.ROOT, env=_env(devices, model), check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])['value']


def worker(mode: str, model: str, steps: int) -> float:
  """In this process: a bare train step (img/s) or predict latency (ms), on device-resident data."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from flaxtpu.step import compile_plan  # pylint: disable=g-import-not-at-top
  config = _recipe(model)
  config.model.name, config.batch_size = model, 128 if mode == 'step' else 64
  # The train step as training and --mode=plan build it; timed on random data, not its zero batch.
  placement, state, _, step, _ = compile_plan.compile_on_zeros(config, image_shape=(32, 32, 3),
                                                                num_classes=10)
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (config.batch_size, 32, 32, 3), np.uint8)
  if mode == 'predict':
    (device_images,) = placement.put_eval_batch((images,))
    for _ in range(5):
      np.asarray(placement.logits(state, device_images))
    # To host, like Keras' .numpy().
    return 1000 * harness.median(
        harness.timings(lambda: np.asarray(placement.logits(state, device_images)), steps))
  batch = placement.put_train_batch((images, rng.integers(0, 10, 128).astype(np.int32)))
  for _ in range(3):
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
  started = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)  # as the loop does on multi-device CPU (see train.py)
  return steps * 128 / (time.perf_counter() - started)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--models', nargs='+', default=['cnn', 'resnet20'], choices=list(STEPS))
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--steps', type=int, default=0, help='steps per measurement (default per model)')
  parser.add_argument('--peers', nargs='*', default=['keras_tf', 'keras_tf_nojit', 'keras_jax', 'torch'])
  parser.add_argument('--worker', choices=('step', 'predict'), help=argparse.SUPPRESS)
  harness.out_argument(parser, 'throughput.json')
  args = parser.parse_args()
  if args.worker:
    print(json.dumps({'value': worker(args.worker, args.models[0], args.steps)}))
    return

  contestants = {
      'flaxtpu_loop_jit': lambda m, s, folder: measure_loop(m, 'jit', folder, 3 * s),
      'flaxtpu_loop_pmap': lambda m, s, folder: measure_loop(m, 'pmap', folder, 3 * s),
      'flaxtpu_step': lambda m, s, folder: measure_in_subprocess('step', m, 8, s),
      'flaxtpu_step_1dev': lambda m, s, folder: measure_in_subprocess('step', m, 1, s),
  }
  for peer in args.peers:
    contestants[peer] = lambda m, s, folder, peer=peer: peers.measure_peer(
        peer, m, batch_size=128, steps=s, repeats=1).get('images_per_sec', float('nan'))

  results, sgemm, train_flops = {}, [], {}
  with tempfile.TemporaryDirectory() as tmp:
    folder = synthetic_folder(os.path.join(tmp, 'images'), per_class=128)
    for model in args.models:
      steps = args.steps or STEPS[model]
      rates = {name: [] for name in contestants}
      for repeat in range(args.repeats):
        sgemm.append(harness.median(peers.sgemm_gflops()))
        for name, measure in contestants.items():
          try:
            rates[name].append(measure(model, steps, folder))
          except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f'{name} {model}: failed ({str(e).splitlines()[0]})', flush=True)
            rates[name].append(float('nan'))
        print(f'{model}: round {repeat + 1}/{args.repeats} sgemm={sgemm[-1]:.0f}GFLOP/s ' +
              ' '.join(f'{n}={r[-1]:.0f}' for n, r in rates.items()), flush=True)
      train_flops[model] = train_flops_per_image(model)
      results[model] = {name: {'images_per_sec': harness.median(r), 'repeats': r,
                               'gflops': harness.median(r) * train_flops[model] / 1e9}
                        for name, r in rates.items()}
    latency = {'flaxtpu_8dev': measure_in_subprocess('predict', 'cnn', 8, 50),
               'flaxtpu_1dev': measure_in_subprocess('predict', 'cnn', 1, 50)}
    for peer in ('keras_tf', 'keras_jax'):
      latency[peer] = peers.measure_peer(peer, 'cnn', batch_size=64, steps=50, repeats=1,
                                         mode='predict')['latency_ms']

  peak = harness.median(sgemm)
  print(f'\nimages/s (median of interleaved repeats), global batch 128; numpy SGEMM {peak:.0f} GFLOP/s')
  for model, rows in results.items():
    ours = rows['flaxtpu_loop_jit']['images_per_sec']
    print(f'  {model} ({train_flops[model] / 1e6:.1f} MFLOP per training image)')
    for name, row in rows.items():
      print(f'    {name:18s} {row["images_per_sec"]:8.0f}   {row["gflops"]:6.1f} GFLOP/s '
            f'{100 * row["gflops"] / peak:5.1f}% of SGEMM   flaxtpu loop / this = '
            f'{ours / row["images_per_sec"]:5.2f}x')
  print('predict latency, cnn, batch 64 (median ms):  ' +
        '  '.join(f'{k} {v:.2f}' for k, v in latency.items()))
  harness.write_results(args.out, {
      'throughput': results, 'predict_latency_ms_cnn_batch64': latency,
      'sgemm_gflops': {'median': peak, 'repeats': sgemm},
      'train_mflop_per_image': {model: flops / 1e6 for model, flops in train_flops.items()},
      'cpu_count': os.cpu_count()})


if __name__ == '__main__':
  main()
