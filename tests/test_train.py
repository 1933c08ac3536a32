"""The step functions: learning, and equal results on 1 device, jit over 8, pmap over 8, fsdp."""

import dataclasses

import jax
import numpy as np
import pytest

from configs import cifar10_resnet
from conftest import tiny_dataset
from flaxtpu.data import loaders, pipeline
from flaxtpu.loop import progress
from flaxtpu.settings import lengths
from flaxtpu.settings.errors import UserError
from flaxtpu.step import parallel, placing, steps

STEPS = 5


def _config(**overrides):
  config = cifar10_resnet.get_config()  # resnet20, BatchNorm, crop + flip, SGD + nesterov, label smoothing
  config.batch_size = 16
  config.num_train_steps = STEPS
  config.schedule.warmup_epochs = 0.0
  config.optimizer.learning_rate = 0.05
  config.update_from_flattened_dict(overrides)
  return config


def run_steps(config, mesh, dataset=None, num_steps=STEPS):
  """Trains `num_steps` steps from the seed; returns (losses, host params, host batch stats, state)."""
  dataset = dataset or tiny_dataset()
  length = lengths.run_length(config, len(dataset.train))
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=dataset.mean,
                           std=dataset.std, length=length)
  placement = placing.place(task, mesh, config)
  state = placing.create_state(task, placement, config.seed)
  losses = []
  for batch in loaders.train_batches(dataset, seed=config.seed, batch_size=config.batch_size,
                                     first_step=0, last_step=num_steps):
    state, step_metrics = placement.train_step(state, placement.put_train_batch(tuple(batch)[:2]))
    losses.append(float(placement.to_host_metrics(step_metrics).compute()['loss']))
  saved = placement.to_saveable(state)
  return np.array(losses), parallel.host_copy(saved.params), parallel.host_copy(saved.batch_stats), saved


def _mesh(data_size, fsdp_size=1):
  return jax.make_mesh((data_size, fsdp_size), ('data', 'fsdp'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:data_size * fsdp_size])


def _assert_trees_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=atol, rtol=1e-4)


def test_training_lowers_the_loss_on_a_fixed_batch():
  config = _config(**{'model.name': 'cnn', 'optimizer.name': 'adam', 'optimizer.learning_rate': 0.01,
                      'augment.crop_padding': 0, 'augment.flip': False, 'label_smoothing': 0.0})
  dataset = tiny_dataset()
  fixed = pipeline.Examples(images=dataset.train.images[:16], labels=dataset.train.labels[:16])
  dataset = dataclasses.replace(dataset, train=fixed, eval=fixed)
  losses, *_ = run_steps(config, _mesh(8), dataset, num_steps=30)
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.fixture(scope='module')
def reference():
  """One device, plain jit: the ground truth for every parallel layout."""
  return run_steps(_config(), _mesh(1))


def test_jit_on_8_devices_equals_one_device(reference):
  losses, params, batch_stats, state = run_steps(_config(), _mesh(8))
  np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
  _assert_trees_close(params, reference[1], atol=1e-5)
  _assert_trees_close(batch_stats, reference[2], atol=1e-5)
  assert int(state.step) == STEPS
  assert losses[-1] < losses[0]


def test_pmap_on_8_devices_equals_one_device(reference):
  losses, params, batch_stats, _ = run_steps(_config(parallelism='pmap'), _mesh(8))
  np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
  _assert_trees_close(params, reference[1], atol=1e-5)
  _assert_trees_close(batch_stats, reference[2], atol=1e-5)


def test_fsdp_shards_large_kernels_and_matches(reference):
  config = _config(**{'mesh.data': 2, 'mesh.fsdp': 4, 'mesh.fsdp_min_size': 4096})
  losses, params, _, state = run_steps(config, parallel.make_mesh(config))
  np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
  _assert_trees_close(params, reference[1], atol=1e-5)
  kernel = state.params['stage3_block3']['Conv_1']['kernel']  # 3x3x64x64 = 36,864 elements
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, 'fsdp', None)
  assert kernel.addressable_shards[0].data.shape == (3, 3, 16, 64)
  # Momentum follows its parameter; small arrays stay replicated.
  momentum = jax.tree.leaves(state.opt_state[-1])  # sgd trace, one leaf per param
  assert any(m.sharding.spec == jax.sharding.PartitionSpec(None, None, 'fsdp', None) for m in momentum)
  assert state.params['Dense_0']['bias'].sharding.spec == jax.sharding.PartitionSpec()


RECIPE_PARTS = {'augment.policy': 'randaugment', 'augment.mixup_alpha': 0.4, 'augment.cutmix_alpha': 1.0,
                'ema.decay': 0.9, 'optimizer.accumulate_steps': 2}


