"""The memory plan XLA makes for a TPU chip, compiled on this machine, with no TPU: each model at each remat
policy.

    pip install --target /tmp/libtpu --no-deps libtpu==0.0.42.*    # the TPU compiler (jax 0.10's; ~700 MB)
    PYTHONPATH=/tmp/libtpu python -m benchmarks.device.tpu_plan --models swin_t --remat none,full
    PYTHONPATH=/tmp/libtpu python -m benchmarks.device.tpu_plan --models swin_t --remat-mlps 0,1,2

libtpu compiles for a described chip (`jax.experimental.topologies`, `--topology v5e:1x1`) without one:
the compiled program's memory plan (arguments + outputs + temporaries - donated buffers) is the one the
chip would run, and the bytes its layout changes (`copy` ops) write are counted from its HLO. The step
is flaxtpu's model (bfloat16, `model.remat` as given) in a plain SGD-with-momentum train step, batch
256 at 224 px by default. Against flaxtpu's own step on a v5e (`benchmarks/device/chip.py`, its recipe's
optimizer and loss): Swin-T 9.14 GiB here against 9.18 there, ConvNeXt-T 11.97 against 12.01. Not
timed: compile seconds are this machine's, and a plan is what the chip would need, not how fast it
runs; but XLA's counts of the step's FLOPs and HBM bytes give the shortest step the chip's peak
FLOP/s and its memory bandwidth allow (a step measured near the longer of the two waits for that).

`--cache-compression` also times what the persistent compilation cache does with each compiled step:
the serialized executable compressed and decompressed by zstd (what JAX uses when `zstandard` is
installed, a flaxtpu dependency) and by zlib (its fallback), best of 3 each, side by side.
"""

import argparse
import itertools
import re
import sys
import time
import zlib
from unittest import mock

from benchmarks.shared import harness


def copied_bytes(hlo_text: str) -> int:
  """Bytes written by the compiled program's `copy` ops (layout changes), once each."""
  total = 0
  for match in re.finditer(r'= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(', hlo_text):
    elements = 1
    for size in filter(None, match.group(2).split(',')):
      elements *= int(size)
    total += elements * {'bf16': 2, 'f16': 2, 'f32': 4, 's32': 4, 'u8': 1, 'pred': 1}.get(match.group(1), 4)
  return total


def bytes_accessed(compiled) -> float:
  """The bytes one call reads and writes in HBM as XLA's cost analysis counts them (0 where not said)."""
  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  return flax_imagenet_resnet.cost_of(compiled, 'bytes accessed')


def bounds(row: dict, device_kind: str) -> str:
  """The step's shortest time at the chip's peak FLOP/s and at its HBM bandwidth, by XLA's counts."""
  from benchmarks.device import tpu  # pylint: disable=g-import-not-at-top
  peak, bandwidth = tpu.PEAK_BF16_FLOPS.get(device_kind), tpu.HBM_BYTES_PER_SEC.get(device_kind)
  if not (peak and bandwidth and row['flops'] and row['bytes_accessed']):
    return 'bounds: not known for this chip'
  return (f'{row["bytes_accessed"] / 1e9:.1f} GB accessed: at least {row["flops"] / peak * 1e3:.1f} ms at '
          f'the peak FLOP/s, {row["bytes_accessed"] / bandwidth * 1e3:.1f} ms at the HBM bandwidth')


def cache_compression(compiled) -> dict:
  """The serialized executable's bytes, and each codec's compressed bytes and best-of-3 seconds."""
  import zstandard  # pylint: disable=g-import-not-at-top

  blob = compiled.runtime_executable().serialize()
  codecs = {'zstd': (zstandard.ZstdCompressor().compress, zstandard.ZstdDecompressor().decompress),
            'zlib': (zlib.compress, zlib.decompress)}
  row = {'executable_bytes': len(blob)}
  for name, (compress, decompress) in codecs.items():
    packed = compress(blob)  # also the warm-up of the timed calls
    assert decompress(packed) == blob
    row[name] = {'bytes': len(packed),
                 'compress_seconds': min(harness.timings(lambda: compress(blob), 3)),
                 'decompress_seconds': min(harness.timings(lambda: decompress(packed), 3))}
  return row


