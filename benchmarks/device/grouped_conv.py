"""Grouped and depthwise conv layers on the CPU: XLA's own gradients against flaxtpu's (grouped_conv.py).

    python -m benchmarks.device.grouped_conv [--rounds 3]    # -> benchmarks/results/local/grouped_conv.json

One layer at a time, batch 32, one XLA CPU device: the forward pass and the
forward + backward (gradients of input and kernel) of
`lax.conv_general_dilated` with `feature_group_count` beside
`flaxtpu.models.nets.grouped_conv.conv_general_dilated` (the same forward;
gradients from shifted slices). Both are compiled first, then timed in
alternating rounds; the table gives medians and the speed-up of the
gradients. The layers are the families' own: ResNeXt-50's and RegNetY-1.6GF's
first-stage 3x3 grouped convs and EfficientNet's and ConvNeXt's depthwise
ones, at the map sizes a 128 px input gives them.
"""

import argparse
import os
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=1')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from jax import lax  # pylint: disable=g-import-not-at-top

from benchmarks.shared import harness  # pylint: disable=g-import-not-at-top
from flaxtpu.models.nets import grouped_conv  # pylint: disable=g-import-not-at-top

BATCH = 32
# (layer, map side, channels, groups, kernel)
LAYERS = [
    ('resnext50_32x4d stage 1 3x3', 32, 128, 32, 3),
    ('resnext50_32x4d stage 2 3x3', 16, 256, 32, 3),
    ('regnety_016 stage 1 3x3', 32, 48, 6, 3),
    ('efficientnet_b0 stage 2 depthwise 3x3', 32, 96, 96, 3),
    ('convnext_t stage 1 depthwise 7x7', 32, 96, 96, 7),
]


def _timed(function, *args, rounds_of: int = 3) -> float:
  started = time.perf_counter()
  for _ in range(rounds_of):
    jax.block_until_ready(function(*args))
  return (time.perf_counter() - started) / rounds_of


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  harness.out_argument(parser, 'grouped_conv.json')
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  rows = []
  for layer, side, channels, groups, kernel in LAYERS:
    x = jnp.asarray(rng.standard_normal((BATCH, side, side, channels)), jnp.float32)
    shape = (kernel, kernel, channels // groups, channels)
    weights = jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32)
    numbers = lax.conv_dimension_numbers(x.shape, weights.shape, ('NHWC', 'HWIO', 'NHWC'))
    programs = {}
    for name, conv in (('xla', lax.conv_general_dilated), ('flaxtpu', grouped_conv.conv_general_dilated)):
      forward = lambda x, w, conv=conv: conv(x, w, (1, 1), 'SAME', dimension_numbers=numbers,
                                             feature_group_count=groups)
      programs[name] = (jax.jit(forward), jax.jit(jax.grad(lambda x, w, f=forward: jnp.sum(f(x, w) ** 2),
                                                           argnums=(0, 1))))
      for program in programs[name]:
        jax.block_until_ready(program(x, weights))  # compile
    times = {name: {'forward': [], 'gradients': []} for name in programs}
    for _ in range(args.rounds):
      for name, (forward, gradients) in programs.items():
        times[name]['forward'].append(_timed(forward, x, weights))
        times[name]['gradients'].append(_timed(gradients, x, weights))
    medians = {name: {part: harness.median(values) for part, values in parts.items()}
               for name, parts in times.items()}
    row = {'layer': layer, 'map': side, 'channels': channels, 'groups': groups, 'kernel': kernel,
           'batch': BATCH, 'ms': {name: {part: 1e3 * value for part, value in parts.items()}
                                  for name, parts in medians.items()},
           'gradient_speedup': medians['xla']['gradients'] / medians['flaxtpu']['gradients']}
    rows.append(row)
    print(f'{layer:40s} forward {row["ms"]["xla"]["forward"]:8.1f} ms   forward+backward: XLA '
          f'{row["ms"]["xla"]["gradients"]:9.1f} ms, flaxtpu {row["ms"]["flaxtpu"]["gradients"]:8.1f} ms   '
          f'x{row["gradient_speedup"]:.1f}', flush=True)
  harness.write_results(args.out, {'rows': rows, 'rounds': args.rounds})


if __name__ == '__main__':
  main()
