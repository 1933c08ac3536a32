"""A VGG-like network built for time-to-accuracy: airbench's shape (Jordan 2024) as a Flax model.

    stem: 3x3 conv (no bias) -> BatchNorm -> GELU
    per block: 3x3 conv -> 2x2 max pool -> BatchNorm -> GELU -> 3x3 conv -> BatchNorm -> GELU
    head: global max pool -> Dense without bias, logits scaled by 1/9

Three pooling blocks take 32x32 (or 28x28) images to 4x4 (3x3). Few, wide,
plain layers do more per FLOP on any hardware than deep residual stacks at
this size: `fastnet` (widths 64/256/256, airbench94's) is the cifar10_fast
recipe's model, `fastnet_s` (16/32/64) the MNIST recipe's. Differences from
airbench: the stem is a learned 3x3 convolution instead of a frozen 2x2
whitening layer fitted to the data, and BatchNorm keeps its scale.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from flaxtpu.models.resnet import batch_norm


class ConvBlock(nn.Module):
  """conv -> pool -> BN -> GELU -> conv -> BN -> GELU: one remat unit."""
  features: int
  train: bool
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(nn.Conv, self.features, (3, 3), use_bias=False, dtype=self.dtype)
    norm = batch_norm(self.train, self.dtype, self.bn_axis_name)
    x = nn.max_pool(conv()(x), (2, 2), strides=(2, 2))
    x = nn.gelu(norm()(x))
    return nn.gelu(norm()(conv()(x)))


class FastNet(nn.Module):
  num_classes: int
  stem_width: int
  widths: Sequence[int]
  block: Callable[..., nn.Module] = ConvBlock
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  logit_scale: float = 1 / 9  # airbench's: small initial logits train faster with a high learning rate

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = batch_norm(train, self.dtype, self.bn_axis_name)
    x = nn.Conv(self.stem_width, (3, 3), use_bias=False, dtype=self.dtype, name='stem')(x.astype(self.dtype))
    x = nn.gelu(norm(name='stem_bn')(x))
    for index, width in enumerate(self.widths):
      x = self.block(width, train=train, dtype=self.dtype, bn_axis_name=self.bn_axis_name,
                     name=f'block{index + 1}')(x)
    x = jnp.max(x, axis=(1, 2))
    logits = nn.Dense(self.num_classes, use_bias=False, dtype=self.dtype, name='head')(x)
    return (logits * self.logit_scale).astype(jnp.float32)
