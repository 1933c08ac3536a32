"""benchmarks/device/chip.py without a TPU: every case is skipped with the reason, and `--only` keeps the
earlier run's other cases; the committed TPU run's rows hold what a measured case must (every contestant,
FLOPs, memory plans, ratios, the warm load from the persistent cache) and render as the docs tables.

Slow (`make test-slow`: about 3 minutes on 2 cores, three ResNet-50 steps compiled): with --any-platform
the ResNet-50 case runs end to end on the CPU at --quick sizes (flaxtpu beside the Flax example and
Keras-JAX, a cold compile and a warm load from the persistent cache), keeping the skipped cases of the
earlier run; the JSON and the docs tables hold what was measured."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

SKIP_REASON = 'no TPU: jax sees cpu'
COMMITTED = pathlib.Path(ROOT) / 'benchmarks' / 'results' / 'chip.json'  # measured on a TPU v5e


def bench(*flags, timeout):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'  # as CI: no accelerator, whatever this machine has
  done = subprocess.run([sys.executable, '-m', 'benchmarks.device.chip', *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  return done.stdout


@pytest.fixture(scope='module')
def skipped(tmp_path_factory):
  """The skipped run (every case, seconds): its JSON, stdout and docs page."""
  tmp = tmp_path_factory.mktemp('bench_chip')
  out, work, docs = tmp / 'chip.json', tmp / 'work', tmp / 'performance.md'
  docs.write_text('# Performance\n\n## Earlier\n\nkept\n', encoding='utf-8')
  stdout = bench('--quick', '--out', str(out), '--workdir', str(work), '--write-docs', '--docs', str(docs),
                 timeout=300)
  return {'results': json.loads(out.read_text(encoding='utf-8')), 'stdout': stdout,
          'docs': docs.read_text(encoding='utf-8'), 'out': out, 'work': work, 'tmp': tmp}


@pytest.fixture(scope='module')
def runs(skipped):
  """`--only resnet50 --any-platform` into the skipped run's JSON (it keeps the others): minutes."""
  out = skipped['tmp'] / 'measured.json'
  shutil.copy(skipped['out'], out)
  # ~2.5-4 min on 2 cores: three ResNet-50 steps compiled at once, then flaxtpu's again from the cache.
  measured_stdout = bench('--quick', '--any-platform', '--only', 'resnet50', '--out', str(out), '--workdir',
                          str(skipped['work']), timeout=1200)
  return {'measured': (json.loads(out.read_text(encoding='utf-8')), measured_stdout), 'out': out,
          'tmp': skipped['tmp']}


def test_without_a_tpu_every_case_is_skipped_saying_why(skipped):
  from benchmarks.device import chip
  results, stdout, docs = skipped['results'], skipped['stdout'], skipped['docs']
  assert results['device']['platform'] == 'cpu' and results['quick']
  assert list(results['cases']) == list(chip.CASES) and results['remat'] == {}
  for row in results['cases'].values():
    assert row['skipped'] == SKIP_REASON and set(row) == {'skipped', 'command', 'date'}
  assert stdout.count(f'skipped ({SKIP_REASON})') == len(chip.CASES) == 10
  assert docs.startswith('# Performance\n\n## Earlier\n\nkept\n\n## Every family on a TPU chip\n')
  assert f'| ResNet-50 (`resnet50`) | skipped: {SKIP_REASON} |' in docs
  assert f'| Swin-T (`swin_t`) | skipped: {SKIP_REASON} |' in docs


def test_only_of_a_skipped_run_keeps_the_earlier_cases(skipped):
  out = skipped['tmp'] / 'only.json'
  shutil.copy(skipped['out'], out)
  stdout = bench('--quick', '--only', 'resnet50', '--out', str(out), '--workdir', str(skipped['work']),
                 timeout=300)
  results = json.loads(out.read_text(encoding='utf-8'))
  assert results['command'].startswith('python -m benchmarks.device.chip --quick --only resnet50')
  assert list(results['cases']) == ['resnet50_remat', 'resnet50_b512', 'resnet50_accum2', 'vit_b16',
                                    'convnext_t', 'swin_t', 'swin_t_mlps', 'efficientnet_b0', 'mobilenetv3_l',
                                    'resnet50']
  assert all(row['skipped'] == SKIP_REASON for row in results['cases'].values())
  # resnet50 is this run's; the others are the earlier run's, kept.
  assert results['cases']['resnet50']['command'] == results['command']
  assert all(row['command'] == skipped['results']['command'] for name, row in results['cases'].items()
             if name != 'resnet50')
  assert '== keeping from' in stdout


