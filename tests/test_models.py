import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxtpu import models
from flaxtpu.models.nets import convnext, fastnet, vit
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import UserError
from flaxtpu.step import steps
from flaxtpu.validation import config as config_lib

# Parameter counts at 10 classes (CIFAR family with projection shortcuts).
EXPECTED_PARAMS = {
    'cnn': 20_042,  # == the Keras model's model.count_params()
    'fastnet_s': 75_280,  # stem 432 + 32, blocks 4,672 + 13,952 + 55,552, head 640 (by hand)
    'fastnet': 1_973_176,  # airbench94's widths: stem 696, blocks 50,944 + 738,304 + 1,180,672, head 2,560
    # fastnet_whiten: whitening stem 288 + 24, blocks (no BN scale) 50,816 + 737,792 + 1,180,160, head 2,560
    'fastnet_whiten': 1_971_640,
    'resnet20': 272_474,
    'resnet32': 466_906,
    'resnet56': 855_770,
    'resnet18': 11_181_642,
    'resnet50': 23_528_522,
}


def _init(model, shape):
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(shape), train=False))


@pytest.mark.parametrize('name, count', EXPECTED_PARAMS.items())
def test_parameter_counts(name, count):
  variables = _init(models.create(name, num_classes=10), (1, 32, 32, 3))
  assert sum(x.size for x in jax.tree.leaves(variables['params'])) == count


def test_cnn_layers_match_keras():
  params = _init(models.create('cnn', num_classes=10), (1, 32, 32, 3))['params']
  shapes = {path: leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  assert sorted(shapes.values()) == sorted([(3, 3, 3, 32), (32,), (3, 3, 32, 64), (64,), (64, 10), (10,)])


ONE_SHAPE = ('resnet101', 'resnet152', 'resnet110', 'vit_b')
# The variants' networks are those of the smallest of their kind with other numbers: those run.
VARIANTS = [name for name in models.NAMES
            if name.startswith(('resnext', 'wide_resnet', 'regnet')) or re.fullmatch(r'resnet\d+d', name)]
SMALLEST = ('resnet18d', 'resnet50d', 'resnext50_32x4d', 'wide_resnet50_2', 'regnetx_002', 'regnety_002')


@pytest.mark.parametrize('name', models.NAMES)
@pytest.mark.parametrize('shape, classes', [((2, 32, 32, 3), 10), ((2, 28, 28, 1), 7)])
def test_output_shapes(name, shape, classes):
  if (name in ONE_SHAPE or name.startswith(('vit_l', 'deit_', 'dinov2_', 'clip_'))) and shape[1] == 28:
    pytest.skip('deep variants: one input shape is enough')
  if name.startswith('convnext') and shape[1] == 28:
    pytest.skip('ConvNeXt floors 28 px at patch 4 to nothing (test_family_convswin names that size)')
  if name.startswith('efficientnet_b') and name != 'efficientnet_b0':
    pytest.skip('B0 builds every block kind; the blocks of B1-B7: test_family_efficientnet')
  if name in VARIANTS and name not in SMALLEST:
    pytest.skip('the network of a smaller variant of its kind')
  # Patches of 4 pixels tile both 32x32 and 28x28 (ViT and ConvNeXt; the others take no patches).
  patch_size = 4 if 'patch_size' in models.get_spec(name).options else 0
  pool = {'pool': 'tok'} if name.endswith('_distilled') else {}  # their class and distillation tokens
  model = models.create(name, num_classes=classes, patch_size=patch_size, image_shape=shape[1:], **pool)
  variables = _init(model, shape)
  logits = jax.eval_shape(lambda v: model.apply(v, jnp.zeros(shape), train=False), variables)
  assert logits.shape == (shape[0], classes)
  assert logits.dtype == jnp.float32
  batch_norm = name.startswith(('resnet', 'fastnet', 'resnext', 'wide_resnet', 'regnet', 'efficientnet',
                                    'mobilenetv3'))
  assert ('batch_stats' in variables) == batch_norm


def test_fastnet_pools_to_a_few_pixels_and_scales_its_logits():
  model = models.create('fastnet_s', num_classes=10)
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 28, 28, 3)), train=False)
  shapes = {'/'.join(k.key for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(variables['params'])}
  assert shapes['block3/Conv_1/kernel'] == (3, 3, 64, 64) and shapes['head/kernel'] == (64, 10)
  _, intermediates = model.apply(variables, jnp.ones((2, 28, 28, 3)), train=False,
                                 capture_intermediates=lambda module, _: module.name == 'block3')
  assert intermediates['intermediates']['block3']['__call__'][0].shape == (2, 3, 3, 64)  # 28 -> 14 -> 7 -> 3
  unscaled = fastnet.FastNet(num_classes=10, stem_width=16, widths=(16, 32, 64), logit_scale=1.0)
  images = jax.random.uniform(jax.random.PRNGKey(1), (2, 28, 28, 3))
  np.testing.assert_allclose(model.apply(variables, images, train=False) * 9,
                             unscaled.apply(variables, images, train=False), rtol=1e-5, atol=1e-6)


def test_unknown_model_lists_valid_names():
  with pytest.raises(UserError, match="unknown model 'vgg16'; choose one of: cnn, fastnet_s, fastnet, "
                                      "fastnet_whiten, resnet20"):
    models.create('vgg16', num_classes=10)


def test_bfloat16_model_keeps_float32_params_and_logits():
  model = models.create('resnet20', num_classes=10, dtype='bfloat16')
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 32, 32, 3)), train=False)
  assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype('float32')}
  logits, updates = model.apply(variables, jnp.ones((2, 32, 32, 3)), train=True, mutable=['batch_stats'])
  assert logits.dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(updates)} == {jnp.dtype('float32')}


