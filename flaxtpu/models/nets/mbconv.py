"""MBConv networks, as timm builds them: EfficientNet B0-B7 (Tan & Le 2019), MobileNetV3 (Howard et al. 2019).

A 3x3 stride-2 stem (conv + BN + activation), stages of blocks
(`flaxtpu.models.mbconv.Block`: depthwise-separable, inverted residual or
conv + BN + activation; squeeze-excitation on the depthwise conv's output,
its width a fraction of the block's), then EfficientNet's head (1x1 conv + BN
+ activation, average pooling) or MobileNetV3's (average pooling, then a 1x1
conv with bias + activation, no BN), dropout and the classifier. A residual
block's branch is dropped per example (stochastic depth) at a rate growing
linearly from 0 in the first block to `drop_path` * (N-1)/N in the last, as
timm and torchvision compute it. `padding='torch'` pads every conv by
(k - 1) // 2 on each side with BatchNorm eps 1e-5 (PyTorch's models);
`'same'` is TensorFlow's SAME padding with eps 1e-3 (timm's tf_* ports of
the TensorFlow weights).
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from flaxtpu.models.nets import grouped_conv
from flaxtpu.models.nets.vit import stochastic_depth

ACTIVATIONS = {'silu': nn.silu, 'relu': nn.relu, 'hard_swish': nn.hard_swish,
               'sigmoid': nn.sigmoid, 'hard_sigmoid': nn.hard_sigmoid}
# Convolutions start as torchvision's kaiming_normal_(mode='fan_out').
_CONV_INIT = nn.initializers.variance_scaling(2.0, 'fan_out', 'normal')


def layers(padding: str, train: bool, dtype: Any, bn_axis_name: Optional[str]):
  """(conv(features, kernel, stride=1, groups=1, name), BatchNorm(name)) as `padding` says."""
  def conv(features, kernel, stride=1, groups=1, *, name):
    pad = 'SAME' if padding == 'same' else [((kernel - 1) // 2,) * 2] * 2
    return nn.Conv(features, (kernel, kernel), stride, padding=pad, feature_group_count=groups,
                   use_bias=False, kernel_init=_CONV_INIT, dtype=dtype, name=name,
                   conv_general_dilated=grouped_conv.conv_general_dilated)
  norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                           epsilon=1e-3 if padding == 'same' else 1e-5, dtype=dtype, axis_name=bn_axis_name)
  return conv, norm


class SqueezeExcite(nn.Module):
  """Average pool, 1x1 reduce + activation, 1x1 expand, gate: a per-channel scale of the input."""
  features: int  # the reduced width
  act: str
  gate: str
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda width, name: nn.Conv(width, (1, 1), kernel_init=_CONV_INIT, dtype=self.dtype, name=name)
    scale = ACTIVATIONS[self.act](conv(self.features, 'reduce')(jnp.mean(x, axis=(1, 2), keepdims=True)))
    return x * ACTIVATIONS[self.gate](conv(x.shape[-1], 'expand')(scale))


class MBConvBlock(nn.Module):
  """One block (`mbconv.Block`): one remat unit."""
  block: Any  # flaxtpu.models.mbconv.Block
  train: bool
  gate: str = 'sigmoid'
  se_act: str = ''  # '' = the block's activation
  padding: str = 'torch'
  drop_path: float = 0.0
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x):
    block, act = self.block, ACTIVATIONS[self.block.act]
    conv, norm = layers(self.padding, self.train, self.dtype, self.bn_axis_name)
    if block.kind == 'cn':
      return act(norm(name='bn')(conv(block.out_chs, block.kernel, block.stride, name='conv')(x)))
    y = x
    if block.kind == 'ir':
      y = act(norm(name='expand_bn')(conv(block.mid_chs, 1, name='expand')(y)))
    y = conv(block.mid_chs, block.kernel, block.stride, groups=block.mid_chs, name='dwconv')(y)
    y = act(norm(name='dwconv_bn')(y))
    if block.se_chs:
      y = SqueezeExcite(block.se_chs, self.se_act or block.act, self.gate, self.dtype, name='se')(y)
    y = norm(name='project_bn')(conv(block.out_chs, 1, name='project')(y))
    return x + stochastic_depth(y, self.drop_path, self.train) if block.skip else y


class MBConvNet(nn.Module):
  num_classes: int
  stages: Sequence[Sequence[Any]]  # mbconv.Block per stage
  stem: int
  features: int
  act: str = 'silu'
  gate: str = 'sigmoid'
  se_act: str = ''
  head_norm: bool = True  # EfficientNet's head (conv + BN + act, pool); False: MobileNetV3's (pool, conv)
  block: Callable[..., nn.Module] = MBConvBlock  # possibly wrapped in nn.remat
  padding: str = 'torch'  # 'torch' (PyTorch's padding, eps 1e-5) | 'same' (TensorFlow's, eps 1e-3)
  dropout: float = 0.0  # before the classifier
  drop_path: float = 0.0
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    act = ACTIVATIONS[self.act]
    conv, norm = layers(self.padding, train, self.dtype, self.bn_axis_name)
    x = act(norm(name='stem_bn')(conv(self.stem, 3, 2, name='stem')(x.astype(self.dtype))))
    total, index = sum(len(blocks) for blocks in self.stages), 0
    for stage, blocks in enumerate(self.stages, 1):
      for number, block in enumerate(blocks, 1):
        # Explicit names: the same parameter tree with and without remat.
        x = self.block(block, train, gate=self.gate, se_act=self.se_act, padding=self.padding,
                       drop_path=self.drop_path * index / total, dtype=self.dtype,
                       bn_axis_name=self.bn_axis_name, name=f'stage{stage}_block{number}')(x)
        index += 1
    if self.head_norm:
      x = jnp.mean(act(norm(name='head_bn')(conv(self.features, 1, name='head_conv')(x))), axis=(1, 2))
    else:
      x = act(nn.Dense(self.features, dtype=self.dtype, name='head_conv')(jnp.mean(x, axis=(1, 2))))
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(self.num_classes, dtype=self.dtype, name='head')(x).astype(jnp.float32)