def assert_a_measured_resnet50_row(row: dict, batch: int, image_size: int, rounds: int, peak) -> None:
  """The ResNet-50 case measured: every contestant's rate, compile, FLOPs, MFU (None without a known bf16
  peak, saying why) and memory plan; Keras' ResNet50; the ratios; the warm load from the cache."""
  assert 'error' not in row, row.get('error')
  assert row['batch'] == batch and row['image_size'] == image_size and row['dtype'] == 'bfloat16'
  assert set(row['contestants']) == {'flaxtpu', 'flax_example', 'keras'}
  for name, entry in row['contestants'].items():
    assert entry['images_per_sec'] > 0 and len(entry['rounds']) == rounds, name
    assert entry['compile_seconds'] > 0 and entry['build_seconds'] >= entry['compile_seconds'], name
    assert entry['flops_per_step'] > 0 and entry['flops_per_image'] == entry['flops_per_step'] / batch, name
    plan = entry['memory_plan']
    assert plan['total_bytes'] > 0 and plan['argument_bytes'] > 0 and plan['temp_bytes'] > 0, name
    assert plan['total_bytes'] == (plan['argument_bytes'] + plan['output_bytes'] + plan['temp_bytes']
                                   - plan['alias_bytes'])
    if peak:
      assert entry['mfu'] == pytest.approx(entry['flops_per_image'] * entry['images_per_sec'] / peak), name
    else:  # no bf16 peak for a CPU: no MFU, and the JSON says why
      assert entry['mfu'] is None and entry['mfu_missing'] == "no dense bf16 peak known for device kind 'cpu'"
  keras = row['contestants']['keras']
  assert keras['application'] == 'ResNet50' and keras['loop'] == 'stateless'
  assert keras['parameters'] == 25_583_592  # keras.applications.ResNet50's trainable parameters
  mine = row['contestants']['flaxtpu']['images_per_sec']
  for peer in ('flax_example', 'keras'):
    assert row['ratios'][peer] == pytest.approx(mine / row['contestants'][peer]['images_per_sec'])
  # The second process compiled flaxtpu's step from the cache the first one filled.
  warm = row['warm']
  assert 'error' not in warm and warm['compile_seconds'] > 0 and warm['cache_hits'] >= 1
  assert warm['cache_misses'] == 0 and warm['memory_plan'] == row['contestants']['flaxtpu']['memory_plan']
  assert row['cold_process_seconds'] > 0 and row['case_seconds'] >= row['cold_process_seconds']


def test_the_committed_resnet50_row_holds_every_contestants_measurement():
  """What the CPU run below checks, on the committed run of a TPU v5e chip (the same code wrote it)."""
  results = json.loads(COMMITTED.read_text(encoding='utf-8'))
  assert_a_measured_resnet50_row(results['cases']['resnet50'], batch=256, image_size=224, rounds=3,
                                 peak=results['device']['peak_bf16_flops'])


def test_from_the_committed_json_writes_the_docs_tables(tmp_path):
  docs = tmp_path / 'from_json.md'
  docs.write_text('# P\n\n## Every family on a TPU chip\n\nthe earlier table\n\n## After\n\nstays\n',
                  encoding='utf-8')
  bench('--from-json', str(COMMITTED), '--write-docs', '--docs', str(docs), timeout=120)
  text = docs.read_text(encoding='utf-8')
  assert 'the earlier table' not in text and text.endswith('## After\n\nstays\n')
  assert text.count('## Every family') == 1
  assert 'Measured on TPU v5 lite x1 (tpu, jax ' in text and '`--quick` sizes' not in text
  assert '    python -m benchmarks.device.chip --out /root/out/chip.json --compile-alone --only tuned' in text
  line = next(line for line in text.splitlines() if line.startswith('| ResNet-50 (`resnet50`), batch 256'))
  cells = [cell.strip() for cell in line.strip('|').split('|')]
  assert len(cells) == 8 and cells[1].endswith(' img/s') and cells[2].endswith('%')
  assert ' s / ' in cells[3] and 'GiB (temporaries' in cells[4]
  assert 'Flax ImageNet example: ' in cells[5] and 'Keras-JAX `ResNet50`: ' in cells[5]
  assert cells[6].count('x') == 2 and cells[7].startswith('MFU >= 40%')


