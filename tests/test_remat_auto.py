"""model.remat=auto: the fastest policy whose compiled train step fits the device's memory, chosen from
XLA's memory plans, used for training and saved with the run; none fitting is one line."""

import json
import subprocess
import sys

import pytest

from configs import digits
from conftest import ROOT, cli_env
from flaxtpu.data import memory
from flaxtpu.loop import train
from flaxtpu.settings.errors import ConfigError
from flaxtpu.step import compile_plan, remat_choice


def _digits(**overrides):
  config = digits.get_config()
  config.update(num_train_steps=4, log_every_steps=2, eval_every_steps=4, checkpoint_every_steps=4,
                compilation_cache_dir='none')
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture
def fake_plans(monkeypatch):
  """Plans of 300, 200, 150 and 100 bytes for none, dots_saveable, dots_with_no_batch_dims_saveable and
  full; the device limit settable."""
  needs = {'none': 300, 'dots_saveable': 200, 'dots_with_no_batch_dims_saveable': 150, 'full': 100}
  compiled = []

  def plan_memory(config, **_):
    compiled.append(config.model.remat)
    return {'remat': config.model.remat, 'total_bytes': needs[config.model.remat]}
  limit = {'bytes': 0}
  monkeypatch.setattr(compile_plan, 'plan_memory', plan_memory)
  monkeypatch.setattr(memory, 'device_need',
                      lambda plan: (plan['total_bytes'], limit['bytes'], 'the 0 MiB of one test device'))
  return compiled, limit


@pytest.mark.parametrize('limit, chosen', [(1000, 'none'), (250, 'dots_saveable'),
                                            (175, 'dots_with_no_batch_dims_saveable'), (120, 'full')])
def test_auto_picks_the_fastest_policy_that_fits(fake_plans, limit, chosen, monkeypatch):
  compiled, limits = fake_plans
  limits['bytes'] = limit
  config = _digits(**{'model.remat': 'auto'})
  logged = []
  monkeypatch.setattr(remat_choice.logging, 'info', lambda message, *args: logged.append(message % args))
  resolved, plans = remat_choice.resolve(config, image_shape=(8, 8, 1), num_classes=10)
  order = ['none', 'dots_saveable', 'dots_with_no_batch_dims_saveable', 'full']
  assert resolved.model.remat == chosen and config.model.remat == 'auto'  # a copy; the config is kept
  assert compiled == order[:order.index(chosen) + 1]  # compiled until one fits, fastest first
  assert [plan['fits'] for plan in plans] == [False] * order.index(chosen) + [True]
  assert len(logged) == 1 and logged[0].startswith(f'model.remat=auto: {chosen}'), logged
  if chosen == 'dots_saveable':
    assert logged[0] == ('model.remat=auto: dots_saveable (none 0 MiB did not fit in the 0 MiB of one test '
                         'device)')


@pytest.mark.parametrize('limit, chosen', [(1000, 'none'), (250, 'none with remat_mlps=1'),
                                            (170, 'dots_saveable'), (100, 'full')])
def test_auto_tries_swins_first_stage_mlps_recomputed_between_none_and_dots_saveable(monkeypatch, limit,
                                                                                      chosen):
  """Swin-T on a v5e: none 9.18 GiB, remat_mlps=1 7.73 (at 98% of none's speed), dots_saveable 5.99;
  a model without MLP branches to recompute never compiles that candidate (the test above)."""
  needs = {'none': 300, 'none with remat_mlps=1': 200, 'dots_saveable': 150,
           'dots_with_no_batch_dims_saveable': 120, 'full': 80}
  compiled = []

  def plan_memory(config, **_):
    compiled.append(remat_choice.label(config))
    return {'remat': config.model.remat, 'total_bytes': needs[compiled[-1]]}
  monkeypatch.setattr(compile_plan, 'plan_memory', plan_memory)
  monkeypatch.setattr(memory, 'device_need', lambda plan: (plan['total_bytes'], limit, 'one test device'))
  config = _digits(**{'model.name': 'swin_t', 'model.remat': 'auto'})
  resolved, plans = remat_choice.resolve(config, image_shape=(224, 224, 3), num_classes=10)
  assert compiled == list(needs)[:list(needs).index(chosen) + 1]
  assert remat_choice.label(resolved) == chosen and config.model.remat_mlps == 0
  assert [plan.get('remat_mlps', 0) for plan in remat_choice.summary(plans)] == [0, 1, 0, 0, 0][:len(plans)]
  mlps_set = _digits(**{'model.name': 'swin_t', 'model.remat': 'auto', 'model.remat_mlps': 2})
  assert [remat_choice.label(c) for c in remat_choice.candidates(mlps_set)] == [  # the user's remat_mlps kept
      f'{policy} with remat_mlps=2' for policy in remat_choice.ORDER]


def test_auto_with_nothing_that_fits_names_each_need(fake_plans):
  _, limits = fake_plans
  limits['bytes'] = 50
  with pytest.raises(ConfigError, match=r"^config.model.remat=auto: no policy fits config.batch_size=32 of "
                                        r"model.name='cnn' in the 0 MiB of one test device \(the train step "
                                        r'needs none 0 MiB, dots_saveable 0 MiB, '
                                        r'dots_with_no_batch_dims_saveable 0 MiB, full 0 MiB\); lower '
                                        r'config.batch_size or the image size$'):
    remat_choice.resolve(_digits(**{'model.remat': 'auto'}), image_shape=(8, 8, 1), num_classes=10)


def test_other_policies_are_kept_without_compiling(fake_plans):
  compiled, _ = fake_plans
  config = _digits(**{'model.remat': 'dots_saveable'})
  assert remat_choice.resolve(config, image_shape=(8, 8, 1), num_classes=10) == (config, [])
  assert compiled == []


def test_a_run_with_auto_trains_with_the_policy_that_fits_and_saves_it(tmp_path, monkeypatch):
  """ResNet-20 on CPU: its step with nothing recomputed needs more temporaries than with the
  convolutions' outputs kept and the rest recomputed; host memory set just below the first."""
  config = _digits(**{'model.name': 'resnet20', 'model.remat': 'auto'})
  _, plans = remat_choice.resolve(config, image_shape=(8, 8, 1), num_classes=10, num_train_examples=1438)
  assert [plan['remat'] for plan in plans] == ['none']  # this machine's memory fits it
  needed_without_remat, _, _ = memory.device_need(plans[0])
  monkeypatch.setattr(memory, 'available_bytes', lambda: needed_without_remat - 1)
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results['eval_accuracy'] > 0.1
  with open(tmp_path / 'config.json') as f:
    assert json.load(f)['model']['remat'] == 'dots_saveable'
  assert config.model.remat == 'auto'


def test_plan_mode_reports_each_policy_it_compiled(tmp_path):
  env = cli_env()
  subprocess.run([sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py', f'--workdir={tmp_path}',
                  '--mode=plan', '--config.model.remat=auto', '--config.compilation_cache_dir=none'],
                 cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)
  with open(tmp_path / 'plan.json') as f:
    plan = json.load(f)
  assert plan['remat'] == 'none' and [entry['remat'] for entry in plan['remat_auto']] == ['none']
  assert plan['remat_auto'][0]['fits'] and plan['remat_auto'][0]['total_bytes'] == plan['total_bytes'] > 0
