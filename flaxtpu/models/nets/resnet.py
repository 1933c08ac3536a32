"""ResNets (He et al. 2016): the CIFAR family (resnet20/32/44/56/110) and the ImageNet family (resnet18-152),
with timm's ResNet-D (a deep stem and average-pooled shortcuts), ResNeXt (grouped 3x3 convolutions) and
wide ResNets; the bottleneck block is also RegNet's (nets/regnet.py).

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
import jax
import jax.numpy as jnp

from flaxtpu.models.nets import grouped_conv, platforms
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
  avg_down: bool = False  # ResNet-D: the shortcut average-pools instead of striding its convolution

  def layers(self):
    return (conv_layer(self.padding, self.dtype), batch_norm(self.train, self.dtype, self.bn_axis_name))

  def shortcut(self, x, y):
    """x, projected (1x1 conv + BN) where the block changes its width or stride."""
    if x.shape[-1] == y.shape[-1] and self.strides == 1:
      return x
    conv, norm = self.layers()
    strides = self.strides
    if self.avg_down and strides > 1:
      x, strides = average_pool(x, strides), 1
    return norm()(conv(y.shape[-1], (1, 1), strides)(x))


def conv_layer(padding: str, dtype: Any):
  """Bias-free convolutions padded as `padding` says: 'torch' pads k // 2 on every side, as PyTorch does."""
  if padding == 'same':
    return functools.partial(nn.Conv, use_bias=False, dtype=dtype,
                             conv_general_dilated=grouped_conv.conv_general_dilated)

  def conv(features, kernel_size, strides=1, **kwargs):
    return nn.Conv(features, kernel_size, strides, padding=[(k // 2, k // 2) for k in kernel_size],
                   use_bias=False, dtype=dtype, conv_general_dilated=grouped_conv.conv_general_dilated,
                   **kwargs)
  return conv


def average_pool(x, stride: int):
  """PyTorch's AvgPool2d(stride, stride, ceil_mode=True, count_include_pad=False): a partial window at an odd
  map's edge averages the pixels it holds."""
  padding = [(0, -size % stride) for size in x.shape[1:3]]
  return nn.avg_pool(x, (stride, stride), (stride, stride), padding, count_include_pad=False)


class SqueezeExcite(nn.Module):
  """Channel gates from the pooled map: 1x1 conv to `width`, ReLU, 1x1 conv back, sigmoid (fc1, fc2)."""
  width: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    gate = jnp.mean(x, axis=(1, 2), keepdims=True)
    gate = nn.relu(nn.Conv(self.width, (1, 1), dtype=self.dtype, name='fc1')(gate))
    return x * nn.sigmoid(nn.Conv(x.shape[-1], (1, 1), dtype=self.dtype, name='fc2')(gate))


class BasicBlock(Block):
  """Two 3x3 convolutions."""

  @nn.compact
  def __call__(self, x):
    conv, norm = self.layers()
    y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(x)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.features, (3, 3))(y))
    return nn.relu(self.shortcut(x, y) + stochastic_depth(y, self.drop_path, self.train))


class BottleneckBlock(Block):
  """1x1 reduce, 3x3 (grouped: ResNeXt, RegNet), squeeze-excitation (RegNetY), 1x1 expand."""
  groups: int = 1  # of the 3x3 convolution
  group_width: int = 0  # its channels per group; 0 = `features` (ResNet's one group)
  expansion: int = 4  # output channels per `features` (RegNet: 1)
  se_ratio: float = 0.0  # RegNetY: gates squeezed to round(se_ratio * the block's input channels)

  @nn.compact
  def __call__(self, x):
    conv, norm = self.layers()
    width = self.groups * (self.group_width or self.features)
    y = nn.relu(norm()(conv(width, (1, 1))(x)))
    y = nn.relu(norm()(conv(width, (3, 3), self.strides, feature_group_count=self.groups)(y)))
    if self.se_ratio:
      y = SqueezeExcite(round(self.se_ratio * x.shape[-1]), self.dtype, name='se')(y)
    y = norm(scale_init=nn.initializers.zeros)(conv(self.features * self.expansion, (1, 1))(y))
    return nn.relu(self.shortcut(x, y) + stochastic_depth(y, self.drop_path, self.train))


