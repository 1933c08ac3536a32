"""Fine-tuning: init_from (partial loads, new head, skip, errors, resume), optimizer.freeze/lr_multipliers."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import cifar10_resnet
from conftest import make_image_folder, restore_checkpoint, tiny_dataset
from flaxtpu.data import loaders, pipeline
from flaxtpu.loop import start, train
from flaxtpu.optimizers import optim
from flaxtpu.settings import lengths
from flaxtpu.settings.errors import UserError
from flaxtpu.step import parallel, placing, steps
from flaxtpu.transfer import finetune
from flaxtpu.validation import config as config_lib
from flaxtpu.validation import resolution
from flaxtpu.weights import checkpoint

FIVE = ('a', 'b', 'c', 'd', 'e')


def _config(folder, **overrides):
  config = cifar10_resnet.get_config()  # resnet20: BatchNorm, SGD + nesterov, weight decay
  config.dataset.folder = folder
  config.batch_size = 16
  config.num_train_steps = 2
  config.checkpoint_every_steps = 1
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp('finetune_images')
  return (make_image_folder(root / 'three', train_per_class=8, test_per_class=2),
          make_image_folder(root / 'five', classes=FIVE, train_per_class=4, test_per_class=2, seed=1))


@pytest.fixture(scope='module')
def source(folders, tmp_path_factory):
  """A 3-class ResNet-20 trained 2 steps with fsdp (parameters split over 4 devices): steps 1 and 2 saved."""
  workdir = str(tmp_path_factory.mktemp('source'))
  config = _config(folders[0], eval_every_steps=2, **{'mesh.fsdp': 4, 'mesh.fsdp_min_size': 64})
  train.train_and_evaluate(config, workdir)
  return workdir


def _one_device_mesh():
  return jax.make_mesh((1, 1), ('data', 'fsdp'), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:1])


def _place(config):
  """(task, placement, fresh state) of a config, as the trainer builds them before the loop."""
  dataset = pipeline.load(config)
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std,
                           length=lengths.run_length(config, len(dataset.train)))
  placement = placing.place(task, parallel.make_mesh(config), config)
  return task, placement, placing.create_state(task, placement, config.seed), dataset


@pytest.fixture(scope='module')
def five_class(folders):
  """A fresh 5-class run on 8 devices (plain jit, seed 1): fine-tuning targets share it."""
  config = _config(folders[1], seed=1)
  task, placement, state, dataset = _place(config)
  fresh = jax.tree.map(np.asarray, placement.to_saveable(state))
  return config, task, placement, state, dataset.class_names, fresh


def _named(state):
  """{'params/stage1_block1/Conv_0/kernel': numpy array, ...} of a train state or a restored dict."""
  part = lambda c: state[c] if isinstance(state, dict) else getattr(state, c)
  return {f'{c}/{name}': np.asarray(leaf) for c in finetune.COLLECTIONS
          for name, leaf in optim.named_leaves(part(c)).items()}


def _init_from(five_class, checkpoint_path, **overrides):
  config, task, placement, state, class_names, _ = five_class
  config = config.copy_and_resolve_references()
  config.update_from_flattened_dict({'init_from.checkpoint': checkpoint_path, **overrides})
  new_state, info = finetune.init_from(config, task, placement, state, class_names)
  return _named(placement.to_saveable(new_state)), info


def _assert_loaded(loaded, source_state, fresh, reinitialised):
  source, fresh = _named(source_state), _named(fresh)
  for name, value in loaded.items():
    expected = fresh[name] if name in reinitialised else source[name]
    np.testing.assert_array_equal(value, expected, err_msg=name)  # bitwise


HEAD = {'params/Dense_0/kernel', 'params/Dense_0/bias'}


def test_three_class_run_initialises_a_five_class_run_with_a_new_head(source, five_class):
  loaded, info = _init_from(five_class, source)
  _assert_loaded(loaded, restore_checkpoint(source, 2), five_class[-1], HEAD)
  assert loaded['params/Dense_0/kernel'].shape == (64, 5)
  assert info['step'] == 2 and info['loaded'] == 63 + 42  # every array but the head's two
  assert info['reinitialised'] == {'classes differ': ['Dense_0/bias', 'Dense_0/kernel']}
  assert info['class_names'] == ['cat', 'dog', 'frog']


def test_a_fine_tuning_run_takes_its_sources_normalisation_and_keeps_it_on_resume(source, folders, tmp_path):
  """normalize=auto: the source run's standardisation numbers (not the new data's), recorded in config.json;
  a resumed run reads them from there, not from the source."""
  config = _config(folders[1], **{'dataset.normalize': 'auto', 'init_from.checkpoint': source})
  resolution.apply_source_defaults(config)
  saved = checkpoint.Checkpoints(source, config, read_only=True)
  normalization = saved.read_record(2)['normalization']
  saved.close()
  assert config.dataset.normalize == 'fixed' and config.dataset.image_size == 0
  np.testing.assert_array_equal(config.dataset.mean, normalization['mean'])
  np.testing.assert_array_equal(config.dataset.std, normalization['std'])
  # the new data's differ
  assert not np.allclose(pipeline.load(_config(folders[1])).mean, normalization['mean'])

  workdir = tmp_path / 'started'
  workdir.mkdir()
  (workdir / 'config.json').write_text(json.dumps({**config.to_dict(), 'dataset': {
      **config.dataset.to_dict(), 'mean': [0.5, 0.5, 0.5], 'std': [0.25, 0.25, 0.25]}}))
  resumed = _config(folders[1], **{'dataset.normalize': 'auto', 'init_from.checkpoint': source})
  resolution.apply_source_defaults(resumed, str(workdir))
  assert (tuple(resumed.dataset.mean), tuple(resumed.dataset.std)) == ((0.5,) * 3, (0.25,) * 3)


def test_a_config_that_leaves_the_model_open_fine_tunes_the_sources_model(source, folders, tmp_path,
                                                                            monkeypatch):
  """configs/finetune.py names no model: from a flaxtpu run, it trains that run's (as from published
  weights), with the options that shape its weights; a config that names one keeps it (the
  checkpoint's shapes then decide). A resumed run reads the model from its config.json."""
  open_model = _config(folders[1], **{'init_from.checkpoint': source, 'model.name': 'cnn'})
  resolution.apply_source_defaults(open_model)
  assert open_model.model.name == 'resnet20'
  named = _config(folders[1], **{'init_from.checkpoint': source, 'model.name': 'resnet32'})
  resolution.apply_source_defaults(named)
  assert named.model.name == 'resnet32'
  # A source saved before model.padding existed computed with its legacy value, 'same'.
  record = resolution.source_record(open_model)
  del record['config']['model']['padding']
  monkeypatch.setattr(resolution, 'source_record', lambda config: record)
  legacy = _config(folders[1], **{'init_from.checkpoint': source, 'model.name': 'cnn'})
  resolution.apply_source_defaults(legacy)
  assert (legacy.model.name, legacy.model.padding) == ('resnet20', 'same')

  started = tmp_path / 'started'
  started.mkdir()
  (started / 'config.json').write_text(json.dumps({**open_model.to_dict(), 'model': {
      **open_model.model.to_dict(), 'name': 'resnet44', 'padding': 'same'}}))
  resumed = _config(folders[1], **{'init_from.checkpoint': source, 'model.name': 'cnn'})
  resolution.apply_source_defaults(resumed, str(started))
  assert (resumed.model.name, resumed.model.padding) == ('resnet44', 'same')


def test_skip_reinitialises_the_matched_arrays_and_a_step_directory_picks_its_step(source, five_class):
  step_1 = os.path.join(source, 'checkpoints', '1')
  loaded, info = _init_from(five_class, step_1, **{'init_from.skip': ('^stage3_',)})
  stage3 = {name for name in loaded if name.split('/')[1].startswith('stage3_')}
  assert len(stage3) == 3 * 6 + 3 + 3 * 4 + 2  # params, then BN statistics, of three blocks and a projection
  _assert_loaded(loaded, restore_checkpoint(source, 1), five_class[-1], HEAD | stage3)
  assert info['step'] == 1 and len(info['reinitialised']['init_from.skip']) == len(stage3)
  assert not np.array_equal(loaded['params/stage1_block1/Conv_0/kernel'],
                            _named(restore_checkpoint(source, 2))['params/stage1_block1/Conv_0/kernel'])


def test_a_pmap_checkpoint_loads_into_a_jit_run(folders, five_class, tmp_path):
  """Saved the way the trainer saves (placement.to_saveable + Checkpoints.save), from seed 7."""
  config = _config(folders[0], seed=7, parallelism='pmap')
  task, placement, state, dataset = _place(config)
  workdir = str(tmp_path / 'pmap')
  saved = checkpoint.Checkpoints(workdir, config)
  saved.save(5, placement.to_saveable(state), start.checkpoint_record(config, task, 5, dataset, {}))
  saved.wait()
  saved.close()
  loaded, info = _init_from(five_class, workdir)
  _assert_loaded(loaded, restore_checkpoint(workdir, 5), five_class[-1], HEAD)
  assert info['step'] == 5


def _one_line_error(call, *fragments):
  with pytest.raises(UserError) as error:
    call()
  message = str(error.value)
  assert '\n' not in message
  for fragment in fragments:
    assert fragment in message, message


def test_no_checkpoint_and_another_model_are_one_line_errors(source, five_class, folders, tmp_path):
  missing = str(tmp_path / 'nowhere')
  _one_line_error(lambda: _init_from(five_class, missing),
                  f"init_from.checkpoint='{missing}' holds no flaxtpu checkpoint")
  os.makedirs(tmp_path / 'empty' / 'checkpoints')
  _one_line_error(lambda: _init_from(five_class, str(tmp_path / 'empty')), 'holds no complete checkpoint')
  _one_line_error(lambda: _init_from(five_class, source, **{'init_from.skip': ('^head/',)}),
                  "init_from.skip pattern '^head/' matches no parameter")
  # ResNet-18's stem and blocks are wider than ResNet-20's: same names, other shapes. No state is built.
  config = _config(folders[1], **{'model.name': 'resnet18', 'init_from.checkpoint': source})
  dataset = pipeline.load(config)
  task = steps.create_task(config, num_classes=5, image_shape=dataset.image_shape, mean=dataset.mean,
                           std=dataset.std, length=lengths.run_length(config, len(dataset.train)))
  placement = placing.place(task, parallel.make_mesh(config), config)
  _one_line_error(lambda: finetune.init_from(config, task, placement, None, dataset.class_names),
                  f'{source}/checkpoints/2 (resnet20) does not fit resnet18',
                  'Conv_0/kernel (3, 3, 3, 16) there, (7, 7, 3, 64) here',
                  "--config.init_from.skip='(\"^BatchNorm_0/\", \"^Conv_0/\"")


def _signal_at_first_save(monkeypatch):
  """SIGTERM as the first checkpoint is written (from the training thread, so the stop step is exact;
  a signal from the input pipeline's prefetch thread could come before step 1)."""
  real = checkpoint.Checkpoints.save

  def save(self, *args, **kwargs):
    if not getattr(save, 'signalled', False):
      save.signalled = True
      os.kill(os.getpid(), signal.SIGTERM)
    return real(self, *args, **kwargs)

  monkeypatch.setattr(checkpoint.Checkpoints, 'save', save)


def test_a_stopped_fine_tuning_run_resumes_from_its_own_checkpoint(source, folders, tmp_path, monkeypatch,
                                                                   caplog):
  """Frozen stage 1 (params and BatchNorm statistics) stays the source's, across the stop and the resume."""
  config = _config(folders[1], seed=1, num_train_steps=4, checkpoint_every_steps=2, eval_every_steps=4,
                   **{'init_from.checkpoint': source, 'optimizer.freeze': ('^stage1_',),
                      'optimizer.lr_multipliers': ('^stage2_=0.5',)})
  workdir = str(tmp_path / 'finetune')
  _signal_at_first_save(monkeypatch)
  stopped = train.train_and_evaluate(config, workdir)
  assert stopped['stopped_at_step'] == 3  # saved step 2, then stopped and saved after step 3
  monkeypatch.undo()
  moved = source + '.moved'  # the source is gone: a resume that read it would fail
  os.rename(source, moved)
  try:
    with caplog.at_level('INFO'):
      results = train.train_and_evaluate(config, workdir)
  finally:
    os.rename(moved, source)
  assert results['step'] == 4
  assert f'resuming from step {stopped["stopped_at_step"]}' in caplog.text
  with open(os.path.join(workdir, 'checkpoints', '4', 'record', 'metadata')) as f:
    record = json.load(f)
  assert record['init_from']['checkpoint'] == os.path.join(source, 'checkpoints', '2')
  final, original = _named(restore_checkpoint(workdir, 4)), _named(restore_checkpoint(source, 2))
  for name, value in final.items():
    if '/stage1_' in name:
      np.testing.assert_array_equal(value, original[name], err_msg=name)
    elif name.startswith('params/stage') or name.startswith('batch_stats/'):
      assert not np.array_equal(value, original[name]), name


# --- optimizer.freeze and optimizer.lr_multipliers ------------------------------------------------


def _train_steps(num_steps, **overrides):
  """ResNet-20 trained `num_steps` from the seed on 8 devices: (initial, final) host states by name."""
  config = _config('', num_train_steps=num_steps, **overrides)
  dataset = tiny_dataset()
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=dataset.mean, std=dataset.std,
                           length=lengths.run_length(config, len(dataset.train)))
  # One device compiles fastest; the fine-tuning run above trains frozen arrays on eight.
  placement = placing.place(task, _one_device_mesh(), config)
  state = placing.create_state(task, placement, config.seed)
  initial = _named(placement.to_saveable(state))
  for batch in loaders.train_batches(dataset, seed=0, batch_size=16, first_step=0, last_step=num_steps):
    state, _ = placement.train_step(state, placement.put_train_batch(tuple(batch)[:2]))
  final = placement.to_saveable(state)
  return initial, _named(final), final.opt_state