# --- ViT and ConvNeXt -------------------------------------------------------------

# Published sizes at 224x224 and 1000 classes (ViT: the paper's class token; DeiT's table for
# Ti/S), in millions, and the exact counts of timm's vit_*_patch16_224 and convnext_tiny.
PUBLISHED_PARAMS = {
    'vit_ti': (5.7, 5_717_416),
    'vit_s': (22.1, 22_050_664),
    'vit_b': (86.6, 86_567_656),
    'convnext_t': (28.6, 28_589_128),
}


def _count(variables) -> int:
  return sum(x.size for x in jax.tree.leaves(variables['params']))


@pytest.mark.parametrize('name, published', PUBLISHED_PARAMS.items())
def test_published_parameter_counts(name, published):
  millions, timm_count = published
  pool = 'tok' if name.startswith('vit') else 'gap'
  count = _count(_init(models.create(name, num_classes=1000, pool=pool), (1, 224, 224, 3)))
  assert round(count / 1e6, 1) == millions
  assert count == timm_count
  if name.startswith('vit'):
    # Pooling by the mean has no class token and one position embedding fewer.
    width = models.get_spec(name).widths[0]
    assert _count(_init(models.create(name, num_classes=1000), (1, 224, 224, 3))) == count - 2 * width


def _tiny_vit(**kwargs):
  return vit.ViT(num_classes=10, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, **kwargs)


def _tiny_convnext(**kwargs):
  return convnext.ConvNeXt(num_classes=10, stage_sizes=(1, 2), stage_widths=(8, 16), patch_size=2,
                           **kwargs)


IMAGES = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, 16, 3)), jnp.float32)
LABELS = jnp.arange(8) % 10


