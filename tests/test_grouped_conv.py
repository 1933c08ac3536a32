"""Grouped and depthwise convolutions: XLA's forward, gradients from the CPU-fast form, equal to XLA's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flaxtpu.models.nets import convnext, grouped_conv, mbconv, resnet

_NHWC = ('NHWC', 'HWIO', 'NHWC')


def _conv(function, groups, stride, padding):
  def conv(x, kernel):
    numbers = lax.conv_dimension_numbers(x.shape, kernel.shape, _NHWC)
    return function(x, kernel, (stride, stride), padding, dimension_numbers=numbers,
                    feature_group_count=groups)
  return conv


@pytest.mark.parametrize('shape, groups, out, kernel, stride, padding', [
    ((2, 9, 7, 16), 4, 16, 3, 1, ((1, 1), (1, 1))),  # ResNeXt's 3x3, odd map
    ((2, 9, 7, 16), 4, 32, 3, 2, ((1, 1), (1, 1))),  # grouped, strided, wider output
    ((2, 11, 10, 8), 8, 8, 3, 2, 'SAME'),  # depthwise, TensorFlow's SAME (tf_efficientnet)
    ((2, 11, 10, 8), 8, 8, 5, 1, 'SAME'),
    ((2, 13, 9, 6), 6, 6, 7, 1, ((3, 3), (3, 3))),  # ConvNeXt's 7x7 depthwise
    ((2, 8, 8, 6), 6, 12, 3, 1, ((1, 1), (1, 1))),  # depthwise with a channel multiplier
    ((2, 12, 12, 8), 8, 8, 3, 2, ((0, 1), (0, 1))),  # asymmetric padding
])
def test_gradients_equal_xla_convolutions(shape, groups, out, kernel, stride, padding):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((kernel, kernel, shape[-1] // groups, out)), jnp.float32)
  native = _conv(lax.conv_general_dilated, groups, stride, padding)
  ours = _conv(grouped_conv.conv_general_dilated, groups, stride, padding)
  cotangent = jnp.asarray(rng.standard_normal(native(x, weights).shape), jnp.float32)
  assert 'custom_vjp' in str(jax.make_jaxpr(ours)(x, weights))
  np.testing.assert_array_equal(ours(x, weights), native(x, weights))  # the forward is XLA's convolution
  gradients = lambda conv: jax.grad(lambda x, w: jnp.sum(conv(x, w) * cotangent), argnums=(0, 1))(x, weights)
  for got, want in zip(gradients(ours), gradients(native)):
    assert got.shape == want.shape
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 2e-6


def test_ungrouped_and_dilated_convolutions_are_xla_s_own():
  x, weights = jnp.ones((1, 6, 6, 4)), jnp.ones((3, 3, 4, 4))
  plain = _conv(grouped_conv.conv_general_dilated, 1, 1, 'SAME')
  assert 'custom_vjp' not in str(jax.make_jaxpr(plain)(x, weights))
  dilated = lambda x, w: grouped_conv.conv_general_dilated(
      x, w[:, :, :1], (1, 1), 'SAME', rhs_dilation=(2, 2),
      dimension_numbers=lax.conv_dimension_numbers(x.shape, w[:, :, :1].shape, _NHWC), feature_group_count=4)
  assert 'custom_vjp' not in str(jax.make_jaxpr(dilated)(x, weights))


@pytest.mark.parametrize('name', ['resnext', 'mbconv', 'convnext'])
def test_the_grouped_families_take_their_gradients_from_it(name):
  """ResNeXt/RegNet's grouped 3x3, EfficientNet/MobileNetV3's depthwise and ConvNeXt's 7x7 depthwise."""
  x = jnp.ones((2, 8, 8, 16))
  if name == 'resnext':
    block = resnet.BottleneckBlock(features=4, strides=1, train=True, groups=4, group_width=4)
  elif name == 'mbconv':
    conv, _ = mbconv.layers('torch', True, jnp.float32, None)
    block = conv(16, 3, 1, groups=16, name='dw')
  else:
    block = convnext.ConvNeXtBlock(train=True)
  variables = block.init(jax.random.key(0), x)
  loss = lambda params: jnp.sum(block.apply({**variables, 'params': params}, x, mutable=['batch_stats'])[0])
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(variables['params']))
  assert jaxpr.count('custom_vjp') >= 1