def plan(model_name: str, remat: str, batch: int, image_size: int, devices,
         with_compression: bool = False, remat_mlps: int = 0) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from benchmarks.device import chip  # pylint: disable=g-import-not-at-top
  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  from flaxtpu.models import registry  # pylint: disable=g-import-not-at-top

  replicated = NamedSharding(Mesh(devices, ('devices',)), P())
  model = registry.create(model_name, num_classes=1000, dtype='bfloat16', remat=remat, remat_mlps=remat_mlps)
  example = jnp.zeros((1, image_size, image_size, 3))
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), example, train=False))
  optimizer = optax.sgd(0.1, momentum=0.9)
  abstract = lambda tree: jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated), tree)
  params, state = variables['params'], {k: v for k, v in variables.items() if k != 'params'}

  def train_step(params, state, opt_state, images, labels):
    def loss_fn(params):
      out = model.apply({'params': params, **state}, images, train=True, mutable=list(state) or False,
                        rngs={'dropout': jax.random.PRNGKey(0)})
      logits, new_state = out if state else (out, state)  # BatchNorm's statistics, where the model has them
      loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
      return loss, new_state
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, opt_state, loss

  started = time.perf_counter()
  # Traced as on a TPU: code that asks for the default backend (grouped_conv's gradients written for
  # XLA:CPU) takes a TPU's path, not this machine's.
  with mock.patch.object(jax, 'default_backend', lambda: devices[0].platform):
    lowered = jax.jit(train_step, donate_argnums=(0, 1, 2)).lower(
        abstract(params), abstract(state), abstract(jax.eval_shape(optimizer.init, params)),
        jax.ShapeDtypeStruct((batch, image_size, image_size, 3), jnp.bfloat16, sharding=replicated),
        jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=replicated))
  compiled = lowered.compile()
  seconds = time.perf_counter() - started
  memory = chip.memory_plan_of(compiled)
  return {'model': model_name, 'remat': remat, 'remat_mlps': remat_mlps, 'batch': batch,
          'image_size': image_size,
          'plan_bytes': memory['total_bytes'], 'temp_bytes': memory['temp_bytes'],
          'flops': flax_imagenet_resnet.flops_of(compiled), 'bytes_accessed': bytes_accessed(compiled),
          'copied_bytes': copied_bytes(compiled.as_text()),
          'compile_seconds_here': seconds, **(cache_compression(compiled) if with_compression else {})}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--models', default='swin_t', help='flaxtpu model names, comma-separated')
  parser.add_argument('--remat', default='none', help='model.remat policies, comma-separated')
  parser.add_argument('--remat-mlps', default='0', help='model.remat_mlps values (Swin), comma-separated')
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--image-size', type=int, default=224)
  parser.add_argument('--topology', default='v5e:1x1', help="a TPU topology name, e.g. 'v5e:1x1' (one chip)")
  parser.add_argument('--cache-compression', action='store_true',
                      help='also time zstd against zlib on each serialized step (the compilation cache)')
  args = parser.parse_args()

  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    topology = topologies.get_topology_desc(platform='tpu', topology_name=args.topology,
                                            chip_config_name='default', chips_per_host_bounds=(1, 1, 1),
                                            num_slices=1)
  except Exception as error:  # pylint: disable=broad-except  # no libtpu, or a topology it does not know
    sys.exit(f'error: no TPU compiler for {args.topology!r} here ({str(error).splitlines()[0][:200]}); '
             'install libtpu as the docstring says (python -m benchmarks.device.tpu_plan --help)')
  devices = topology.devices
  print(f'{len(devices)} x {devices[0].device_kind} ({args.topology}), compiled on this machine', flush=True)
  for model_name in args.models.split(','):
    for remat, mlps in itertools.product(args.remat.split(','), map(int, args.remat_mlps.split(','))):
      row = plan(model_name, remat, args.batch, args.image_size, devices, args.cache_compression, mlps)
      setting = f'remat={remat}' + (f' remat_mlps={mlps}' if mlps else '')
      print(f'  {model_name} {setting}: plan {row["plan_bytes"] / 2**30:.2f} GiB (temporaries '
            f'{row["temp_bytes"] / 2**30:.2f}), {row["flops"] / 1e12:.2f} TFLOP a step, layout copies '
            f'{row["copied_bytes"] / 2**30:.2f} GiB, compiled in {row["compile_seconds_here"]:.0f} s here; '
            f'{bounds(row, devices[0].device_kind)}', flush=True)
      if args.cache_compression:
        codec = lambda name: (f'{name} {row[name]["bytes"] / 2**20:.1f} MiB in '
                              f'{row[name]["compress_seconds"]:.2f} s (back in '
                              f'{row[name]["decompress_seconds"]:.2f} s)')
        ratio = lambda key: row['zlib'][key] / row['zstd'][key]
        print(f'    its executable {row["executable_bytes"] / 2**20:.0f} MiB: {codec("zstd")}, '
              f'{codec("zlib")}; zlib / zstd: compress {ratio("compress_seconds"):.1f}x, decompress '
              f'{ratio("decompress_seconds"):.1f}x', flush=True)


if __name__ == '__main__':
  main()