@pytest.mark.slow
def test_resnet50_end_to_end_on_cpu(runs):
  results, stdout = runs['measured']
  row = results['cases']['resnet50']
  assert_a_measured_resnet50_row(row, batch=8, image_size=32, rounds=2, peak=None)
  assert all(entry['steps_per_round'] == 2 for entry in row['contestants'].values())
  assert 'flaxtpu step compiled again from the cache' in stdout
  assert 'round 2/2 keras' in stdout


@pytest.mark.slow
def test_only_keeps_the_earlier_cases(runs):
  results, stdout = runs['measured']
  assert results['command'].startswith(
      'python -m benchmarks.device.chip --quick --any-platform --only resnet50')
  assert list(results['cases']) == ['resnet50_remat', 'resnet50_b512', 'resnet50_accum2', 'vit_b16',
                                    'convnext_t', 'swin_t', 'swin_t_mlps', 'efficientnet_b0', 'mobilenetv3_l',
                                    'resnet50']
  others = [row for name, row in results['cases'].items() if name != 'resnet50']
  assert all(row['skipped'] == SKIP_REASON for row in others)
  assert '== keeping from' in stdout


@pytest.mark.slow
def test_from_json_writes_the_docs_table(runs):
  docs = runs['tmp'] / 'from_json.md'
  docs.write_text('# P\n\n## Every family on a TPU chip\n\nthe earlier table\n\n## After\n\nstays\n',
                  encoding='utf-8')
  bench('--from-json', str(runs['out']), '--write-docs', '--docs', str(docs), timeout=120)
  text = docs.read_text(encoding='utf-8')
  assert 'the earlier table' not in text and text.endswith('## After\n\nstays\n')
  assert text.count('## Every family') == 1
  assert 'Measured on cpu x1 (cpu, jax ' in text and '`--quick` sizes' in text
  assert '    python -m benchmarks.device.chip --quick --any-platform --only resnet50' in text
  row = '| ResNet-50 (`resnet50`), batch 8 at 32 px'
  line = next(line for line in text.splitlines() if line.startswith(row))
  cells = [cell.strip() for cell in line.strip('|').split('|')]
  assert len(cells) == 8 and cells[1].endswith(' img/s') and cells[2] == '-'
  assert ' s / ' in cells[3] and cells[4].endswith(')') and 'GiB (temporaries' in cells[4]
  assert 'Flax ImageNet example: ' in cells[5] and 'Keras-JAX `ResNet50`: ' in cells[5]
  assert cells[6].count('x') == 2 and cells[7].startswith('MFU >= 40%')
  assert f'| Swin-T (`swin_t`) | skipped: {SKIP_REASON} |' in text


def tpu_results() -> dict:
  contestant = {'images_per_sec': 2583.0, 'mfu': 0.316, 'compile_seconds': 77.0,
                'memory_plan': {'total_bytes': 8.76 * 2**30, 'temp_bytes': 8.4 * 2**30}}
  return {
      'command': 'python -m benchmarks.device.chip', 'date': '2026-12-06',
      'sizes': {'keras_loop': 'stateless'},
      'device': {'platform': 'tpu', 'device_kind': 'TPU v5 lite', 'device_count': 1, 'jax_version': '0.10.2',
                 'peak_bf16_flops': 197e12},
      'host': {'cpu_count': 13},
      'cases': {'resnet50': {
          'batch': 256, 'image_size': 224, 'command': 'python -m benchmarks.device.chip --only resnets',
          'date': '2026-12-06', 'ratios': {'flax_example': 1.0012, 'keras': 1.2515},
          'warm': {'compile_seconds': 4.2, 'cache_hits': 2},
          'contestants': {'flaxtpu': contestant,
                          'flax_example': {'images_per_sec': 2580.0, 'mfu': 0.315, 'compile_seconds': 70.1,
                                           'memory_plan': {'total_bytes': 8.5 * 2**30}},
                          'keras': {'images_per_sec': 2064.0, 'mfu': 0.25, 'compile_seconds': 80.0,
                                    'application': 'ResNet50', 'memory_plan': {}}}},
          'swin_t': {'error': 'timed out after 360 s\n(its limit)',
                     'command': 'python -m benchmarks.device.chip '
                     '--only modern', 'date': '2026-12-06'}},
      'remat': {'vit_b16': {'batch': 256,
                            'command': 'python -m benchmarks.device.chip --remat-table --only vit_b16',
                            'date': '2026-12-07', 'policies': {
                                'none': {'step_ms': 321.6, 'images_per_sec': 796.0,
                                         'memory_plan': {'total_bytes': 9 * 2**30}},
                                'full': {'step_ms': 400.0, 'images_per_sec': 640.0,
                                         'memory_plan': {'total_bytes': 3 * 2**30}},
                                'dots_saveable': {'error': 'XlaRuntimeError: RESOURCE_EXHAUSTED'}}}},
  }