def _random_params(model):
  """Random parameters of the model's shapes, drawn by numpy (no compiled init); unlike the
  initial ones, no zero ViT head or 1e-6 ConvNeXt layer scale that would hide the body."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), IMAGES, train=False))['params']
  rng = np.random.default_rng(0)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.asarray((path[-1].key == 'scale') + 0.2 * rng.normal(size=x.shape), jnp.float32),
      shapes)


TINY = {
    'vit': lambda block=vit.EncoderBlock: _tiny_vit(dropout=0.1, drop_path=0.3, block=block),
    'vit_tok': lambda block=vit.EncoderBlock: _tiny_vit(pool='tok', drop_path=0.3, block=block),
    'convnext': lambda block=convnext.ConvNeXtBlock: _tiny_convnext(drop_path=0.5, block=block),
}


@pytest.mark.parametrize('family', TINY)
def test_dropout_and_drop_path_act_in_train_only(family):
  model = TINY[family]()
  params = _random_params(model)
  apply = jax.jit(lambda seed, train: model.apply({'params': params}, IMAGES, train=train,
                                                  rngs={'dropout': jax.random.PRNGKey(seed)}),
                  static_argnums=1)
  np.testing.assert_array_equal(apply(0, False), apply(1, False))
  np.testing.assert_array_equal(apply(2, True), apply(2, True))
  assert not np.allclose(apply(2, True), apply(3, True))
  assert not np.allclose(apply(2, True), apply(2, False))


def test_drop_path_grows_linearly_over_the_blocks():
  model = vit.ViT(num_classes=10, patch_size=4, width=8, depth=5, num_heads=2, mlp_dim=16, drop_path=0.2)
  rates = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, vit.EncoderBlock) and context.method_name == '__call__':
      rates[context.module.name] = context.module.drop_path
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), IMAGES, train=False))
  assert rates == pytest.approx({f'block{i + 1}': 0.05 * i for i in range(5)})


def test_resnet_stochastic_depth_drops_branches_in_train_only_at_linear_rates():
  model = models.create('resnet20', num_classes=10, drop_path=0.4)
  params = _random_params(model)
  stats = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), IMAGES, train=False))['batch_stats']
  stats = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, jnp.float32), stats)
  variables = {'params': params, 'batch_stats': stats}
  apply = jax.jit(lambda seed, train: model.apply(variables, IMAGES, train=train, mutable=['batch_stats'],
                                                  rngs={'dropout': jax.random.PRNGKey(seed)})[0],
                  static_argnums=1)
  np.testing.assert_array_equal(apply(0, False), apply(1, False))
  np.testing.assert_array_equal(apply(2, True), apply(2, True))
  assert not np.allclose(apply(2, True), apply(3, True))
  rates = {}

  def record(next_fun, args, kwargs, context):
    if context.module.name and context.module.name.startswith('stage') and context.method_name == '__call__':
      rates[context.module.name] = context.module.drop_path
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), IMAGES, train=False))
  names = [f'stage{s}_block{b}' for s in (1, 2, 3) for b in (1, 2, 3)]
  assert rates == pytest.approx({name: 0.05 * i for i, name in enumerate(names)})
  # Without it the parameter tree is the same: checkpoints load either way.
  plain = models.create('resnet20', num_classes=10)
  assert jax.tree.structure(params) == jax.tree.structure(_random_params(plain))


@pytest.mark.parametrize('family, remat', [('vit', 'full'), ('convnext', 'dots_saveable')])
def test_remat_gives_the_same_gradients(family, remat):
  block = {'vit': vit.EncoderBlock, 'convnext': convnext.ConvNeXtBlock}[family]
  plain, rematted = TINY[family](), TINY[family](nn.remat(block, policy=models.remat_policy(remat)))
  params = _random_params(plain)
  # Explicit block names: checkpoints load into either.
  assert jax.tree.structure(params) == jax.tree.structure(
      jax.eval_shape(lambda: rematted.init(jax.random.PRNGKey(0), IMAGES, train=False))['params'])

  def grad(model):
    def loss(params):
      logits = model.apply({'params': params}, IMAGES, train=True, rngs={'dropout': jax.random.PRNGKey(5)})
      return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()
    return jax.jit(jax.grad(loss))(params)

  for x, y in zip(jax.tree.leaves(grad(plain)), jax.tree.leaves(grad(rematted))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', ['vit_ti', 'convnext_t'])
def test_bfloat16_vit_and_convnext_keep_float32_params_and_logits(name):
  model = models.create(name, num_classes=10, dtype='bfloat16', patch_size=4)
  variables = _init(model, (2, 32, 32, 3))
  assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype('float32')}
  logits = jax.eval_shape(lambda v: model.apply(v, jnp.zeros((2, 32, 32, 3)), train=False), variables)
  assert logits.dtype == jnp.float32


@pytest.mark.parametrize('name, patch_size, shape, shown', [
    ('vit_s', 5, (32, 32, 3), 'config.model.patch_size=5 does not divide the 32x32 images; '
                              'choose one of 1, 2, 4, 8, 16, 32'),
    ('vit_ti', 0, (28, 28, 1), 'config.model.patch_size=0 (= 16, the published size for vit_ti) '
                               'does not divide the 28x28 images'),
    ('convnext_t', 3, (32, 32, 3), 'config.model.patch_size=3 does not divide the 32x32 images'),
])
def test_patches_that_do_not_tile_the_image_name_the_key(name, patch_size, shape, shown):
  with pytest.raises(UserError) as error:
    models.create(name, num_classes=10, patch_size=patch_size, image_shape=shape)
  assert str(error.value).startswith(shown) and '\n' not in str(error.value)
  config = defaults.get_config()
  config.model.name, config.model.patch_size = name, patch_size
  with pytest.raises(UserError, match='config.model.patch_size'):  # as the trainer builds it
    steps.create_task(config, num_classes=10, image_shape=shape, mean=None, std=None)


@pytest.mark.parametrize('overrides, message', [
    (dict(name='vit_b', patch_size=4, pool='tok', dropout=0.1, drop_path=0.1), None),
    (dict(name='convnext_t', patch_size=2, drop_path=0.1), None),
    (dict(name='resnet50', drop_path=0.1), None),
    (dict(name='vit_ti', pool='cls'),
     "config.model.pool='cls' is not valid; choose one of: 'gap', 'tok', 'map', 'avg'"),
    (dict(name='vit_ti', patch_size=-1), 'config.model.patch_size=-1 must be >= 0'),
    (dict(name='vit_ti', dropout=1.0), r'config.model.dropout=1.0 must be in \[0, 1\)'),
    (dict(name='convnext_t', drop_path=-0.1), r'config.model.drop_path=-0.1 must be in \[0, 1\)'),
    (dict(name='fastnet', drop_path=0.1),
     "config.model.drop_path=0.1 has no effect on model.name='fastnet'; leave it at 0.0 or pick a "
     'model that takes it: resnet20, resnet32, '),
    (dict(name='cnn', patch_size=4), "config.model.patch_size=4 has no effect on model.name='cnn'"),
    (dict(name='convnext_t', pool='tok'), "config.model.pool='tok' has no effect on model.name='convnext_t'"),
    (dict(name='convnext_t', dropout=0.1), "config.model.dropout=0.1 has no effect"),
])
def test_config_validates_model_keys(overrides, message):
  config = defaults.get_config()
  config.model.update(overrides)
  if message is None:
    config_lib.validate(config)
  else:
    with pytest.raises(config_lib.ConfigError, match=message):
      config_lib.validate(config)


def test_train_step_dropout_is_a_function_of_seed_and_step():
  """Dropout keys come from the state's (seed-derived) key and its step: a resumed run replays them."""
  task = steps.Task(model=TINY['vit'](), num_classes=10, image_shape=(16, 16, 3),
                    augment=defaults.get_config().augment, label_smoothing=0.0, mean=None, std=None,
                    optimizer=optax.sgd(0.1))
  params = _random_params(task.model)
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params, batch_stats={}, ema={},
                           opt_state=task.optimizer.init(params), rng=jax.random.PRNGKey(0))
  batch = (jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3)), jnp.uint8), LABELS)
  loss = jax.jit(lambda state: steps.train_step(state, batch, task=task)[1].loss.total)
  restored = state.replace(rng=jnp.array(np.asarray(state.rng)))  # the same key, as a checkpoint holds it
  assert loss(state) == loss(restored)
  assert loss(state) != loss(state.replace(step=state.step + 1))
  assert loss(state) != loss(state.replace(rng=jax.random.PRNGKey(1)))