@pytest.fixture(scope='module')
def frozen_run():
  return _train_steps(3, **{'optimizer.freeze': ('^stage1_', '^Conv_0/', '^BatchNorm_0/')})


def test_freeze_keeps_parameters_and_batchnorm_statistics_bitwise(frozen_run):
  initial, final, opt_state = frozen_run
  frozen = {name for name in initial if name.split('/')[1].startswith(('stage1_', 'Conv_0', 'BatchNorm_0'))}
  assert len(frozen) == 3 + 2 + 3 * (6 + 4)  # stem conv + BN (+ statistics), 3 blocks of 2 convs + 2 BNs
  for name in initial:
    if name in frozen:
      np.testing.assert_array_equal(final[name], initial[name], err_msg=name)
    else:
      assert not np.array_equal(final[name], initial[name]), name
  # No optimizer state for frozen arrays: one momentum buffer per trainable parameter.
  num_trainable = sum(name.startswith('params/') and name not in frozen for name in initial)
  assert len(jax.tree.leaves(opt_state)) == num_trainable + 1  # + the schedule's step count


def test_multiplier_zero_equals_freeze(frozen_run):
  multipliers = ('^stage1_=0', '^Conv_0/=0', '^BatchNorm_0/=0.0')
  _, final, _ = _train_steps(3, **{'optimizer.lr_multipliers': multipliers})
  for name, value in frozen_run[1].items():
    np.testing.assert_array_equal(final[name], value, err_msg=name)


