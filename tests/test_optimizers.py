"""Optimizers, schedules and layer-wise learning-rate decay against optax chains and formulas by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxtpu import models
from flaxtpu.optimizers import optim
from flaxtpu.settings import defaults, lengths
from flaxtpu.validation import config as config_lib
from flaxtpu.validation.config import ConfigError

EXAMPLES = 64  # at batch 8: 8 steps an epoch
KERNELS = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # what weight decay and trust ratios see


def _config(**overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({'batch_size': 8, 'num_train_steps': 16, 'schedule.name': 'constant',
                                     'optimizer.learning_rate': 0.1, **overrides})
  config_lib.validate(config)
  return config


def _params():
  rng = np.random.default_rng(0)
  shapes = {'Conv_0': {'kernel': (3, 3, 2, 4)}, 'stage1': {'kernel': (4, 6), 'bias': (6,)},
            'Dense_0': {'kernel': (6, 3), 'bias': (3,)}}
  return jax.tree.map(lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def _gradients(params, count):
  """`count` different gradients of the shapes of `params`."""
  return [jax.tree.map(lambda p, i=i: jnp.sin(3.0 * p + i) + 0.1 * i, params) for i in range(count)]


def _run(optimizer, params, gradients, compile=False):
  state, update = optimizer.init(params), jax.jit(optimizer.update) if compile else optimizer.update
  for grads in gradients:
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _assert_trees_close(got, expected):
  for name, leaf in optim.named_leaves(got).items():
    np.testing.assert_allclose(leaf, optim.named_leaves(expected)[name], rtol=1e-6, atol=1e-7, err_msg=name)


# optimizer.name, its non-default keys, the same optimizer written with optax's own functions. Weight
# decay 0.01 on kernels only; L2 ones decay before the optimizer, decoupled ones inside it.
LR, WD = 0.1, 0.01
L2 = optax.add_decayed_weights(WD, mask=KERNELS)
HAND_WRITTEN = {
    'sgd': ({'optimizer.momentum': 0.8, 'optimizer.nesterov': True},
            optax.chain(L2, optax.trace(decay=0.8, nesterov=True), optax.scale_by_learning_rate(LR))),
    'adam': ({'optimizer.b1': 0.8, 'optimizer.b2': 0.99},
             optax.chain(L2, optax.scale_by_adam(b1=0.8, b2=0.99, eps=1e-7),
                         optax.scale_by_learning_rate(LR))),
    'adamw': ({'optimizer.eps': 1e-6},
              optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-6, weight_decay=WD, mask=KERNELS)),
    'lamb': ({'optimizer.b2': 0.98},
             optax.chain(optax.scale_by_adam(b1=0.9, b2=0.98, eps=1e-7),
                         optax.add_decayed_weights(WD, mask=KERNELS),
                         optax.masked(optax.scale_by_trust_ratio(), KERNELS),
                         optax.scale_by_learning_rate(LR))),
    'lars': ({'optimizer.trust_coefficient': 0.02},
             optax.lars(LR, weight_decay=WD, weight_decay_mask=KERNELS, trust_coefficient=0.02,
                        trust_ratio_mask=KERNELS, momentum=0.9)),
    'lion': ({}, optax.lion(LR, b1=0.9, b2=0.99, weight_decay=WD, mask=KERNELS)),  # b2 -1: Lion's own 0.99
    'adafactor': ({'optimizer.min_dim_size_to_factor': 3, 'optimizer.decay_rate': 0.7,
                   'optimizer.clipping_threshold': 0.5},
                  optax.adafactor(LR, min_dim_size_to_factor=3, decay_rate=0.7, clipping_threshold=0.5,
                                  weight_decay_rate=WD, weight_decay_mask=KERNELS)),
    'rmsprop': ({'optimizer.centered': True, 'optimizer.decay': 0.95, 'optimizer.momentum': 0.5},
                optax.chain(L2, optax.rmsprop(LR, decay=0.95, eps=1e-7, centered=True, momentum=0.5))),
    # Muon: kernels below the head (a conv's reduced over H, W, I), the rest (head, biases) to its AdamW.
    'muon': ({}, optax.contrib.muon(
        LR, beta=0.9, nesterov=False, weight_decay=WD, weight_decay_mask=KERNELS, adam_b1=0.9, adam_b2=0.999,
        eps=1e-7, muon_weight_dimension_numbers=lambda params: {
            'Conv_0': {'kernel': optax.contrib.MuonDimensionNumbers((0, 1, 2), 3)},
            'stage1': {'kernel': optax.contrib.MuonDimensionNumbers((0,), 1), 'bias': None},
            'Dense_0': {'kernel': None, 'bias': None}})),
    'schedule_free_adamw': ({}, optax.contrib.schedule_free(optax.chain(
        optax.scale_by_rms(decay=0.999, eps=1e-7, eps_in_sqrt=False, bias_correction=True),
        optax.add_decayed_weights(WD, mask=KERNELS), optax.scale_by_learning_rate(LR)), LR, b1=0.9)),
    'schedule_free_sgd': ({}, optax.contrib.schedule_free(
        optax.chain(optax.add_decayed_weights(WD, mask=KERNELS), optax.sgd(LR)), LR, b1=0.9)),
}


@pytest.mark.parametrize('name', config_lib.OPTIMIZERS)
def test_each_optimizer_is_its_optax_chain(name):
  keys, hand_written = HAND_WRITTEN[name]
  config = _config(**{'optimizer.name': name, 'optimizer.learning_rate': LR, 'optimizer.weight_decay': WD,
                      **keys})
  optimizer, _ = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
  params = _params()
  gradients = _gradients(params, 3)
  compile = name == 'muon'  # its Newton-Schulz iterations run slowly op by op
  got, _ = _run(optimizer, params, gradients, compile=compile)
  expected, _ = _run(hand_written, params, gradients, compile=compile)
  _assert_trees_close(got, expected)
  assert not np.allclose(got['Dense_0']['kernel'], params['Dense_0']['kernel'])


def test_sgd_without_momentum_is_plain_sgd_with_no_state():
  config = _config(**{'optimizer.name': 'sgd', 'optimizer.momentum': 0.0, 'optimizer.weight_decay': WD})
  optimizer, _ = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
  params = _params()
  grads = _gradients(params, 1)
  got, state = _run(optimizer, params, grads)
  decayed = jax.tree.map(lambda g, p: g + WD * p * (p.ndim > 1), grads[0], params)
  _assert_trees_close(got, jax.tree.map(lambda p, g: p - LR * g, params, decayed))
  assert not any(isinstance(node, optax.TraceState)
                 for node in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.TraceState)))


@pytest.mark.parametrize('name', ['lamb', 'lion'])
def test_decay_masks_freezing_multipliers_accumulation_and_lookahead_wrap_lamb_and_lion(name):
  """create_optimizer against the same steps by hand: the frozen array out, two batches averaged per
  update, the optimizer on the rest, Dense_0's kernel at 0.1 x the rate, every second update a
  Lookahead sync halfway to the fast weights."""
  config = _config(**{'optimizer.name': name, 'optimizer.learning_rate': LR, 'optimizer.weight_decay': WD,
                      'optimizer.freeze': ('^Conv_0/',), 'optimizer.lr_multipliers': ('^Dense_0/kernel=0.1',),
                      'optimizer.accumulate_steps': 2, 'optimizer.lookahead_every': 2,
                      'num_train_steps': 8})
  optimizer, _ = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
  params = _params()
  gradients = _gradients(params, 8)
  got, _ = _run(optimizer, params, gradients, compile=True)  # MultiSteps runs slowly op by op

  hand_written = HAND_WRITTEN[name][1] if name == 'lion' else optax.chain(
      optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-7), optax.add_decayed_weights(WD, mask=KERNELS),
      optax.masked(optax.scale_by_trust_ratio(), KERNELS), optax.scale_by_learning_rate(LR))
  trainable = lambda tree: {key: value for key, value in tree.items() if key != 'Conv_0'}
  fast = slow = trainable(params)
  state, hand_update = hand_written.init(fast), jax.jit(hand_written.update)
  for update in range(4):
    pair = gradients[2 * update:2 * update + 2]
    mean = jax.tree.map(lambda a, b: (a + b) / 2, trainable(pair[0]), trainable(pair[1]))
    updates, state = hand_update(mean, state, fast)
    updates['Dense_0']['kernel'] = 0.1 * updates['Dense_0']['kernel']
    fast = optax.apply_updates(fast, updates)
    if update % 2 == 1:
      fast = slow = jax.tree.map(lambda s, f: s + 0.5 * (f - s), slow, fast)
  _assert_trees_close(got, {**fast, 'Conv_0': params['Conv_0']})
  np.testing.assert_array_equal(got['Conv_0']['kernel'], params['Conv_0']['kernel'])


def test_a_zero_gradient_decays_kernels_only_and_bias_weight_decay_biases():
  params = _params()
  zero = jax.tree.map(jnp.zeros_like, params)
  for name in ('lion', 'lamb', 'lars', 'adafactor', 'rmsprop'):
    config = _config(**{'optimizer.name': name, 'optimizer.weight_decay': WD})
    optimizer, _ = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
    updates, _ = optimizer.update(zero, optimizer.init(params), params)
    assert float(jnp.abs(updates['stage1']['bias']).max()) == 0.0, name
    assert float(jnp.abs(updates['stage1']['kernel']).min()) > 0.0, name
    config = _config(**{'optimizer.name': name, 'optimizer.bias_weight_decay': WD})
    optimizer, _ = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
    updates, _ = optimizer.update(zero, optimizer.init(params), params)
    assert float(jnp.abs(updates['stage1']['bias']).min()) > 0.0, name
    assert float(jnp.abs(updates['stage1']['kernel']).max()) == 0.0, name


# --- schedules ------------------------------------------------------------------------------------


def _schedule(name, **keys):
  """The learning rate at each step of a 10-epoch run of 8 steps an epoch, peak 1."""
  config = _config(**{'schedule.name': name, 'optimizer.learning_rate': 1.0, 'num_train_steps': -1,
                      'num_epochs': 10.0, **keys})
  _, schedule = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
  return lambda step: float(schedule(jnp.asarray(step)))


def test_step_schedule_drops_by_factor_at_each_milestone_after_warmup():
  lr = _schedule('step', **{'schedule.milestones': (3, 7.5), 'schedule.factor': 0.2,
                            'schedule.warmup_epochs': 1.0})
  for step, expected in ((0, 0.0), (4, 0.5), (8, 1.0), (23, 1.0), (24, 0.2), (59, 0.2), (60, 0.04),
                         (79, 0.04)):
    assert lr(step) == pytest.approx(expected, rel=1e-6), step


def test_step_schedule_counts_updates_when_accumulating():
  # 2 batches an update: an epoch is 4 updates; the milestone at epoch 3 is update 12, batch 24.
  config = _config(**{'schedule.name': 'step', 'schedule.milestones': (3,), 'optimizer.learning_rate': 1.0,
                      'optimizer.accumulate_steps': 2, 'num_train_steps': -1, 'num_epochs': 10.0})
  _, lr_at_step = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
  assert [float(lr_at_step(step)) for step in (22, 23, 24, 25)] == pytest.approx([1.0, 1.0, 0.1, 0.1])


def test_exponential_schedule_per_epoch_floored_or_to_the_final_fraction():
  per_epoch = _schedule('exponential', **{'schedule.decay_rate': 0.5, 'schedule.warmup_epochs': 2.0,
                                          'schedule.final_lr_fraction': 0.1})
  for step in (0, 8, 16, 20, 24, 36, 40, 79):
    expected = step / 16 if step < 16 else max(0.5 ** ((step - 16) / 8), 0.1)
    assert per_epoch(step) == pytest.approx(expected, rel=1e-6), step
  to_final = _schedule('exponential', **{'schedule.final_lr_fraction': 0.01})
  for step in (0, 10, 40, 79, 80):
    assert to_final(step) == pytest.approx(0.01 ** (step / 80), rel=1e-5), step


def test_rsqrt_schedule_is_big_visions():
  """peak / sqrt(1 + (step - warmup) / timescale), x min(1, step / warmup) and x min(1, (total - step) /
  cooldown)."""
  lr = _schedule('rsqrt', **{'schedule.timescale': 10, 'schedule.warmup_epochs': 1.0,
                             'schedule.cooldown_epochs': 2.0})
  for step in (0, 3, 8, 9, 30, 63, 64, 70, 79):
    expected = min(1, step / 8) / math.sqrt(1 + max(step - 8, 0) / 10) * min(1, (80 - step) / 16)
    assert lr(step) == pytest.approx(expected, rel=1e-6), step


def test_existing_schedules_keep_their_values():
  cosine = _schedule('cosine', **{'schedule.warmup_epochs': 1.0, 'schedule.final_lr_fraction': 0.1})
  assert [cosine(s) for s in (0, 4, 8, 44, 80)] == pytest.approx([0.0, 0.5, 1.0, 0.55, 0.1], rel=1e-5)
  linear = _schedule('linear', **{'schedule.warmup_epochs': 1.0})
  assert [linear(s) for s in (0, 4, 8, 44, 80)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0], abs=1e-6)


# --- layer-wise learning-rate decay ---------------------------------------------------------------


def _model_params(name, **options):
  model = models.create(name, num_classes=10, **options)
  images = jnp.zeros((1, 32, 32, 3))
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), images, train=False))['params']


def test_layer_decay_of_resnet20_stem_nine_blocks_head():
  multipliers = optim.layer_decay_multipliers('resnet20', _model_params('resnet20'), 0.5)
  expected = {'Conv_0/kernel': 0.5**10, 'BatchNorm_0/scale': 0.5**10,
              'stage1_block1/Conv_0/kernel': 0.5**9, 'stage1_block3/BatchNorm_1/bias': 0.5**7,
              'stage2_block1/Conv_2/kernel': 0.5**6,
              'stage3_block1/Conv_0/kernel': 0.5**3, 'stage3_block3/Conv_1/kernel': 0.5**1,
              'Dense_0/kernel': 1.0, 'Dense_0/bias': 1.0}
  assert {name: multipliers[name] for name in expected} == expected
  assert sorted(set(multipliers.values())) == [0.5**n for n in range(10, -1, -1)]


def test_layer_decay_of_vit_ti_embeddings_twelve_blocks_norm_head():
  multipliers = optim.layer_decay_multipliers('vit_ti', _model_params('vit_ti', pool='tok'), 0.5)
  expected = {'embedding/kernel': 0.5**14, 'cls': 0.5**14, 'pos_embedding': 0.5**14,
              'block1/attention/query/kernel': 0.5**13, 'block6/mlp1/bias': 0.5**8,
              'block12/norm2/scale': 0.5**2, 'encoder_norm/scale': 0.5**1, 'head/kernel': 1.0}
  assert {name: multipliers[name] for name in expected} == expected


def test_layer_decay_of_convnext_t_downsampling_joins_the_first_block_of_its_stage():
  multipliers = optim.layer_decay_multipliers('convnext_t', _model_params('convnext_t'), 0.5)
  expected = {'stem/kernel': 0.5**19, 'stem_norm/scale': 0.5**19,
              'stage1_block1/dwconv/kernel': 0.5**18, 'stage1_block3/layer_scale': 0.5**16,
              'stage2_norm/scale': 0.5**15,
              'stage2_downsample/kernel': 0.5**15, 'stage2_block1/pwconv1/kernel': 0.5**15,
              'stage3_block9/pwconv2/bias': 0.5**4, 'stage4_block1/norm/scale': 0.5**3,
              'stage4_block3/dwconv/kernel': 0.5**1, 'head_norm/scale': 1.0, 'head/kernel': 1.0}
  assert {name: multipliers[name] for name in expected} == expected


@pytest.mark.parametrize('name, head', [
    ('cnn', {'Dense_0'}), ('fastnet', {'head'}), ('fastnet_whiten', {'head'}), ('resnet20', {'Dense_0'}),
    ('resnet50', {'Dense_0'}), ('vit_ti', {'head'}), ('convnext_t', {'head_norm', 'head'})])
def test_every_family_counts_each_of_its_modules(name, head):
  """Each layer model_layers names exists in the model (a renamed module would silently join the head)."""
  modules = {path.partition('/')[0] for path in optim.named_leaves(_model_params(name))}
  layers = optim.model_layers(name)
  listed = {module for layer in layers for module in layer}
  assert modules - listed == head
  for layer in layers:
    assert set(layer) & modules, layer


def test_layer_decay_multiplies_lr_multipliers_in_the_update():
  params = {'Conv_0': {'kernel': jnp.ones((3, 3, 1, 2))}, 'stage2_block1': {'kernel': jnp.ones((2, 2))},
            'Dense_0': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones((2,))}}
  config = _config(**{'model.name': 'resnet20', 'optimizer.name': 'sgd', 'optimizer.momentum': 0.0,
                      'optimizer.learning_rate': 1.0, 'optimizer.layer_decay': 0.5,
                      'optimizer.lr_multipliers': ('^stage2=3', 'bias=0'), 'optimizer.freeze': ()})
  optimizer, _ = optim.create_optimizer(config, lengths.run_length(config, EXAMPLES))
  updates, _ = optimizer.update(params, optimizer.init(params), params)  # gradient 1 everywhere
  factors = {name: float(-leaf.ravel()[0]) for name, leaf in optim.named_leaves(updates).items()}
  assert factors == {'Conv_0/kernel': 0.5**10, 'stage2_block1/kernel': 3 * 0.5**6,
                     'Dense_0/kernel': 1.0, 'Dense_0/bias': 0.0}
  groups = optim.ParamGroups.from_config(config)
  assert groups.label('Dense_0/bias') == optim.FROZEN and groups.label('Dense_0/kernel') == optim.DEFAULT


# --- config checks ----------------------------------------------------------------------------------


@pytest.mark.parametrize('keys, message', [
    ({'optimizer.name': 'lion', 'optimizer.momentum': 0.5},
     "config.optimizer.momentum=0.5 has no effect on optimizer.name='lion'; leave it at 0.9 or pick one "
     'that reads it: sgd, lars, rmsprop'),
    ({'optimizer.name': 'sgd', 'optimizer.decay_rate': 0.5},
     "config.optimizer.decay_rate=0.5 has no effect on optimizer.name='sgd'"),
    ({'optimizer.name': 'sgd', 'optimizer.momentum': 0.0, 'optimizer.nesterov': True},
     'config.optimizer.nesterov=True has no effect with optimizer.momentum=0'),
    ({'optimizer.layer_decay': 1.5}, 'config.optimizer.layer_decay=1.5 must be in [0, 1]'),
    ({'optimizer.b2': 1.0}, 'config.optimizer.b2=1.0 must be in [0, 1) (or -1'),
    ({'schedule.name': 'cosine', 'schedule.decay_rate': 0.9},
     "config.schedule.decay_rate=0.9 has no effect on schedule.name='cosine'"),
    ({'schedule.name': 'step'}, "config.schedule.name='step' needs the epochs where the rate drops"),
    ({'schedule.name': 'step', 'schedule.milestones': (1, 3), 'schedule.warmup_epochs': 2.0},
     'config.schedule.milestones=(1, 3) must be increasing epochs after the warmup (2 epochs)'),
    ({'schedule.name': 'exponential'}, "config.schedule.name='exponential' needs schedule.decay_rate"),
    ({'schedule.name': 'constant', 'schedule.cooldown_epochs': 1.0},
     "config.schedule.cooldown_epochs=1.0 has no effect on schedule.name='constant'"),
])
def test_keys_the_choice_does_not_read_or_cannot_work_are_one_line_errors(keys, message):
  config = defaults.get_config()
  config.update_from_flattened_dict(keys)
  with pytest.raises(ConfigError) as error:
    config_lib.validate(config)
  assert str(error.value).startswith(message)
  assert '\n' not in str(error.value)
