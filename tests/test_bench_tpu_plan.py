"""benchmarks/device/tpu_plan.py: the bytes its layout changes write, read from HLO text; without a TPU
compiler, one line saying how to get one."""

import importlib.util
import os
import subprocess
import sys

import pytest

from benchmarks.device import tpu_plan
from conftest import ROOT


def test_copied_bytes_counts_each_copy_op_by_its_shape_and_type():
  hlo = '\n'.join([
      '  %copy.1 = bf16[16384,49,3,3,32]{4,3,2,0,1:T(4,128)(2,1)} copy(bf16[16384,49,3,3,32]{1,4,3,0,2} %a)',
      '  %copy-start.2 = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(f32[8]{0} %b)',  # a transfer, not a layout
      '  %copy.3 = f32[2,3]{0,1} copy(f32[2,3]{1,0} %c)',
      '  %fusion.4 = bf16[4,4]{1,0} fusion(bf16[4,4]{1,0} %d), kind=kLoop',
  ])
  assert tpu_plan.copied_bytes(hlo) == 16384 * 49 * 3 * 3 * 32 * 2 + 2 * 3 * 4


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is not None, reason='libtpu is installed here')
def test_without_a_tpu_compiler_it_says_how_to_get_one():
  done = subprocess.run([sys.executable, '-m', 'benchmarks.device.tpu_plan', '--models', 'resnet18'],
                        cwd=ROOT, env={**os.environ, 'JAX_PLATFORMS': 'cpu'}, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 1, done.stderr
  assert done.stderr.startswith("error: no TPU compiler for 'v5e:1x1' here (")
  assert done.stderr.count('\n') == 1
  assert 'install libtpu as the docstring says' in done.stderr


def test_cache_compression_round_trips_a_compiled_step_through_both_codecs():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  compiled = jax.jit(lambda x: jnp.tanh(x @ x.T).sum()).lower(jnp.ones((64, 64))).compile()
  row = tpu_plan.cache_compression(compiled)
  assert row['executable_bytes'] == len(compiled.runtime_executable().serialize()) > 1000
  for codec in ('zstd', 'zlib'):  # each compresses (a round trip is asserted inside) and is timed
    assert 0 < row[codec]['bytes'] < row['executable_bytes']
    assert row[codec]['compress_seconds'] > 0 and row[codec]['decompress_seconds'] > 0


def test_bytes_accessed_is_xlas_count_and_bounds_divide_by_the_chips_peaks():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  compiled = jax.jit(lambda x: x * 2).lower(jnp.ones((1024,), jnp.float32)).compile()
  assert tpu_plan.bytes_accessed(compiled) == 2 * 1024 * 4  # read once, written once
  row = {'flops': 197e9, 'bytes_accessed': 1638e6}  # a v5e: 197 TFLOP/s, 819 GB/s
  assert tpu_plan.bounds(row, 'TPU v5 lite') == ('1.6 GB accessed: at least 1.0 ms at the peak FLOP/s, '
                                                 '2.0 ms at the HBM bandwidth')
  assert tpu_plan.bounds(row, 'cpu') == 'bounds: not known for this chip'
