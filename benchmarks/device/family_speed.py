"""Train-step speed of each model family beside PyTorch eager on the same architecture, in one run.

    python -m benchmarks.device.family_speed                          # one variant per family, 224 px
    python -m benchmarks.device.family_speed --only resnet --size 128 --repeats 3

For each family, one variant: flaxtpu's jitted train step (the step training
builds: `compile_plan.compile_on_zeros`, SGD with momentum, the host split into
config.cpu_devices XLA devices as the CLI splits it)
against timm's same architecture trained eagerly by PyTorch (SGD with
momentum, channels-last memory for the convolutional ones, PyTorch's advice
on CPU). Batch 32, random images in memory, so only the step is timed. Each
contestant runs in its own process (flaxtpu's later rounds of a case load the
step the first compiled from the benchmark's own compilation cache); rounds
are interleaved (each contestant once per round) so machine noise hits both
alike, and the table gives the median images/s and the ratio flaxtpu /
PyTorch. A ratio under 1 is XLA:CPU's convolution and attention kernels
against oneDNN's (see docs/performance.md, "Every family beside PyTorch").
Compare on an idle machine: PyTorch's eager step slows far more than
flaxtpu's when other work shares the cores.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types

from benchmarks.shared import harness

BATCH = 32
# (family, flaxtpu model, timm architecture, channels_last for PyTorch, flaxtpu model.pool: timm's
# ViTs read their class token, DeiT's distilled ones two tokens; '' = the model's default)
CASES = [
    ('resnet', 'resnet50', 'resnet50', True, ''),
    ('resnext', 'resnext50_32x4d', 'resnext50_32x4d', True, ''),
    ('regnet', 'regnety_016', 'regnety_016', True, ''),
    ('efficientnet', 'efficientnet_b0', 'efficientnet_b0', True, ''),
    ('mobilenetv3', 'mobilenetv3_l', 'mobilenetv3_large_100', True, ''),
    ('convnext', 'convnext_t', 'convnext_tiny', True, ''),
    ('swin', 'swin_t', 'swin_tiny_patch4_window7_224', False, ''),
    ('vit', 'vit_s', 'vit_small_patch16_224', False, 'tok'),
    ('deit', 'deit_ti_distilled', 'deit_tiny_distilled_patch16_224', False, 'tok'),
]


def flaxtpu_rate(model: str, pool: str, size: int, steps: int, cache_dir: str) -> float:
  """Images/s of flaxtpu's train step for `model` at `size` px, in this process."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  # The benchmark's own cache: a case's later rounds load the program the first compiled.
  jax.config.update('jax_compilation_cache_dir', cache_dir)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)

  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import compile_plan  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()
  config.model.name, config.batch_size = model, BATCH
  if pool:
    config.model.pool = pool
  config.optimizer.name, config.optimizer.momentum = 'sgd', 0.9
  placement, state, _, step, _ = compile_plan.compile_on_zeros(config, image_shape=(size, size, 3),
                                                                num_classes=1000)
  rng = np.random.default_rng(0)
  batch = placement.put_train_batch((rng.integers(0, 256, (BATCH, size, size, 3), np.uint8),
                                     rng.integers(0, 1000, BATCH).astype(np.int32)))
  for _ in range(2):  # after compile, the first runs allocate
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
  started = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
  return steps * BATCH / (time.perf_counter() - started)


def torch_rate(architecture: str, size: int, steps: int, channels_last: bool) -> float:
  """Images/s of an eager PyTorch train step of timm's `architecture` at `size` px, in this process."""
  sys.modules.setdefault('torchvision._meta_registrations',
                         types.ModuleType('torchvision._meta_registrations'))
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  try:  # transformers fix their input size at creation; convolutional nets take no img_size
    model = timm.create_model(architecture, num_classes=1000, img_size=size)
  except TypeError:
    model = timm.create_model(architecture, num_classes=1000)
  model.train()
  images = torch.rand(BATCH, 3, size, size)
  labels = torch.randint(0, 1000, (BATCH,))
  if channels_last:
    model, images = model.to(memory_format=torch.channels_last), images.contiguous(
        memory_format=torch.channels_last)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
  loss_fn = torch.nn.CrossEntropyLoss()

  def run(count: int) -> None:
    for _ in range(count):
      optimizer.zero_grad(set_to_none=True)
      loss = loss_fn(model(images), labels)
      loss.backward()
      optimizer.step()
    loss.item()

  run(2)
  started = time.perf_counter()
  run(steps)
  return steps * BATCH / (time.perf_counter() - started)


