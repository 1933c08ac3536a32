"""Issue 41's optimizers: Muon, schedule-free (parameters hold its averaged x), SAM/ASAM (per micro-batch,
equal under every sharding), float16's dynamic loss scale; checked against optax and formulas by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train import _assert_trees_close, _config, _mesh, run_steps

from flaxtpu import models
from flaxtpu.data import loaders
from flaxtpu.optimizers import (
  loss_scale,
  optim,
  optim_contrib,
  sam,
)
from flaxtpu.settings import (
  defaults,
  lengths,
)
from flaxtpu.step import (
  gradients,
  parallel,
  placing,
  steps,
)
from flaxtpu.validation import config as config_lib
from flaxtpu.validation.config import ConfigError


def _opt_config(**overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({'batch_size': 8, 'num_train_steps': 16, 'schedule.name': 'constant',
                                     'model.name': 'cnn', **overrides})
  config_lib.validate(config)
  return config


def _optimizer(config):
  return optim.create_optimizer(config, lengths.run_length(config, 64))[0]


def _cnn_params():
  model = models.create('cnn', num_classes=3)
  return model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)), train=False)['params']


def test_muon_orthogonalises_kernels_below_the_head_and_adamw_trains_the_rest():
  lr = 0.1
  config = _opt_config(**{'optimizer.name': 'muon', 'optimizer.learning_rate': lr, 'optimizer.momentum': 0.95,
                          'optimizer.muon_adam_lr': 0.01})
  params = _cnn_params()
  grads = jax.tree.map(lambda p: jnp.sin(7.0 * p + 1.0), params)
  optimizer = _optimizer(config)
  updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
  for name in ('stage1/Conv_0/kernel', 'stage2/Conv_0/kernel'):  # (H, W, I, O) read as (H*W*I, O)
    update = optim.named_leaves(updates)[name]
    matrix = np.asarray(update).reshape(-1, update.shape[-1])
    fan_in, fan_out = matrix.shape
    singular = np.linalg.svd(matrix / (lr * max(1.0, fan_out / fan_in) ** 0.5), compute_uv=False)
    assert 0.5 < singular.min() and singular.max() < 1.3, (name, singular)  # Newton-Schulz: ~orthogonal
  # The head and the biases: AdamW's first step, -lr * sign(g), at muon_adam_lr.
  for name in ('Dense_0/kernel', 'Dense_0/bias', 'stage1/Conv_0/bias'):
    np.testing.assert_allclose(optim.named_leaves(updates)[name],
                               -0.01 * np.sign(optim.named_leaves(grads)[name]), rtol=1e-3, err_msg=name)


@pytest.mark.parametrize('name', ['schedule_free_adamw', 'schedule_free_sgd'])
def test_schedule_free_params_hold_the_averaged_weights_of_optaxs_own_loop(name):
  config = _opt_config(**{'optimizer.name': name, 'optimizer.learning_rate': 0.05,
                          'optimizer.momentum': 0.9, 'optimizer.weight_decay': 0.01})
  params = _cnn_params()
  target = jax.tree.map(lambda p: jnp.cos(p), params)
  grad = lambda point: jax.tree.map(lambda w, t: w - t, point, target)
  optimizer = _optimizer(config)
  update = jax.jit(optimizer.update)
  # optax's loop: the parameters are y; x comes out of schedule_free_eval_params.
  y, state = params, optimizer.init(params)
  for _ in range(6):
    updates, state = update(grad(y), state, y)
    y = optax.apply_updates(y, updates)
  expected_x = optax.contrib.schedule_free_eval_params(optim_contrib.schedule_free_state(state), y)
  # flaxtpu's train step: params are x, the gradient point y is formed from x and z.
  @jax.jit
  def train_step(x, state):
    point = optim_contrib.gradient_point(state, x)
    updates, state = optimizer.update(grad(point), state, point)
    return optim_contrib.averaged(state, optax.apply_updates(point, updates), x), state

  x, state = params, optimizer.init(params)
  for _ in range(6):
    x, state = train_step(x, state)
  for got, want in zip(jax.tree.leaves(x), jax.tree.leaves(expected_x)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(optim_contrib.gradient_point(state, x)), jax.tree.leaves(y)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(jax.tree.leaves(x)[0], jax.tree.leaves(y)[0])  # x and y differ: eval reads x


def _quadratic(target):
  return lambda params: (0.5 * sum(jnp.sum((p - t) ** 2 * (1 + p ** 2)) for p, t in
                                   zip(jax.tree.leaves(params), jax.tree.leaves(target))), ())


def test_sam_gradient_is_taken_at_rho_along_the_gradient_and_asam_scales_it_per_weight():
  params = {'a': jnp.array([1.0, -2.0, 0.5]), 'b': jnp.array([[0.3, 0.0]])}
  target = {'a': jnp.array([0.0, 1.0, 0.0]), 'b': jnp.array([[1.0, -1.0]])}
  loss_fn = _quadratic(target)
  g = jax.grad(lambda p: loss_fn(p)[0])(params)
  for adaptive, rho in ((False, 0.05), (True, 0.5)):
    got = gradients.compute(loss_fn, params, (), sam_rho=rho, sam_adaptive=adaptive,
                            param_groups=optim.ParamGroups(), axis_name=None)
    if adaptive:
      t = jax.tree.map(lambda p: jnp.abs(p) + sam.ASAM_ETA, params)
      norm = optax.global_norm(jax.tree.map(lambda s, x: s * x, t, g))
      e = jax.tree.map(lambda s, x: rho * s * s * x / norm, t, g)
    else:
      e = jax.tree.map(lambda x: rho * x / optax.global_norm(g), g)
      assert float(optax.global_norm(e)) == pytest.approx(rho, rel=1e-5)
    expected = jax.grad(lambda p: loss_fn(p)[0])(jax.tree.map(jnp.add, params, e))
    _assert_trees_close(got.grads, expected, atol=1e-6)
    assert float(got.loss) == pytest.approx(float(loss_fn(params)[0]))  # the unperturbed loss is reported


def test_sam_under_accumulation_perturbs_each_micro_batch_by_its_own_gradient():
  config = _opt_config(**{'optimizer.name': 'sgd', 'optimizer.momentum': 0.0, 'optimizer.learning_rate': 0.1,
                          'optimizer.accumulate_steps': 2, 'optimizer.sam_rho': 0.05})
  optimizer = _optimizer(config)
  params = {'w': jnp.array([1.0, -2.0, 0.5])}
  targets = [{'w': jnp.array([0.0, 1.0, 0.0])}, {'w': jnp.array([2.0, 0.0, -1.0])}]
  state, sam_grads = optimizer.init(params), []
  for target in targets:  # two micro-batches of one update
    got = gradients.compute(_quadratic(target), params, state, sam_rho=0.05, sam_adaptive=False,
                            param_groups=optim.ParamGroups(), axis_name=None)
    updates, state = optimizer.update(got.grads, state, params)
    params_after = optax.apply_updates(params, updates)
    g = jax.grad(lambda p, t=target: _quadratic(t)(p)[0])(params)['w']
    sam_grads.append(jax.grad(lambda p, t=target: _quadratic(t)(p)[0])(
        {'w': params['w'] + 0.05 * g / jnp.linalg.norm(g)})['w'])
  np.testing.assert_allclose(params_after['w'], params['w'] - 0.1 * (sam_grads[0] + sam_grads[1]) / 2,
                             rtol=1e-6)


SAM_PARTS = {'model.name': 'cnn', 'optimizer.sam_rho': 0.05, 'optimizer.accumulate_steps': 2}


@pytest.fixture(scope='module')
def sam_reference():
  return run_steps(_config(**SAM_PARTS), _mesh(1), num_steps=4)


@pytest.mark.parametrize('layout', ['jit', pytest.param('pmap', marks=pytest.mark.slow), 'fsdp'])
def test_sam_with_accumulation_is_the_same_on_8_devices_under_jit_pmap_and_fsdp(sam_reference, layout):
  overrides = {'jit': {}, 'pmap': {'parallelism': 'pmap'},
               'fsdp': {'mesh.data': 2, 'mesh.fsdp': 4, 'mesh.fsdp_min_size': 512}}[layout]
  config = _config(**SAM_PARTS, **overrides)
  mesh = parallel.make_mesh(config) if layout == 'fsdp' else _mesh(8)
  losses, params, batch_stats, _ = run_steps(config, mesh, num_steps=4)
  np.testing.assert_allclose(losses, sam_reference[0], rtol=1e-5)
  _assert_trees_close(params, sam_reference[1], atol=1e-5)
  if layout == 'jit':
    plain = run_steps(_config(**{**SAM_PARTS, 'optimizer.sam_rho': 0.0}), _mesh(8), num_steps=4)
    assert not np.allclose(plain[1]['Dense_0']['kernel'], sam_reference[1]['Dense_0']['kernel'])  # SAM acts


def test_float16_overflow_skips_the_step_and_halves_the_scale():
  config = _config(**{'model.name': 'cnn', 'dtype': 'float16'})
  from conftest import tiny_dataset
  dataset = tiny_dataset()
  length = lengths.run_length(config, len(dataset.train))
  task = steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=dataset.mean, std=dataset.std,
                           length=length)
  placement = placing.place(task, _mesh(1), config)
  state = placing.create_state(task, placement, config.seed)
  assert float(state.opt_state.dynamic_scale.scale) == loss_scale.INITIAL_SCALE
  huge = state.opt_state.dynamic_scale.replace(scale=jnp.float32(3e38))  # the scaled loss overflows
  state = state.replace(opt_state=loss_scale.put(state.opt_state, huge))
  before = jax.tree.map(np.asarray, state)
  batches = [placement.put_train_batch(tuple(b)[:2]) for b in loaders.train_batches(
      dataset, seed=0, batch_size=config.batch_size, first_step=0, last_step=2)]
  state, skipped = placement.train_step(state, batches[0])
  skipped = skipped.compute()
  assert int(state.step) == 1 and float(skipped['skipped_steps']) == 1.0 and float(skipped['loss']) == 0.0
  assert float(state.opt_state.dynamic_scale.scale) == pytest.approx(1.5e38)
  for got, want in zip(jax.tree.leaves((state.params, state.batch_stats, state.opt_state.inner)),
                       jax.tree.leaves((before.params, before.batch_stats, before.opt_state.inner))):
    np.testing.assert_array_equal(got, want)  # nothing moved
  fine = state.opt_state.dynamic_scale.replace(scale=jnp.float32(1024.0))
  state, taken = placement.train_step(state.replace(opt_state=loss_scale.put(state.opt_state, fine)),
                                      batches[1])
  taken = taken.compute()
  assert float(taken['skipped_steps']) == 0.0 and 0.5 < float(taken['loss']) < 2.0
  assert float(taken['loss_scale']) == 1024.0
  assert not np.array_equal(state.params['Dense_0']['kernel'], before.params['Dense_0']['kernel'])


@pytest.mark.parametrize('overrides, message', [
    ({'optimizer.name': 'schedule_free_adamw', 'schedule.name': 'cosine'}, 'schedule.name=constant'),
    ({'optimizer.name': 'schedule_free_sgd', 'optimizer.freeze': ('^stage1',)}, 'optimizer.freeze'),
    ({'optimizer.sam_rho': -0.1}, 'sam_rho'),
    ({'optimizer.sam_adaptive': True}, 'sam_adaptive=True needs SAM'),
    ({'optimizer.muon_adam_lr': 0.01}, 'no effect on optimizer.name'),
    ({'dtype': 'float8'}, 'dtype'),
    ({'time_budget': '90 minutes'}, 'time_budget'),
    ({'time_budget': '90s', 'num_train_steps': 100}, 'drop --config.num_train_steps'),
    ({'lr_find.max_lr': 1e-7}, 'lr_find.min_lr'),
])
def test_bad_keys_are_one_line_errors(overrides, message):
  config = defaults.get_config()
  config.dataset.folder = '/tmp'
  config.update_from_flattened_dict(overrides)
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace('.', r'\.')):
    config_lib.validate(config)
