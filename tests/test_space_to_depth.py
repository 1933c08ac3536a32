"""The ImageNet ResNets' 7x7 stride-2 stem as a 4x4 convolution over 2x2 blocks of pixels (on a TPU, or
everywhere with model.space_to_depth): the same parameters, outputs and gradients as the plain
convolution, which every other platform computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxtpu import models
from flaxtpu.models.nets import resnet
from flaxtpu.settings.defaults import get_config
from flaxtpu.settings.errors import UserError
from flaxtpu.validation import config as config_lib


@pytest.mark.parametrize('height,width', [(32, 32), (33, 30), (29, 35)])
def test_the_stem_computes_the_same_convolution_from_the_same_kernel(height, width):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.PRNGKey(0), (2, height, width, 3))
  plain = nn.Conv(64, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)
  blocks = resnet.ImageNetStem(64, space_to_depth=True)
  params = plain.init(jax.random.PRNGKey(1), x)
  # Initialised alike (same name, shape and initialiser), so either form starts a run the same way.
  np.testing.assert_array_equal(blocks.init(jax.random.PRNGKey(1), x)['params']['kernel'],
                                params['params']['kernel'])
  want, got = plain.apply(params, x), blocks.apply(params, x)
  assert got.shape == want.shape == (2, -(-height // 2), -(-width // 2), 64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def loss(module, params):
    return jnp.sum(jnp.sin(module.apply(params, x)))
  np.testing.assert_allclose(jax.grad(lambda p: loss(blocks, p))(params)['params']['kernel'],
                             jax.grad(lambda p: loss(plain, p))(params)['params']['kernel'],
                             rtol=1e-4, atol=1e-4)


def test_resnet18_with_either_stem_has_one_parameter_tree_and_one_function():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 64, 3))
  plain = models.create('resnet18', num_classes=10)
  blocks = models.create('resnet18', num_classes=10, space_to_depth=True)
  variables = plain.init(jax.random.PRNGKey(1), x, train=False)
  blocks_variables = blocks.init(jax.random.PRNGKey(1), x, train=False)
  assert jax.tree.structure(variables) == jax.tree.structure(blocks_variables)
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(blocks_variables)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(blocks.apply(variables, x, train=False), plain.apply(variables, x, train=False),
                             rtol=1e-4, atol=1e-4)

  def loss(model, params):
    logits, _ = model.apply({**variables, 'params': params}, x, train=True, mutable=['batch_stats'])
    return jnp.mean(jax.nn.log_softmax(logits)[:, 3])
  grads = jax.grad(lambda p: loss(plain, p))(variables['params'])
  blocks_grads = jax.grad(lambda p: loss(blocks, p))(variables['params'])
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(blocks_grads)):
    np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5)


def test_models_without_the_7x7_stem_refuse_it():
  with pytest.raises(UserError, match='deep stem has none'):
    models.create('resnet50d', num_classes=10, space_to_depth=True)
  config = get_config()
  config.model.name, config.model.space_to_depth = 'resnet20', True
  with pytest.raises(config_lib.ConfigError, match='space_to_depth=True has no effect on model.name'):
    config_lib.validate(config, 'train')


def test_off_a_tpu_the_stem_is_nn_convs_convolution_bit_for_bit():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 33, 30, 3))
  plain = nn.Conv(64, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)
  params = plain.init(jax.random.PRNGKey(1), x)
  np.testing.assert_array_equal(resnet.ImageNetStem(64).apply(params, x), plain.apply(params, x))


def _stem_kernels(model, batch, platform):
  """The stem's convolution kernel shapes ('7x7x3x64' or '4x4x12x64') in the model's lowering."""
  shape = jax.export.symbolic_shape(f'{batch}, 64, 64, 3') if isinstance(batch, str) else (batch, 64, 64, 3)
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64, 64, 3)),
                                                train=False))
  text = jax.jit(lambda v, x: model.apply(v, x, train=False)).trace(variables, x).lower(
      lowering_platforms=(platform,)).as_text()
  return {shape for shape in ('7x7x3x64', '4x4x12x64') if f'tensor<{shape}xf32>' in text}


def test_a_tpu_computes_the_stem_over_blocks_of_pixels_and_other_platforms_plainly():
  model = models.create('resnet18', num_classes=10)
  assert _stem_kernels(model, 2, 'tpu') == {'7x7x3x64', '4x4x12x64'}  # the parameter, then its blocks
  assert _stem_kernels(model, 2, 'cpu') == {'7x7x3x64'}
  assert _stem_kernels(model, 'b', 'tpu') == {'7x7x3x64'}  # an export's symbolic batch: the plain one
  forced = models.create('resnet18', num_classes=10, space_to_depth=True)
  assert _stem_kernels(forced, 2, 'cpu') == {'7x7x3x64', '4x4x12x64'}
