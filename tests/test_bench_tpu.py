"""benchmarks/device/tpu.py without a TPU: the device rows are skipped with the reason, the input and decode
rows run on tiny generated folders, the decoded arrays match tf.data's pixel for pixel, the JSON and the
docs table hold what was measured."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT


def jpeg_folder(root, *, per_class: int, sides: tuple[int, int], seed: int) -> str:
  """root/{train,test}/{a,b}/NNNN.jpg: noisy JPEGs of random sizes in `sides` (both the same: uniform)."""
  rng = np.random.default_rng(seed)
  for split, count in (('train', per_class), ('test', 2)):
    for label, name in enumerate(('a', 'b')):
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      for index in range(count):
        height, width = rng.integers(sides[0], sides[1] + 1, 2)
        pixels = np.clip(rng.normal(90 + 70 * label, 40, (height, width, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f'{index:04d}.jpg'), quality=90)
  return str(root)


def bench(*flags) -> str:
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'  # as CI: no accelerator, whatever this machine has
  done = subprocess.run([sys.executable, '-m', 'benchmarks.device.tpu', '--quick', *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout


@pytest.fixture(scope='module')
def rows_but_decode(tmp_path_factory):
  """Every row but the decode: the device rows skipped, the input row on tiny photos (~25 s)."""
  tmp = tmp_path_factory.mktemp('bench_tpu')
  photos = jpeg_folder(tmp / 'photos', per_class=24, sides=(96, 160), seed=1)
  docs = tmp / 'performance.md'
  docs.write_text('# Performance\n\n## Earlier\n\nkept\n', encoding='utf-8')
  out = tmp / 'tpu.json'
  stdout = bench('--photos', photos, '--only', 'step,e2e,input,startup', '--out', str(out), '--workdir',
                 str(tmp / 'work'), '--write-docs', '--docs', str(docs))
  return {'tmp': tmp, 'out': out, 'docs': docs, 'stdout': stdout,
          'results': json.loads(out.read_text(encoding='utf-8'))}


@pytest.fixture(scope='module')
def run(rows_but_decode):
  """Then the decode row into the same JSON (`--only` keeps the others): the whole run, as one command
  leaves it (~20 s more)."""
  tmp, out, docs = rows_but_decode['tmp'], rows_but_decode['out'], rows_but_decode['docs']
  cifar = jpeg_folder(tmp / 'cifar', per_class=150, sides=(32, 32), seed=0)  # 300 train images
  stdout = bench('--cifar', cifar, '--only', 'decode', '--out', str(out), '--workdir', str(tmp / 'work'),
                 '--write-docs', '--docs', str(docs))
  return (json.loads(out.read_text(encoding='utf-8')), rows_but_decode['stdout'] + stdout,
          docs.read_text(encoding='utf-8'))


def test_device_rows_are_skipped_with_the_reason(rows_but_decode):
  results, stdout = rows_but_decode['results'], rows_but_decode['stdout']
  assert results['device']['platform'] == 'cpu'
  for name in ('step', 'e2e', 'startup'):
    row = results['rows'][name]
    assert row['skipped'] == 'no TPU: jax sees cpu' and set(row) == {'skipped', 'command', 'date'}
  assert stdout.count('skipped (no TPU: jax sees cpu)') == 3


def test_decode_row_matches_tf_data_pixel_for_pixel(run):
  results, _, _ = run
  decode = results['rows']['decode']
  assert 'error' not in decode, decode
  # Every file once, in both: Pillow (flaxtpu's cache) and TensorFlow both decode with libjpeg-turbo's
  # accurate integer IDCT (tf.data asked for INTEGER_ACCURATE), so not one value differs.
  assert decode['files'] == decode['flaxtpu_images'] == decode['tf_data_images'] == 300
  assert decode['same_files'] and decode['shape_equal']
  assert decode['pixels_equal'] and decode['max_abs_difference'] == 0 and decode['differing_values'] == 0
  for name in ('flaxtpu', 'tf_data'):
    assert len(decode[f'{name}_seconds']) == 1 and decode[f'{name}_median_seconds'] > 0
    assert decode[f'{name}_images_per_sec'] == pytest.approx(300 / decode[f'{name}_median_seconds'])
  assert decode['ratio_over_tf_data'] == pytest.approx(
      decode['tf_data_median_seconds'] / decode['flaxtpu_median_seconds'])


def test_decode_row_reads_a_warm_disk_cache(run):
  from benchmarks.device import tpu
  assert tpu.decoded_cache_key_present(), f'flaxtpu has no {tpu.DECODED_CACHE_KEY}: update the constant'
  decode = run[0]['rows']['decode']
  assert decode['disk_cache_fill_seconds'] > 0 and len(decode['disk_cache_warm_seconds']) == 1
  assert decode['disk_cache_equal']  # filled and read back: the same array as decoded without the cache
  assert decode['disk_cache_ratio_over_tf_data'] == pytest.approx(
      decode['tf_data_median_seconds'] / decode['disk_cache_warm_median_seconds'])


def test_input_row_reads_the_pipeline_benchmark(rows_but_decode):
  results = rows_but_decode['results']
  row = results['rows']['input']
  assert 'error' not in row and row['train_images'] == 48 and row['workers'] == 2, row
  for name in ('flaxtpu', 'flaxtpu_threads', 'tf_data'):
    assert row[f'{name}_images_per_sec'] > 0
  assert row['ratio_over_tf_data'] == pytest.approx(
      row['flaxtpu_images_per_sec'] / row['tf_data_images_per_sec'], rel=0.5)  # a median of per-round ratios
  assert row['row_seconds'] > 0


def test_json_and_docs_table(run):
  results, _, docs = run
  assert results['quick'] and results['command'].startswith('python -m benchmarks.device.tpu ')
  assert set(results['rows']) == {'step', 'e2e', 'input', 'decode', 'startup'}
  assert docs.startswith('# Performance\n\n## Earlier\n\nkept\n\n## On a TPU host\n')
  assert 'Measured on cpu x1 (cpu' in docs
  assert '| a. device-resident train step | skipped: no TPU: jax sees cpu |' in docs
  assert '| d. in-memory decode of CIFAR-10: 300 JPEGs into one array, no disk cache (pixels equal) |' in docs
  assert '| c. input pipeline alone: 48 JPEGs, decode + random-resized crop to 64 px, 2 workers |' in docs


def test_docs_section_is_replaced_in_place(tmp_path):
  from benchmarks.device import tpu
  docs = tmp_path / 'performance.md'
  docs.write_text('# P\n\n## On a TPU host\n\nold table\n\n## After\n\nstays\n', encoding='utf-8')
  results = {'command': 'python -m benchmarks.device.tpu --cifar DIR', 'date': '2026-12-05',
             'device': {'platform': 'tpu', 'device_kind': 'TPU v5 lite', 'device_count': 1,
                        'peak_bf16_flops': 197e12},
             'rows': {'step': {'batch': 256, 'image_size': 224, 'ratio': 1.1,
                               'flaxtpu': {'images_per_sec': 2750.0, 'mfu': 0.33},
                               'flax_example': {'images_per_sec': 2500.0, 'mfu': 0.30}}}}
  tpu.write_docs(results, docs)
  text = docs.read_text(encoding='utf-8')
  assert 'old table' not in text and text.endswith('## After\n\nstays\n')
  assert text.count('## On a TPU host') == 1
  assert ('| a. device-resident train step: ResNet-50, bf16, batch 256 at 224 px | 2,750 img/s, MFU 33.0% '
          '| Flax ImageNet example: 2,500 img/s, MFU 30.0% | 1.10x | >= 1.0 |') in text
  assert 'Measured on TPU v5 lite x1 (tpu' in text and '(197 TFLOP/s)' in text


def test_a_run_of_other_rows_keeps_the_photos_that_the_kept_rows_read(tmp_path):
  from benchmarks.device import tpu
  out = tmp_path / 'tpu.json'
  device = {'platform': 'tpu', 'device_kind': 'TPU v5 lite'}
  photos = {'folder': '/tmp/p', 'generated': True, 'sides': [375, 500], 'mean_kib': 28.0}
  out.write_text(json.dumps({'device': device, 'photos': photos,
                             'rows': {'input': {'ratio': 0.97}, 'startup': {'cold': {}}}}), encoding='utf-8')
  assert tpu.previous_rows(out, device, ['startup']) == ({'input': {'ratio': 0.97}}, photos)
  # Measured again (the photos with them), or on another kind of device: nothing of the earlier run.
  assert tpu.previous_rows(out, device, ['input']) == ({'startup': {'cold': {}}}, {})
  assert tpu.previous_rows(out, {'device_kind': 'TPU v4'}, ['startup']) == ({}, {})


def test_startup_row_reads_what_the_first_step_waited_for_from_a_real_run(tmp_path):
  """The CLI's start-up line, parsed as the startup row parses it: three times after the command."""
  from benchmarks.device import tpu  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'digits'
  log = tmp_path / 'digits.log'
  command = [sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py', f'--workdir={workdir}',
             '--config.num_train_steps=2', '--config.compilation_cache_dir=none']
  with open(log, 'w') as out:
    subprocess.run(command, cwd=ROOT, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=300)
  parts = tpu.startup_parts(str(log))
  assert set(parts) == {'trainer_imported_s', 'devices_ready_s', 'data_read_s'}
  first_step = json.loads((workdir / 'results.json').read_text())['time_to_first_step_s']
  assert 0 < max(parts.values()) < first_step < 300
  assert tpu.startup_parts(str(tmp_path / 'missing.log')) == {}
