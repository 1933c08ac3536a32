"""Swin Transformer (Liu et al. 2021): swin_t/s/b, computing what timm's `swin_transformer.py` computes
at any image size.

A patch embedding (`patch_size` x `patch_size` convolution with that stride +
LayerNorm), four stages of blocks, each stage after the first opening with a
patch merging (2x2 neighbours concatenated, LayerNorm, a linear map to twice
the width; an odd map is padded with zeros first, so it rounds up), then
LayerNorm, global average pooling and the head. A block is pre-LayerNorm
window attention and a GELU MLP, each a residual branch with stochastic depth.

Attention runs inside `window` x `window` windows (7), every second block's
windows shifted by half a window (a cyclic roll, with timm's -100 mask between
tokens that the roll brought together). As timm does at other sizes, a map
not larger than the window along an axis is one unshifted window along it,
and a map that the window does not tile is padded with zeros at its end
(after the roll) into whole windows. Each attention adds a learned bias per
head and relative position (a table of (2 * window - 1)^2 rows, indexed as
timm indexes it). The table keeps its 7x7-window shape at every image size;
where a small map shrinks a window, the network resizes the table to it as
timm's `resize_rel_pos_bias_table` does when it loads weights into a model
built at that size, so one set of parameters (and a 224 px file) serves
every size.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from flaxtpu.models.nets import window_attention
from flaxtpu.models.nets.vit import exact_gelu, stochastic_depth

# Linear layers and the bias table start as timm's trunc_normal_(std=.02), biases at zero.
_KERNEL_INIT = nn.initializers.truncated_normal(stddev=0.02)
_MASKED = -100.0  # what timm adds to the logits between tokens of different regions of a shifted window
_EPSILON = 1e-5  # torch's LayerNorm


def window_and_shift(size: int, window: int, shifted: bool) -> tuple[int, int]:
  """(window, shift) along an axis of `size` tokens: a map no larger than the window is one window."""
  if size <= window:
    return size, 0
  return window, window // 2 if shifted else 0


def relative_position_index(window: tuple[int, int]) -> np.ndarray:
  """[area, area]: the table row of each (query, key) pair of a window's tokens, as timm numbers it."""
  height, width = window
  coords = np.stack(np.meshgrid(np.arange(height), np.arange(width), indexing='ij')).reshape(2, -1)
  relative = coords[:, :, None] - coords[:, None, :]
  return (relative[0] + height - 1) * (2 * width - 1) + relative[1] + width - 1