def _env(contestant: str) -> dict:
  """flaxtpu runs as its CLI does on a CPU: the host split into config.cpu_devices XLA devices."""
  if contestant == 'torch':
    return harness.subprocess_env()
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  return harness.subprocess_env(defaults.get_config().cpu_devices)


def _measure(contestant: str, case, size: int, steps: int, cache_dir: str) -> float:
  """Images/s of one contestant on one case, in a child process; RuntimeError with its last words."""
  _, model, architecture, channels_last, pool = case
  done = subprocess.run([sys.executable, '-m', 'benchmarks.device.family_speed', f'--worker={contestant}',
                         f'--model={model}', f'--architecture={architecture}', f'--pool={pool}',
                         f'--size={size}', f'--steps={steps}', f'--cache-dir={cache_dir}']
                        + (['--channels-last'] if channels_last else []),
                        cwd=harness.ROOT, env=_env(contestant), capture_output=True, text=True)
  if done.returncode:
    last = (done.stderr.strip().splitlines() or [f'exit {done.returncode}'])[-1]
    raise RuntimeError(f'{contestant} on {model}: {last}')
  return json.loads(done.stdout.strip().splitlines()[-1])['images_per_s']


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='the cases whose family or model contains this')
  parser.add_argument('--size', type=int, default=224)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--worker', choices=('flaxtpu', 'torch'), help=argparse.SUPPRESS)
  parser.add_argument('--model', help=argparse.SUPPRESS)
  parser.add_argument('--architecture', help=argparse.SUPPRESS)
  parser.add_argument('--pool', default='', help=argparse.SUPPRESS)
  parser.add_argument('--channels-last', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--cache-dir', help=argparse.SUPPRESS)
  harness.out_argument(parser, 'family_speed.json')
  args = parser.parse_args()
  if args.worker:
    rate = (flaxtpu_rate(args.model, args.pool, args.size, args.steps, args.cache_dir)
            if args.worker == 'flaxtpu'
            else torch_rate(args.architecture, args.size, args.steps, args.channels_last))
    print(json.dumps({'images_per_s': rate}))
    return
  cases = [case for case in CASES if args.only in case[0] or args.only in case[1]]
  rows = []
  cache = tempfile.TemporaryDirectory(prefix='family_speed_')
  for case in cases:
    rates = {'flaxtpu': [], 'torch': []}
    try:
      with harness.cpu_load() as load:
        for _ in range(args.repeats):
          for contestant in rates:
            rates[contestant].append(_measure(contestant, case, args.size, args.steps, cache.name))
    except RuntimeError as error:  # one case failing costs that row only
      rows.append({'family': case[0], 'model': case[1], 'timm': case[2], 'error': str(error)})
      print(f'{case[0]:12s} {case[1]:14s} failed: {error}', flush=True)
    else:
      flax_rate, torch_rate_ = harness.median(rates['flaxtpu']), harness.median(rates['torch'])
      rows.append({'family': case[0], 'model': case[1], 'timm': case[2], 'image_size': args.size,
                   'batch': BATCH, 'flaxtpu_images_per_s': flax_rate, 'torch_images_per_s': torch_rate_,
                   'ratio': flax_rate / torch_rate_, 'rates': rates,
                   'other_cpu_load': load['other_cpu_load']})
      print(f'{case[0]:12s} {case[1]:14s} flaxtpu {flax_rate:7.2f} img/s   PyTorch eager ({case[2]}) '
            f'{torch_rate_:7.2f} img/s   ratio {flax_rate / torch_rate_:.2f}   '
            f'(other load {load["other_cpu_load"]:.2f} cores)', flush=True)
    harness.write_results(args.out, {'rows': rows, 'steps': args.steps, 'repeats': args.repeats,
                                     'cpu_count': os.cpu_count()})  # after each case: a stop keeps the rows


if __name__ == '__main__':
  main()
