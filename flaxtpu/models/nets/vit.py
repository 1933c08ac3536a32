"""Vision Transformers (Dosovitskiy et al. 2021), laid out as big_vision's `vit.py`: vit_ti, vit_s, vit_b.

Non-overlapping `patch_size` patches -> learned position embeddings (sized
from the image at init) -> pre-LayerNorm encoder blocks -> LayerNorm -> global
average pooling (`pool='gap'`, big_vision's default) or a class token
(`pool='tok'`, the paper's) -> a zero-initialised head. Dropout sits where
big_vision puts it (after the embeddings, inside the MLP, on each residual
branch); stochastic depth drops a whole residual branch per example, at a
rate that grows linearly from 0 in the first block to `drop_path` in the last
(timm/DeiT). `gelu='exact'` is the erf GELU of timm and PyTorch, `'tanh'`
big_vision's approximation (what flaxtpu used before, and what runs saved
without `model.gelu` keep); published weights compute the same function with
the GELU they were trained with. The position embeddings have one entry per
token of the image size seen at init; `resample_position_embeddings` fits
them to another size as timm does.
"""

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


def stochastic_depth(x: jax.Array, rate: float, train: bool) -> jax.Array:
  """Drops the whole residual branch `x` of an example with probability `rate` (timm's DropPath).

  Kept branches are scaled by 1 / (1 - rate); a no-op in eval or at rate 0.
  """
  return nn.Dropout(rate, broadcast_dims=tuple(range(1, x.ndim)), deterministic=not train)(x)


class EncoderBlock(nn.Module):
  """Pre-LayerNorm self-attention and GELU MLP, each a residual branch: one remat unit."""
  num_heads: int
  mlp_dim: int
  train: bool
  dropout: float = 0.0
  drop_path: float = 0.0
  gelu: str = 'exact'  # 'exact' (erf, timm) | 'tanh' (big_vision)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    dropout = nn.Dropout(self.dropout, deterministic=not self.train)
    dense = lambda features, name: nn.Dense(
        features, dtype=self.dtype, kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6), name=name)
    y = nn.LayerNorm(dtype=self.dtype, name='norm1')(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dtype=self.dtype,
                                        kernel_init=nn.initializers.xavier_uniform(),
                                        deterministic=True, name='attention')(y, y)
    x = x + stochastic_depth(dropout(y), self.drop_path, self.train)
    y = nn.LayerNorm(dtype=self.dtype, name='norm2')(x)
    y = dropout(nn.gelu(dense(self.mlp_dim, 'mlp1')(y), approximate=self.gelu == 'tanh'))
    y = dense(x.shape[-1], 'mlp2')(y)
    return x + stochastic_depth(dropout(y), self.drop_path, self.train)


class ViT(nn.Module):
  num_classes: int
  patch_size: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  block: Callable[..., nn.Module] = EncoderBlock  # possibly wrapped in nn.remat
  pool: str = 'gap'  # 'gap' | 'tok'
  dropout: float = 0.0
  drop_path: float = 0.0  # the last block's rate
  gelu: str = 'exact'
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    patch = (self.patch_size, self.patch_size)
    x = nn.Conv(self.width, patch, strides=patch, padding='VALID', dtype=self.dtype,
                name='embedding')(x.astype(self.dtype))
    batch, rows, cols, _ = x.shape
    x = x.reshape(batch, rows * cols, self.width)
    if self.pool == 'tok':
      token = self.param('cls', nn.initializers.zeros, (1, 1, self.width))
      x = jnp.concatenate([jnp.broadcast_to(token.astype(self.dtype), (batch, 1, self.width)), x], 1)
    # One embedding per token of the image size seen at init: a new size needs a new model.
    position = self.param('pos_embedding', nn.initializers.normal(stddev=self.width**-0.5),
                          (1, x.shape[1], self.width))
    x = nn.Dropout(self.dropout, deterministic=not train)(x + position.astype(self.dtype))
    for index in range(self.depth):
      # Explicit names: the same parameter tree with and without remat.
      x = self.block(self.num_heads, self.mlp_dim, train, dropout=self.dropout,
                     drop_path=self.drop_path * index / max(self.depth - 1, 1), gelu=self.gelu,
                     dtype=self.dtype,
                     name=f'block{index + 1}')(x)
    x = nn.LayerNorm(dtype=self.dtype, name='encoder_norm')(x)
    x = jnp.mean(x, axis=1) if self.pool == 'gap' else x[:, 0]
    return nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=nn.initializers.zeros,
                    name='head')(x).astype(jnp.float32)