def _resize_axis(source: int, target: int) -> np.ndarray:
  """[target, source]: timm's resize of a table axis from `source` to `target` relative positions
  (resize_rel_pos_bias_table: source positions spread by a geometric progression, read at the integer
  target positions by linear interpolation, RegularGridInterpolator's)."""
  left, right = 1.01, 1.5
  while right - left > 1e-6:
    ratio = (left + right) / 2.0
    if (1.0 - ratio ** (source // 2)) / (1.0 - ratio) > target // 2:
      right = ratio
    else:
      left = ratio
  spread, position = [], 1.0
  for index in range(source // 2):
    spread.append(position)
    position += ratio ** (index + 1)
  points = np.array([-value for value in reversed(spread)] + [0.0] + spread)
  half = target // 2
  weights = np.zeros((target, source))
  for row, x in enumerate(np.arange(-half, half + 0.1, 1.0)):
    upper = min(int(np.searchsorted(points, x, side='left')), source - 1)
    lower = min(max(upper - 1, 0), source - 1)
    below, above = max(x - points[lower], 0.0), max(points[upper] - x, 0.0)
    if below == 0 and above == 0:
      below = above = 1.0
    weights[row, lower] += above / (below + above)
    weights[row, upper] += below / (below + above)
  return weights


@functools.lru_cache(maxsize=None)
def table_resize(table_window: int, window: tuple[int, int]) -> Optional[np.ndarray]:
  """[rows for `window`, rows for `table_window`] that timm's resize applies to a square window's table
  (None: the same window). It resizes every window but the square one it was made for."""
  if window == (table_window, table_window):
    return None
  source = 2 * table_window - 1
  return np.kron(_resize_axis(source, 2 * window[0] - 1), _resize_axis(source, 2 * window[1] - 1))


@functools.lru_cache(maxsize=None)
def shift_mask(height: int, width: int, window: tuple[int, int],
               shift: tuple[int, int]) -> Optional[np.ndarray]:
  """[windows, area, area] of 0 / -100 for a shifted, padded `height` x `width` map: timm's attn_mask,
  sliced as timm slices it (a shift of 0 along an axis included)."""
  if not any(shift):
    return None
  regions = np.zeros((height, width))
  slices = lambda size, step: ((0, -size), (-size, -step), (-step, None))
  label = 0
  for rows in slices(window[0], shift[0]):
    for cols in slices(window[1], shift[1]):
      regions[slice(*rows), slice(*cols)] = label
      label += 1
  windows = (regions.reshape(height // window[0], window[0], width // window[1], window[1])
             .transpose(0, 2, 1, 3).reshape(-1, window[0] * window[1]))
  return np.where(windows[:, None, :] != windows[:, :, None], _MASKED, 0.0).astype(np.float32)


class _DenseParameters(nn.Module):
  """nn.Dense's parameters (its kernel and bias, as timm's layers map to them), for a layer that a
  fused kernel computes."""
  features: int

  @nn.compact
  def __call__(self, in_features: int):
    return (self.param('kernel', _KERNEL_INIT, (in_features, self.features)),
            self.param('bias', nn.initializers.zeros, (self.features,)))


class WindowAttention(nn.Module):
  """Multi-head self-attention within each window, plus the relative position bias (timm's layout:
  one fused qkv projection, the table [(2 * table_window - 1)^2, heads], the output projection). On a
  TPU the projections and the attention run as one fused kernel (`window_attention`)."""
  num_heads: int
  window: tuple[int, int]  # the windows it attends in
  table_window: int = 7  # the window its table was made for
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask: Optional[np.ndarray]):
    _, tokens, features = x.shape
    table = self.param('relative_position_bias_table', _KERNEL_INIT,
                       ((2 * self.table_window - 1) ** 2, self.num_heads))
    resize = table_resize(self.table_window, self.window)
    if resize is not None:
      table = jnp.asarray(resize, table.dtype) @ table
    bias = table[relative_position_index(self.window).reshape(-1)].reshape(tokens, tokens, self.num_heads)
    # [groups, heads, tokens, tokens] in float32: window w of the [images, windows] order takes group
    # w % groups (each window of an image its own mask, where the windows are shifted).
    bias = bias.transpose(2, 0, 1).astype(jnp.float32)[None]
    if mask is not None:
      bias = bias + jnp.asarray(mask)[:, None]
    cast = lambda parameters: [value.astype(self.dtype) for value in parameters]
    qkv = cast(_DenseParameters(3 * features, name='qkv')(features))
    proj = cast(_DenseParameters(features, name='proj')(features))
    return window_attention.block(x.astype(self.dtype), *qkv, *proj, bias, self.num_heads)


class SwinBlock(nn.Module):
  """(Shifted) window attention and a GELU MLP, each a pre-LayerNorm residual branch: one remat unit."""
  num_heads: int
  train: bool
  window: int = 7
  shifted: bool = False  # every second block of a stage
  drop_path: float = 0.0
  dtype: Any = jnp.float32
  remat_mlp: bool = False  # recompute the MLP branch in the backward pass, keeping only its input

  @nn.compact
  def __call__(self, x):
    batch, height, width, features = x.shape
    (window_h, shift_h), (window_w, shift_w) = (window_and_shift(height, self.window, self.shifted),
                                                window_and_shift(width, self.window, self.shifted))
    norm = lambda name, parent: nn.LayerNorm(epsilon=_EPSILON, dtype=self.dtype, name=name, parent=parent)
    y = jnp.roll(norm('norm1', self)(x), (-shift_h, -shift_w), axis=(1, 2))
    y = jnp.pad(y, ((0, 0), (0, -height % window_h), (0, -width % window_w), (0, 0)))
    rows, cols = y.shape[1] // window_h, y.shape[2] // window_w
    windows = (y.reshape(batch, rows, window_h, cols, window_w, features).transpose(0, 1, 3, 2, 4, 5)
               .reshape(batch * rows * cols, window_h * window_w, features))
    mask = shift_mask(y.shape[1], y.shape[2], (window_h, window_w), (shift_h, shift_w))
    y = WindowAttention(self.num_heads, (window_h, window_w), self.window, dtype=self.dtype,
                        name='attention')(windows, mask)
    y = (y.reshape(batch, rows, cols, window_h, window_w, features).transpose(0, 1, 3, 2, 4, 5)
         .reshape(batch, rows * window_h, cols * window_w, features)[:, :height, :width])
    y = jnp.roll(y, (shift_h, shift_w), axis=(1, 2))
    x = x + stochastic_depth(y, self.drop_path, self.train)

    def mlp(block, x):  # the block's own norm2, mlp1 and mlp2, in flax's lifted remat or not
      dense = lambda width_, name: nn.Dense(width_, dtype=self.dtype, kernel_init=_KERNEL_INIT, name=name,
                                            parent=block)
      return dense(features, 'mlp2')(exact_gelu(dense(4 * features, 'mlp1')(norm('norm2', block)(x))))
    y = (nn.remat(mlp) if self.remat_mlp else mlp)(self, x)
    return x + stochastic_depth(y, self.drop_path, self.train)


class Swin(nn.Module):
  num_classes: int
  stage_sizes: Sequence[int]
  width: int  # the first stage's; each later stage doubles it
  num_heads: Sequence[int]  # per stage
  block: Callable[..., nn.Module] = SwinBlock  # possibly wrapped in nn.remat
  patch_size: int = 4
  window: int = 7
  drop_path: float = 0.0  # the last block's rate; 0 in the first, linear in between
  dtype: Any = jnp.float32
  # The first this-many stages recompute their blocks' MLP branches in the backward pass: the widest
  # activations of the step (Swin-T at batch 256 compiled for a v5e: plan 9.14 -> 7.25 GiB, 2% more FLOPs).
  remat_mlps: int = 0

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = lambda name: nn.LayerNorm(epsilon=_EPSILON, dtype=self.dtype, name=name)
    patch = (self.patch_size, self.patch_size)
    x = nn.Conv(self.width, patch, strides=patch, padding='VALID', dtype=self.dtype, kernel_init=_KERNEL_INIT,
                name='patch_embed')(x.astype(self.dtype))
    x = norm('patch_embed_norm')(x)
    num_blocks, index = sum(self.stage_sizes), 0
    for stage, (size, heads) in enumerate(zip(self.stage_sizes, self.num_heads)):
      if stage > 0:  # patch merging: an odd map padded with zeros at its end
        batch, height, width, features = x.shape
        x = jnp.pad(x, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)))
        height, width = x.shape[1] // 2, x.shape[2] // 2
        x = x.reshape(batch, height, 2, width, 2, features).transpose(0, 1, 3, 4, 2, 5).reshape(
            batch, height, width, 4 * features)
        x = nn.Dense(2 * features, use_bias=False, dtype=self.dtype, kernel_init=_KERNEL_INIT,
                     name=f'stage{stage + 1}_merge')(norm(f'stage{stage + 1}_merge_norm')(x))
      for block in range(size):
        # Explicit names: the same parameter tree with and without remat.
        x = self.block(heads, train, window=self.window, shifted=block % 2 == 1,
                       drop_path=self.drop_path * index / max(num_blocks - 1, 1), dtype=self.dtype,
                       remat_mlp=stage < self.remat_mlps, name=f'stage{stage + 1}_block{block + 1}')(x)
        index += 1
    x = jnp.mean(norm('norm')(x), axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=_KERNEL_INIT,
                    name='head')(x).astype(jnp.float32)
