"""Resolution before validation, once: what a config leaves open is filled from its sources before
`validate`, and no mode edits the config afterwards."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from conftest import make_image_folder
from flaxtpu import main
from flaxtpu.io import files
from flaxtpu.loop import train
from flaxtpu.settings import defaults, metric_names
from flaxtpu.settings.errors import UserError
from flaxtpu.validation import config as config_lib
from flaxtpu.validation import resolution, workdir_config
from flaxtpu.weights import checkpoint, saved


def _config(folder, **overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({
      'dataset.folder': folder, 'batch_size': 16, 'num_train_steps': 2, 'eval_every_steps': 1,
      'checkpoint_every_steps': 1, 'compilation_cache_dir': 'none', **overrides})
  return config


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp('resolution_images')
  return (make_image_folder(root / 'source', train_per_class=8, test_per_class=2),
          make_image_folder(root / 'target', train_per_class=8, test_per_class=2, seed=1))


@pytest.fixture(scope='module')
def source(folders, tmp_path_factory):
  """A standardised CNN trained 2 steps, evaluated and saved at steps 1 and 2."""
  workdir = str(tmp_path_factory.mktemp('source'))
  train.train_and_evaluate(_config(folders[0], **{'dataset.normalize': 'standardize'}), workdir)
  return workdir


def _nodes(config):
  yield config
  for value in config.values():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _nodes(value)


@pytest.fixture
def validated(monkeypatch):
  """What `validate` saw in each main.run, as dicts; after it, writing to that config raises."""
  seen, frozen = [], {}  # id -> node, held so that no new ConfigDict reuses a frozen node's id
  validate = config_lib.validate

  def spy(config, mode='train'):
    validate(config, mode)
    seen.append(json.loads(json.dumps(config.to_dict())))
    frozen.update((id(node), node) for node in _nodes(config))

  def guard(method):
    def guarded(self, key, *args):
      if id(self) in frozen:
        raise AssertionError(f'config.{key} edited after validation')
      return method(self, key, *args)
    return guarded

  monkeypatch.setattr(config_lib, 'validate', spy)
  for name in ('__setitem__', '__delitem__'):
    monkeypatch.setattr(ml_collections.ConfigDict, name, guard(getattr(ml_collections.ConfigDict, name)))
  monkeypatch.setattr(main, '_start_jax', lambda config: jax)  # JAX runs already, on 8 CPU devices
  return seen


def _as_json(config):
  return json.loads(json.dumps(config.to_dict()))


def test_a_fine_tune_from_a_run_is_resolved_before_validation_and_never_edited(source, folders, tmp_path,
                                                                               validated):
  """validate sees the source's standardisation numbers; train, eval and predict leave the config as it
  was validated, and config.json holds that config."""
  record = saved.read_record(os.path.join(source, 'checkpoints'), 2)
  config = _config(folders[1], **{'init_from.checkpoint': source})
  assert config.dataset.normalize == 'auto' and not config.dataset.mean
  workdir = str(tmp_path / 'tuned')
  main.run(config, workdir, 'train', None)
  [resolved] = validated
  assert resolved['dataset']['normalize'] == 'fixed'
  assert resolved['dataset']['mean'] == record['normalization']['mean']
  assert resolved['dataset']['std'] == record['normalization']['std']
  assert len(resolved['dataset']['mean']) == 3 and resolved['dataset']['std'][0] > 0
  assert _as_json(config) == resolved  # unchanged by the run
  assert files.read_json(os.path.join(workdir, 'config.json')) == resolved
  tuned = checkpoint.Checkpoints(workdir, config, read_only=True)
  assert tuned.read_record(2)['normalization'] == record['normalization']
  tuned.close()

  # eval and predict start from the run's config.json, as the CLI does without --config.
  for mode, overrides in (('eval', {}), ('predict', {'predict.input': os.path.join(folders[1], 'test', 'dog'),
                                                     'predict.output_csv': str(tmp_path / 'dogs.csv')})):
    restored = workdir_config.from_saved(files.read_json(os.path.join(workdir, 'config.json')))
    restored.update_from_flattened_dict(overrides)
    before = _as_json(restored)
    main.run(restored, workdir, mode, None)
    assert validated[-1] == before == _as_json(restored), mode
  assert len(validated) == 3
  with open(tmp_path / 'dogs.csv') as f:
    assert len(f.readlines()) == 1 + 2  # a header and the two dogs


def test_the_source_record_is_read_without_jax_at_the_step_orbax_picks(source, folders):
  """init_from.step latest, best (either way round) and a number name the step finetune restores."""
  directory = os.path.join(source, 'checkpoints')
  for step, overrides in (('latest', {}), ('best', {}), ('best', {'checkpoint.best_mode': 'min',
                                                                   'checkpoint.best_metric': 'eval_loss'}),
                          ('1', {}), ('best', {'checkpoint.best_metric': ''})):
    config = _config(folders[1], **{'init_from.checkpoint': source, 'init_from.step': step, **overrides})
    orbax = checkpoint.Checkpoints(source, config, read_only=True)
    expected = orbax.resolve(step, key='init_from.step')
    assert saved.best_step(directory, [1, 2], metric_names.best_metric(config),
                           config.checkpoint.best_mode) == orbax.best_step()
    assert resolution.source_record(config) == orbax.read_record(expected), (step, overrides)
    orbax.close()
  config = _config(folders[1], **{'init_from.checkpoint': source, 'init_from.step': '7'})
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"config.init_from.step='7' is not a saved step in .*; saved steps: \[1, 2\]"):
    resolution.source_record(config)


def test_resolution_fills_only_what_is_open(source, folders, tmp_path):
  """A value the user set stays; a run that already started keeps its config.json's numbers."""
  config = _config(folders[1], **{'init_from.checkpoint': source, 'dataset.normalize': 'unit'})
  resolution.resolve(config, str(tmp_path / 'fresh'), 'train')
  assert config.dataset.normalize == 'unit' and config.dataset.mean == ()
  started = tmp_path / 'started'
  started.mkdir()
  (started / 'config.json').write_text(json.dumps({'init_from': {'checkpoint': source}, 'dataset': {
      'normalize': 'fixed', 'mean': [0.5] * 3, 'std': [0.25] * 3, 'image_size': 0, 'crop_fraction': 0.0}}))
  config = _config(folders[1], **{'init_from.checkpoint': source})
  resolution.resolve(config, str(started), 'plan')
  assert (config.dataset.normalize, config.dataset.mean, config.dataset.std) == ('fixed', (0.5,) * 3,
                                                                                (0.25,) * 3)
  for mode in ('eval', 'predict', 'export'):  # a trained run's config was resolved when it trained
    config = _config(folders[1], **{'init_from.checkpoint': source})
    resolution.resolve(config, source, mode)
    assert _as_json(config) == _as_json(_config(folders[1], **{'init_from.checkpoint': source}))
  np.testing.assert_array_equal(config.dataset.std, ())