def test_exact_gelu_is_the_erf_gelu_within_float32_rounding_and_rounds_once_in_bfloat16():
  """vit.exact_gelu (ViT's gelu='exact', ConvNeXt's and Swin's GELU) against 0.5 x (1 + erf(x / sqrt 2)) in
  float64, and against nn.gelu(approximate=False), which it replaced: values and gradients."""
  import math  # pylint: disable=g-import-not-at-top
  x = np.linspace(-9.0, 9.0, 36001).astype(np.float32)
  exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
  got = np.asarray(vit.exact_gelu(jnp.asarray(x)), np.float64)
  assert np.abs(got - exact).max() < 2e-6
  assert np.abs(got - np.asarray(nn.gelu(jnp.asarray(x), approximate=False))).max() < 2e-6
  slope = np.asarray(jax.vmap(jax.grad(vit.exact_gelu))(jnp.asarray(x)), np.float64)
  exact_slope = np.array([0.5 * (1 + math.erf(v / math.sqrt(2)))
                          + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi) for v in x.astype(np.float64)])
  assert np.abs(slope - exact_slope).max() < 2e-6  # GELU's own derivative, not the rational function's
  # bfloat16 in, bfloat16 out: computed in float32 and rounded once (nn.gelu's bfloat16 erfc was 1 step off).
  half = jnp.asarray(x, jnp.bfloat16)
  out = vit.exact_gelu(half)
  assert out.dtype == jnp.bfloat16
  rounded = vit.exact_gelu(half.astype(jnp.float32)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(rounded, np.float32))