def test_tpu_tables(tmp_path):
  from benchmarks.device import chip
  docs = tmp_path / 'performance.md'
  docs.write_text('# P\n', encoding='utf-8')
  chip.write_docs(tpu_results(), docs)
  text = docs.read_text(encoding='utf-8')
  assert 'Measured on TPU v5 lite x1 (tpu, jax 0.10.2), 13 host cores, 2026-12-06, 2026-12-07:' in text
  assert '(197 TFLOP/s)' in text
  for command in ('--only resnets', '--only modern', '--remat-table --only vit_b16'):
    assert f'    python -m benchmarks.device.chip {command}\n' in text
  assert ('| ResNet-50 (`resnet50`), batch 256 at 224 px | 2,583 img/s | 31.6% | 77.0 s / 4.2 s '
          '| 8.76 GiB (temporaries 8.40) | Flax ImageNet example: 2,580 img/s, MFU 31.5%, 8.50 GiB, compile '
          '70.1 s; Keras-JAX `ResNet50`: 2,064 img/s, MFU 25.0%, compile 80.0 s | 1.00x; 1.25x |') in text
  # A multi-line error stays on its row.
  assert '| Swin-T (`swin_t`) | failed: timed out after 360 s (its limit) |' in text
  assert '| model | none | dots_saveable | full |' in text
  assert ('| ViT-B/16 (`vit_b`), batch 256 | 321.6 ms (796 img/s), 9.00 GiB | failed: XlaRuntimeError: '
          'RESOURCE_EXHAUSTED | 400.0 ms (640 img/s), 3.00 GiB |') in text


def test_selected_cases():
  from benchmarks.device import chip
  assert chip.selected_cases('', False) == list(chip.CASES)
  assert chip.selected_cases('', True) == list(chip.FAMILIES)
  assert chip.selected_cases('mobile,resnet50', False) == ['resnet50', 'efficientnet_b0', 'mobilenetv3_l']
  assert chip.selected_cases('resnets', True) == ['resnet50']  # the variants have no remat table
  assert set(sum(chip.GROUPS.values(), ())) == set(chip.CASES)  # the groups cover every case
  assert chip.selected_cases('tuned', False) == ['swin_t', 'swin_t_mlps']  # the optimisation beside its base
  with pytest.raises(SystemExit, match='cases are'):
    chip.selected_cases('resnet', False)
  with pytest.raises(SystemExit, match='the families are'):
    chip.selected_cases('resnet50_b512', True)


def test_cases_use_flaxtpu_model_names():
  from benchmarks.device import chip
  from flaxtpu import models
  from flaxtpu.validation.config import REMAT_POLICIES
  assert all(case.model in models.NAMES for case in chip.CASES.values())
  assert set(chip.REMAT_POLICIES) <= set(REMAT_POLICIES)
  assert chip.CASES['resnet50_remat'].remat in REMAT_POLICIES
  # An optimisation's case is its base's config with the one key changed (validated as a run's).
  # A case's batch_factor scales the batch once: the compiled step takes the batch the case feeds it.
  doubled = chip.case_sizes(chip.CASES['resnet50_b512'], chip.tpu.QUICK)
  assert doubled.batch == 2 * chip.tpu.QUICK.batch
  assert chip.flaxtpu_config(chip.CASES['resnet50_b512'], doubled).batch_size == doubled.batch
  tuned = chip.flaxtpu_config(chip.CASES['swin_t_mlps'], chip.tpu.QUICK)
  base = chip.flaxtpu_config(chip.CASES['swin_t'], chip.tpu.QUICK)
  assert (tuned.model.remat_mlps, base.model.remat_mlps) == (1, 0)
  tuned.model.remat_mlps = 0
  assert tuned.to_dict() == base.to_dict()
