"""model.space_to_depth computes the ImageNet ResNets' 7x7 stride-2 stem as a 4x4 convolution over
2x2 blocks of pixels: the same parameters, outputs and gradients as the plain convolution."""

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
  blocks = resnet.SpaceToDepthStem(64)
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
