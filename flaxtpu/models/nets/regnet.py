"""RegNetX and RegNetY (Radosavovic et al. 2020), as pycls, timm and torchvision compute them.

A 3x3 stride-2 stem (32 channels, BN, ReLU), four stages of ResNet bottleneck
blocks without expansion (nets/resnet.py's `BottleneckBlock`: 1x1, grouped 3x3
of a fixed group width, in RegNetY a squeeze-excitation to a quarter of the
block's input channels, 1x1; a projection shortcut where the width or stride
changes), global average pooling and the classifier. Each stage's first block
strides by 2. Stochastic depth as in the ResNets.
"""

from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from flaxtpu.models.nets.resnet import batch_norm, conv_layer


class RegNet(nn.Module):
  stage_sizes: Sequence[int]  # blocks per stage
  widths: Sequence[int]  # output channels per stage
  group_widths: Sequence[int]  # channels per group of the 3x3 convolutions, per stage
  block: Callable[..., nn.Module]  # BottleneckBlock, possibly wrapped in nn.remat
  num_classes: int
  se_ratio: float = 0.0  # RegNetY: 0.25
  stem_width: int = 32
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  drop_path: float = 0.0  # the last block's rate; 0 in the first, linear in between

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = batch_norm(train, self.dtype, self.bn_axis_name)
    conv = conv_layer('torch', self.dtype)
    x = nn.relu(norm(name='stem_bn')(conv(self.stem_width, (3, 3), 2, name='stem')(x.astype(self.dtype))))
    total_blocks, block_index = sum(self.stage_sizes), 0
    for stage, (size, width, group_width) in enumerate(zip(self.stage_sizes, self.widths, self.group_widths)):
      for index in range(size):
        # Explicit names: the same parameter tree with and without remat.
        x = self.block(width, 2 if index == 0 else 1, train, groups=width // group_width,
                       group_width=group_width, expansion=1, se_ratio=self.se_ratio, dtype=self.dtype,
                       bn_axis_name=self.bn_axis_name,
                       drop_path=self.drop_path * block_index / max(total_blocks - 1, 1),
                       name=f'stage{stage + 1}_block{index + 1}')(x)
        block_index += 1
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name='head')(x).astype(jnp.float32)