class ImageNetStem(nn.Module):
  """The ImageNet stem's 7x7 stride-2 convolution (3 pixels of zeros around; nn.Conv's parameter), on a
  TPU computed as a 4x4 stride-1 convolution over the image's 2x2 blocks of pixels (12 channels for
  RGB), as the MLPerf TPU ResNet-50 submissions do: a 3-channel input fills a fraction of a matrix
  unit's lanes, and XLA compiled ResNet-50's train step for a TPU v5e in 45.5 s this way against 69.8 s
  (2,584 against 2,575 img/s; docs/performance.md). `space_to_depth` takes that form on every platform.

  Same function, same parameter (the 7x7 kernel, named and initialised as nn.Conv's), so published
  weights and checkpoints load either way: the 7x7 kernel padded to 8x8 with zeros splits into 4x4
  taps of 2x2 blocks, and output pixel o reads blocks o..o+3 of the padded image. Odd sizes get one
  more row or column of zeros at the end, which no output reads. A symbolic batch (an export's) takes
  the plain convolution, as any platform but a TPU does.
  """
  features: int
  dtype: Any = jnp.float32
  space_to_depth: bool = False

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.lecun_normal(), (7, 7, x.shape[-1], self.features),
                        jnp.float32)
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    if self.space_to_depth:
      return _space_to_depth_conv(x, kernel)
    return platforms.tpu_or_plain(_space_to_depth_conv, _plain_stem_conv, x, kernel)


def _plain_stem_conv(x, kernel):
  """The stem's convolution as nn.Conv computes it."""
  return jax.lax.conv_general_dilated(x, kernel, (2, 2), ((3, 3), (3, 3)),
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _space_to_depth_conv(x, kernel):
  """The same convolution over 2x2 blocks of pixels (see ImageNetStem)."""
  batch, height, width, channels = x.shape
  features = kernel.shape[-1]
  x = jnp.pad(x, ((0, 0), (3, 3 + height % 2), (3, 3 + width % 2), (0, 0)))
  blocks_h, blocks_w = x.shape[1] // 2, x.shape[2] // 2
  x = x.reshape(batch, blocks_h, 2, blocks_w, 2, channels).transpose(0, 1, 3, 2, 4, 5)
  x = x.reshape(batch, blocks_h, blocks_w, 4 * channels)
  # (8, 8, C, F) -> taps (4, 2, 4, 2, C, F) -> (4, 4, [2, 2, C], F): channel order (row, column, c).
  kernel = jnp.pad(kernel, ((0, 1), (0, 1), (0, 0), (0, 0)))
  kernel = kernel.reshape(4, 2, 4, 2, channels, features).transpose(0, 2, 1, 3, 4, 5)
  kernel = kernel.reshape(4, 4, 4 * channels, features)
  return jax.lax.conv_general_dilated(x, kernel, (1, 1), 'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


class ResNet(nn.Module):
  stage_sizes: Sequence[int]
  block: Callable[..., nn.Module]  # BasicBlock or BottleneckBlock, possibly wrapped in nn.remat
  num_classes: int
  stem: str  # 'cifar' (3x3) | 'imagenet' (7x7 + max pool) | 'deep' (ResNet-D: three 3x3 + max pool)
  width: int = 64
  groups: int = 1  # ResNeXt: groups of the bottleneck's 3x3 convolution (timm's cardinality)
  base_width: int = 64  # channels per group of the first stage's 3x3 (wide ResNets: 128; ResNeXt: 4, 8)
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  drop_path: float = 0.0  # the last block's rate; 0 in the first, linear in between
  padding: str = 'torch'  # 'torch' (symmetric, as PyTorch) | 'same' (XLA's SAME; runs saved before it)
  space_to_depth: bool = False  # the 7x7 stem over 2x2 blocks of pixels on every platform, not a TPU's only

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = batch_norm(train, self.dtype, self.bn_axis_name)
    conv = conv_layer(self.padding, self.dtype)
    total_blocks, block_index = sum(self.stage_sizes), 0
    x = x.astype(self.dtype)
    if self.stem == 'cifar':
      x = nn.relu(norm()(conv(self.width, (3, 3))(x)))
    else:
      if self.stem == 'deep':
        x = nn.relu(norm()(conv(self.width // 2, (3, 3), 2)(x)))
        x = nn.relu(norm()(conv(self.width // 2, (3, 3))(x)))
        x = conv(self.width, (3, 3))(x)
      else:
        x = ImageNetStem(self.width, self.dtype, self.space_to_depth, name='Conv_0')(x)
      pool_padding = 'SAME' if self.padding == 'same' else ((1, 1), (1, 1))
      x = nn.max_pool(nn.relu(norm()(x)), (3, 3), strides=(2, 2), padding=pool_padding)
    for stage, num_blocks in enumerate(self.stage_sizes):
      for index in range(num_blocks):
        strides = 2 if stage > 0 and index == 0 else 1
        features = self.width * 2**stage
        # ResNeXt and wide ResNets (bottleneck blocks only): a grouped or wider 3x3 convolution.
        grouping = ({} if (self.groups, self.base_width) == (1, 64) else
                    {'groups': self.groups, 'group_width': features * self.base_width // 64})
        # Explicit names: the same parameter tree with and without remat.
        x = self.block(features, strides, train, dtype=self.dtype, **grouping,
                       bn_axis_name=self.bn_axis_name, padding=self.padding, avg_down=self.stem == 'deep',
                       drop_path=self.drop_path * block_index / max(total_blocks - 1, 1),
                       name=f'stage{stage + 1}_block{index + 1}')(x)
        block_index += 1
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)
