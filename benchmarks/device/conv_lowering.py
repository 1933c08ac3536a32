"""Where ResNet-20's CPU step time goes: its three convolution shapes, per device count and lowering.

    python -m benchmarks.device.conv_lowering [--devices 1 2 4 8] [--batch 128]

For each of ResNet-20's 3x3 convolution shapes (32x32x16, 16x16x32, 8x8x64 at
global batch 128), times the forward + backward (gradients of both input and
kernel) of one layer, jitted with the batch split over N XLA CPU devices,
twice: as XLA's own convolution and as an explicit im2col GEMM (9 shifted
slices concatenated, one [B*H*W, 9*C] x [9*C, C] matmul) -- the lowering
that maps a convolution onto large GEMMs. Prints GFLOP/s (3 x 2 x MACs per
pass) next to the SGEMM rate numpy reaches on the same cores, so the gap to
peak is a number, not a guess. Each device count runs in its own process
(XLA_FLAGS is read once per process). Writes results/local/conv_lowering.json.
"""

import argparse
import json
import os
import subprocess
import sys

from benchmarks.shared import harness, peers

SHAPES = [(32, 16), (16, 32), (8, 64)]  # (side, channels) of ResNet-20's three stages


def worker(batch: int, repeats: int = 7) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  def xla_conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))

  def im2col_gemm(x, w):
    size, _, channels, features = w.shape
    b, h, wd, _ = x.shape
    padded = jnp.pad(x, ((0, 0), (size // 2,) * 2, (size // 2,) * 2, (0, 0)))
    patches = jnp.concatenate([padded[:, i:i + h, j:j + wd] for i in range(size) for j in range(size)], -1)
    return (patches.reshape(-1, size * size * channels) @ w.reshape(-1, features)).reshape(b, h, wd, features)

  mesh = jax.make_mesh((jax.device_count(),), ('batch',), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(0)
  results = {}
  for lowering in (xla_conv, im2col_gemm):
    for side, channels in SHAPES:
      x = jax.device_put(rng.random((batch, side, side, channels), np.float32),
                         NamedSharding(mesh, PartitionSpec('batch')))
      w = jnp.asarray(rng.random((3, 3, channels, channels), np.float32))
      grads = jax.jit(jax.grad(lambda x, w, f=lowering: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))
      jax.block_until_ready(grads(x, w))
      times = harness.timings(lambda grads=grads, x=x, w=w: jax.block_until_ready(grads(x, w)), repeats)
      flops = 3 * 2 * batch * side * side * channels * channels * 9
      results[f'{lowering.__name__} {side}x{side}x{channels}'] = flops / harness.median(times) / 1e9
  results['numpy sgemm 2048'] = max(peers.sgemm_gflops(calls=5))
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--devices', type=int, nargs='+', default=[1, 2, 4, 8])
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  harness.out_argument(parser, 'conv_lowering.json')
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(worker(args.batch)))
    return
  table = {}
  for devices in args.devices:
    out = subprocess.run([sys.executable, '-m', 'benchmarks.device.conv_lowering', '--worker',
                          f'--batch={args.batch}'],
                         env=harness.subprocess_env(devices), cwd=harness.ROOT, check=True,
                         capture_output=True, text=True).stdout
    table[devices] = json.loads(out.strip().splitlines()[-1])
  rows = list(next(iter(table.values())))
  print('GFLOP/s of one layer, forward + backward, global batch', args.batch)
  print(f'  {"":28s}' + ''.join(f'{f"{d} devices":>12s}' for d in table))
  for row in rows:
    print(f'  {row:28s}' + ''.join(f'{table[d][row]:12.1f}' for d in table))
  harness.write_results(args.out, {'batch': args.batch, 'gflops': table, 'cpu_count': os.cpu_count()})


if __name__ == '__main__':
  main()