@pytest.mark.parametrize('metric, mode', [('eval_accuracy', 'max'), ('eval_loss', 'min'), ('', 'max')])
def test_the_best_step_is_orbaxs_with_ties_and_steps_without_metrics(metric, mode, tmp_path):
  config = defaults.get_config()
  config.checkpoint.keep, config.checkpoint.best_metric, config.checkpoint.best_mode = 10, metric, mode
  checkpoints = checkpoint.Checkpoints(str(tmp_path), config)
  accuracies = {1: 0.5, 2: 0.25, 3: 0.5, 4: None, 5: 0.25, 6: 0.125, 7: 0.125}  # ties at both ends
  for step, accuracy in accuracies.items():
    metrics = None if accuracy is None else {'eval_accuracy': accuracy, 'eval_loss': accuracy}
    checkpoints.save(step, {'w': jax.numpy.arange(2.0)}, {'step': step}, metrics=metrics)
    checkpoints.wait()
  steps = checkpoints.all_steps()
  assert steps == sorted(saved.complete_steps(checkpoints.directory)) == list(accuracies)
  best = saved.best_step(checkpoints.directory, steps, metric_names.best_metric(config), mode)
  assert best == checkpoints.best_step() == ({'max': 3, 'min': 7}[mode] if metric else 7)
  assert saved.read_record(checkpoints.directory, best) == checkpoints.read_record(best) == {'step': best}
  checkpoints.close()


