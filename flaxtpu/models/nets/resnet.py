"""ResNets (He et al. 2016): the CIFAR family (resnet20/32/44/56/110) and the ImageNet family (resnet18-152).

Both take any input size: the CIFAR stem is one 3x3 convolution; the ImageNet
stem (7x7 stride 2 + max pool) also runs on 32x32 inputs, down to a 1x1 map.
Projection shortcuts (1x1 conv + BN) wherever the shape changes. With
`padding='torch'` every convolution and the max pool pad symmetrically, as
PyTorch, torchvision and timm do, so published weights compute the same
function here; `'same'` is XLA's SAME (one pixel less before than after a
stride-2 window on even maps), what flaxtpu used before and what runs saved
without `model.padding` keep. With
`drop_path`, a block's residual branch is dropped per example (stochastic
depth, Huang et al. 2016, as timm's ResNets do), at a rate growing linearly
from 0 in the first block to `drop_path` in the last.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from flaxtpu.models.nets.vit import stochastic_depth


def batch_norm(train: bool, dtype: Any, axis_name: Optional[str]):
  """BatchNorm as in the papers (momentum 0.9); `axis_name` averages statistics over a pmap axis."""
  return functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                           dtype=dtype, axis_name=axis_name)


class Block(nn.Module):
  """What every residual block is configured with; subclasses define the layers."""
  features: int
  strides: int
  train: bool
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  drop_path: float = 0.0  # probability of dropping the residual branch (stochastic depth)
  padding: str = 'torch'  # 'torch' (symmetric) | 'same' (XLA's SAME)

  def layers(self):
    return (conv_layer(self.padding, self.dtype), batch_norm(self.train, self.dtype, self.bn_axis_name))


def conv_layer(padding: str, dtype: Any):
  """Bias-free convolutions padded as `padding` says: 'torch' pads k // 2 on every side, as PyTorch does."""
  if padding == 'same':
    return functools.partial(nn.Conv, use_bias=False, dtype=dtype)

  def conv(features, kernel_size, strides=1, **kwargs):
    return nn.Conv(features, kernel_size, strides, padding=[(k // 2, k // 2) for k in kernel_size],
                   use_bias=False, dtype=dtype, **kwargs)
  return conv


class BasicBlock(Block):
  """Two 3x3 convolutions."""

  @nn.compact
  def __call__(self, x):
    conv, norm = self.layers()
    y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(x)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.features, (3, 3))(y))
    if x.shape != y.shape:
      x = norm()(conv(self.features, (1, 1), self.strides)(x))
    return nn.relu(x + stochastic_depth(y, self.drop_path, self.train))


class BottleneckBlock(Block):
  """1x1 reduce, 3x3, 1x1 expand (x4)."""

  @nn.compact
  def __call__(self, x):
    conv, norm = self.layers()
    y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
    y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(y)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.features * 4, (1, 1))(y))
    if x.shape != y.shape:
      x = norm()(conv(self.features * 4, (1, 1), self.strides)(x))
    return nn.relu(x + stochastic_depth(y, self.drop_path, self.train))


class ResNet(nn.Module):
  stage_sizes: Sequence[int]
  block: Callable[..., nn.Module]  # BasicBlock or BottleneckBlock, possibly wrapped in nn.remat
  num_classes: int
  stem: str  # 'cifar' | 'imagenet'
  width: int = 64
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  drop_path: float = 0.0  # the last block's rate; 0 in the first, linear in between
  padding: str = 'torch'  # 'torch' (symmetric, as PyTorch) | 'same' (XLA's SAME; runs saved before it)

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = batch_norm(train, self.dtype, self.bn_axis_name)
    conv = conv_layer(self.padding, self.dtype)
    total_blocks, block_index = sum(self.stage_sizes), 0
    x = x.astype(self.dtype)
    if self.stem == 'cifar':
      x = nn.relu(norm()(conv(self.width, (3, 3))(x)))
    else:
      x = nn.Conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                  dtype=self.dtype)(x)
      pool_padding = 'SAME' if self.padding == 'same' else ((1, 1), (1, 1))
      x = nn.max_pool(nn.relu(norm()(x)), (3, 3), strides=(2, 2), padding=pool_padding)
    for stage, num_blocks in enumerate(self.stage_sizes):
      for index in range(num_blocks):
        strides = 2 if stage > 0 and index == 0 else 1
        # Explicit names: the same parameter tree with and without remat.
        x = self.block(self.width * 2**stage, strides, train, dtype=self.dtype,
                       bn_axis_name=self.bn_axis_name, padding=self.padding,
                       drop_path=self.drop_path * block_index / max(total_blocks - 1, 1),
                       name=f'stage{stage + 1}_block{index + 1}')(x)
        block_index += 1
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)
