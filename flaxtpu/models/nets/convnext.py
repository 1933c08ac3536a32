"""ConvNeXt (Liu et al. 2022): convnext_t/s/b/l, as in the official code and timm.

A patchify stem (`patch_size` x `patch_size` convolution with that stride, 4
in the paper, + LayerNorm), four stages of blocks (7x7 depthwise convolution,
LayerNorm, 4x MLP with GELU, layer scale, stochastic depth) joined by
LayerNorm + 2x2 stride-2 convolutions, then global average pooling,
LayerNorm and the head. An odd map's downsampling floors as timm's unpadded
convolution does (`downsample='floor'`: 11x11 -> 5x5), or rounds up under XLA's
SAME padding (`'ceil'`: 11x11 -> 6x6), as flaxtpu did before `model.downsample`
(runs saved then keep it); maps that halve evenly are the same either way.
A smaller stem stride suits small images: on 32x32,
`patch_size=2` gives 16/8/4/2-pixel stages (the paper's 4 gives 8/4/2/1).
"""

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from flaxtpu.models.nets import grouped_conv
from flaxtpu.models.nets.vit import exact_gelu, stochastic_depth
from flaxtpu.settings.errors import UserError

# Convolutions and dense layers start as timm's trunc_normal_(std=.02), biases at zero.
_KERNEL_INIT = nn.initializers.truncated_normal(stddev=0.02)


class ConvNeXtBlock(nn.Module):
  """7x7 depthwise conv, LayerNorm, 1x1 expand x4, GELU, 1x1 project, layer scale: one remat unit."""
  train: bool
  drop_path: float = 0.0
  layer_scale: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    features = x.shape[-1]
    dense = lambda width, name: nn.Dense(width, dtype=self.dtype, kernel_init=_KERNEL_INIT, name=name)
    y = nn.Conv(features, (7, 7), padding=3, feature_group_count=features, dtype=self.dtype,
                kernel_init=_KERNEL_INIT, name='dwconv',
                conv_general_dilated=grouped_conv.conv_general_dilated)(x)
    y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name='norm')(y)
    y = dense(features, 'pwconv2')(exact_gelu(dense(4 * features, 'pwconv1')(y)))
    scale = self.param('layer_scale', nn.initializers.constant(self.layer_scale), (features,))
    return x + stochastic_depth(y * scale.astype(self.dtype), self.drop_path, self.train)


class ConvNeXt(nn.Module):
  num_classes: int
  stage_sizes: Sequence[int]
  stage_widths: Sequence[int]
  block: Callable[..., nn.Module] = ConvNeXtBlock  # possibly wrapped in nn.remat
  patch_size: int = 4  # the stem's kernel and stride
  downsample: str = 'floor'  # 'floor' (timm) | 'ceil' (XLA SAME: runs saved before model.downsample)
  drop_path: float = 0.0  # the last block's rate; 0 in the first, linear in between
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = lambda name: nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name=name)
    conv = lambda width, size, name, padding: nn.Conv(
        width, (size, size), strides=(size, size), padding=padding, dtype=self.dtype,
        kernel_init=_KERNEL_INIT, name=name)
    x = norm('stem_norm')(conv(self.stage_widths[0], self.patch_size, 'stem', 'VALID')(x.astype(self.dtype)))
    num_blocks, index = sum(self.stage_sizes), 0
    for stage, (size, width) in enumerate(zip(self.stage_sizes, self.stage_widths)):
      if stage > 0:
        if self.downsample == 'floor' and min(x.shape[1:3]) < 2:
          need = self.patch_size * 2 ** (len(self.stage_sizes) - 1)
          raise UserError(f'ConvNeXt with patch_size={self.patch_size} floors a {x.shape[1]}x{x.shape[2]} '
                          f'map to nothing at stage {stage + 1}: it needs images of at least {need}x{need}; '
                          'set --config.dataset.image_size (or a smaller --config.model.patch_size)')
        padding = 'VALID' if self.downsample == 'floor' else 'SAME'
        x = conv(width, 2, f'stage{stage + 1}_downsample', padding)(norm(f'stage{stage + 1}_norm')(x))
      for block in range(size):
        # Explicit names: the same parameter tree with and without remat.
        x = self.block(train, drop_path=self.drop_path * index / max(num_blocks - 1, 1), dtype=self.dtype,
                       name=f'stage{stage + 1}_block{block + 1}')(x)
        index += 1
    x = norm('head_norm')(jnp.mean(x, axis=(1, 2)))
    return nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=_KERNEL_INIT,
                    name='head')(x).astype(jnp.float32)