def test_training_an_unresolved_fine_tune_is_one_line(source, folders, tmp_path):
  """A library caller that skips resolution gets an error, not other preprocessing than the CLI's."""
  config = _config(folders[1], **{'init_from.checkpoint': source})
  with pytest.raises(UserError, match=r'config.dataset.normalize/mean/std left open for init_from '
                                      r'.*/checkpoints/2; resolve the config before training: '
                                      r'flaxtpu.validation.resolution.resolve\('):
    train.train_and_evaluate(config, str(tmp_path / 'unresolved'))


def test_a_run_saved_before_model_padding_keeps_its_function_when_a_new_recipe_resumes_it(tmp_path):
  """Issue 43, class 8: config.json without model.padding computed 'same'; a recipe that leaves padding
  at its default resumes (or evaluates) it with 'same', and one that asks for another is one line."""
  from flaxtpu.settings.errors import ConfigError
  saved = defaults.get_config().to_dict()
  saved['model'].update(name='resnet20')
  del saved['model']['padding']
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  for mode in ('train', 'eval'):
    config = defaults.get_config()
    config.model.name = 'resnet20'
    resolution.resolve(config, str(tmp_path), mode)
    assert config.model.padding == 'same'
  saved['model']['padding'] = 'torch'  # a run saved since: its own value, which a config cannot change
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  config.model.padding = 'same'
  with pytest.raises(ConfigError, match=rf"^--workdir={tmp_path} was trained with model.padding='torch', but "
                                        r"the config asks for 'same', which computes another function"):
    resolution.resolve(config, str(tmp_path), 'train')
  config.model.name = 'resnet32'  # another model: the checkpoint's own checks name it
  resolution.resolve(config, str(tmp_path), 'train')
  assert config.model.padding == 'same'


def test_a_nan_in_a_source_runs_checkpoint_is_one_line(source, folders, tmp_path, monkeypatch):
  """init_from a flaxtpu run whose step holds a NaN (it diverged, or the file was damaged): one line naming
  the array, as for a published file's tensor (issue 43)."""
  real_restore = checkpoint.Checkpoints.restore

  def restore_with_a_nan(self, step, target, *args, **kwargs):
    arrays, record = real_restore(self, step, target, *args, **kwargs)
    node = arrays['params']
    while isinstance(node[next(iter(node))], dict):  # the first parameter's module
      node = node[next(iter(node))]
    name = next(iter(node))
    node[name] = node[name].at[(0,) * node[name].ndim].set(np.nan)
    return arrays, record

  monkeypatch.setattr(checkpoint.Checkpoints, 'restore', restore_with_a_nan)
  config = _config(folders[1], **{'init_from.checkpoint': source})
  if not main.FLAGS.is_parsed():  # main.run reads the cluster flags (their defaults here)
    main.FLAGS.mark_as_parsed()
  with pytest.raises(checkpoint.CheckpointError, match=(
      rf"^config.init_from.checkpoint {source}/checkpoints/2: array 'params/\S+' holds 1 NaN/Inf "
      r'value \(of \d+\); that run had diverged or the file is damaged: start from an earlier step')):
    main.run(config, str(tmp_path / 'tuned'), 'train', None)