def _params():
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  return {'stage1': {'Conv_0': {'kernel': jax.random.normal(keys[0], (3, 3, 4, 8)),
                                'bias': jax.random.normal(keys[1], (8,))}},
          'Dense_0': {'kernel': jax.random.normal(keys[2], (8, 5)), 'bias': jax.random.normal(keys[3], (5,))}}


@pytest.mark.parametrize('name', ['sgd', 'adam', 'adamw'])
def test_multiplier_half_gives_half_the_update_with_weight_decay_masked(name):
  params, length = _params(), lengths.RunLength(10, 10, 10, 10, 0)
  grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)

  def update(*multipliers):
    config = _config('', **{'optimizer.name': name, 'optimizer.momentum': 0.0, 'optimizer.weight_decay': 0.1,
                            'optimizer.learning_rate': 0.5, 'schedule.name': 'constant',
                            'optimizer.lr_multipliers': multipliers})
    optimizer, _ = optim.create_optimizer(config, length)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return optim.named_leaves(updates)

  full, half = update(), update('^stage1/=0.5')
  for leaf in full:
    expected = full[leaf] * (0.5 if leaf.startswith('stage1/') else 1.0)
    np.testing.assert_allclose(half[leaf], expected, rtol=1e-6, atol=0, err_msg=leaf)
  if name == 'sgd':  # plain SGD: the update is -lr * (g + decay * w) for kernels, -lr * g for biases
    flat_params, flat_grads = optim.named_leaves(params), optim.named_leaves(grads)
    for leaf, value in full.items():
      decay = 0.1 * flat_params[leaf] if leaf.endswith('kernel') else 0.0
      np.testing.assert_allclose(value, -0.5 * (flat_grads[leaf] + decay), rtol=1e-6, err_msg=leaf)


def test_param_groups_labels_and_a_pattern_that_matches_nothing():
  groups = optim.ParamGroups(freeze=('^Dense_0/bias',), multipliers=(('Dense', 0.1), ('^stage1/', 0.0)))
  assert groups.check(_params()) == {'frozen': ['Dense_0/bias', 'stage1/Conv_0/bias', 'stage1/Conv_0/kernel'],
                                     '0.1': ['Dense_0/kernel']}
  with pytest.raises(UserError, match="optimizer.freeze pattern 'head' matches no parameter; the top-level "
                                      'modules are: Dense_0, stage1'):
    optim.ParamGroups(freeze=('head',)).check(_params())
  config = _config('')
  config.optimizer.lr_multipliers = ('stage1=fast',)
  with pytest.raises(UserError, match="entry 'stage1=fast' must be 'regex=factor'"):
    config_lib.validate(config)