@pytest.fixture(scope='module')
def recipe_on_one_device():
  """The recipe's parts on one device, 4 steps: what jit and pmap over 8 devices must reproduce."""
  return run_steps(_config(**RECIPE_PARTS), _mesh(1), num_steps=4)


@pytest.mark.parametrize('parallelism', ['jit', 'pmap'])
def test_randaugment_mixing_ema_and_accumulation_are_the_same_on_8_devices(parallelism, recipe_on_one_device,
                                                                            reference):
  """Per-example randomness comes from (seed, step, position): 8 devices see the batch 1 device does."""
  one = recipe_on_one_device
  eight = run_steps(_config(parallelism=parallelism, **RECIPE_PARTS), _mesh(8), num_steps=4)
  np.testing.assert_allclose(eight[0], one[0], rtol=1e-5)
  _assert_trees_close(eight[1], one[1], atol=1e-5)
  _assert_trees_close(eight[3].ema, one[3].ema, atol=1e-5)
  # The parts act: the plain recipe's first 4 steps on one device (the reference's, the same schedule) differ.
  assert not np.allclose(one[0], reference[0][:4])


def test_bfloat16_loss_stays_close_to_float32(reference):
  losses, params, batch_stats, _ = run_steps(_config(dtype='bfloat16'), _mesh(8))
  # Same steps, same batches: bf16 activations move the loss by well under 5%.
  np.testing.assert_allclose(losses, reference[0], rtol=0.05)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype('float32')}
  assert {x.dtype for x in jax.tree.leaves(batch_stats)} == {np.dtype('float32')}


@pytest.mark.parametrize('key', ['batch_size', 'eval_batch_size'])
def test_batch_that_does_not_divide_over_devices_is_named(key):
  config = _config(**{key: 12})
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=np.zeros(3),
                           std=np.ones(3))
  with pytest.raises(UserError, match=f'config.{key}=12 does not divide over 8 devices'):
    placing.place(task, _mesh(8), config)


def test_eta_counts_the_evaluations_and_saves_still_to_come(monkeypatch):
  from flaxtpu.settings.lengths import RunLength
  clock_time = [1000.0]
  monkeypatch.setattr(progress.time, 'time', lambda: clock_time[0])
  clock = progress.TrainClock(first_step=0, progress=progress.Progress())
  length = RunLength(total_steps=100, steps_per_epoch=10, eval_every_steps=25, checkpoint_every_steps=10,
                     warmup_steps=0)
  clock_time[0] += 20.0  # 20 steps take 20 s
  images_per_sec, shares = clock.lap(20, batch_size=8)
  assert images_per_sec == 8.0 and shares['other'] == 1.0
  for kind, seconds in (('eval', 6.0), ('eval', 4.0), ('save', 1.0)):
    with clock.paused(kind):
      clock_time[0] += seconds
  # 80 steps x 1 s + evals at 25, 50, 75, 100 x 5 s + saves at 30, ..., 100 x 1 s.
  assert clock.eta(20, length) == 80 + 4 * 5 + 8 * 1
  assert clock.eta(100, length) == 0


def test_progress_keeps_the_layout_of_the_checkpoint_record_and_adds_up_the_attempts(monkeypatch):
  saved = {'train': {'train_loss': 1.5, 'train_accuracy': 0.25}, 'eval': {'eval_accuracy': 0.5},
           'train_seconds': 10.0, 'train_steps': 20, 'time_to_first_step_s': 3.0, 'wall_time_s': 15.0,
           'memory_plan': {'total_bytes': 7}}
  assert progress.Progress.from_json(saved).to_json() == saved  # what earlier runs saved reads back the same
  assert progress.Progress.from_json({'train_steps': 2}) == progress.Progress(train_steps=2)  # older records
  clock_time = [1000.0]
  monkeypatch.setattr(progress.time, 'time', lambda: clock_time[0])
  clock = progress.TrainClock(first_step=20, progress=progress.Progress.from_json(saved), started=990.0)
  clock_time[0] += 5.0  # 10 more steps in 5 s, 15 s after this attempt started
  clock.lap(30, batch_size=8)
  results = clock.record().results(total_steps=30, batch_size=8)
  assert results == {'step': 30, 'eval_accuracy': 0.5, 'train_loss': 1.5, 'train_accuracy': 0.25,
                     'train_images_per_sec': 30 * 8 / 15.0, 'wall_time_s': 15.0 + 15.0,
                     'time_to_first_step_s': 3.0, 'memory_plan': {'total_bytes': 7}}
