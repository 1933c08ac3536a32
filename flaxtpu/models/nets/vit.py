"""Vision Transformers (Dosovitskiy et al. 2021), laid out as big_vision's `vit.py`, with the variants
timm's VisionTransformer has: DeiT's distillation token, DINOv2's layer scale and registers, CLIP's pre-norm.

Non-overlapping `patch_size` patches -> learned position embeddings (sized
from the image at init) -> pre-LayerNorm encoder blocks -> LayerNorm -> global
average pooling (`pool='gap'`, big_vision's default), a class token
(`pool='tok'`, the paper's), attention pooling with one learned query
(`pool='map'`, SigLIP's MAP head) or, with a class token the head does not
read, the patch tokens' mean normed by `fc_norm` instead of the final norm
(`pool='avg'`, MAE/BEiT) -> a zero-initialised head. Prefix tokens (class,
distillation, registers) come before the patches; the position embeddings
cover them too, except with registers (timm's no_embed_class, DINOv2). Dropout sits where
big_vision puts it (after the embeddings, inside the MLP, on each residual
branch); stochastic depth drops a whole residual branch per example, at a
rate that grows linearly from 0 in the first block to `drop_path` in the last
(timm/DeiT). `gelu='exact'` is the erf GELU of timm and PyTorch, `'tanh'`
big_vision's approximation (what flaxtpu used before, and what runs saved
without `model.gelu` keep), `'quick'` OpenAI CLIP's x * sigmoid(1.702 x);
published weights compute the same function with the GELU they were trained
with. The position embeddings have one entry per
token of the image size seen at init; `resample_position_embeddings` fits
them to another size as timm does.
"""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxtpu.models.nets import attention_kernel


def stochastic_depth(x: jax.Array, rate: float, train: bool) -> jax.Array:
  """Drops the whole residual branch `x` of an example with probability `rate` (timm's DropPath).

  Kept branches are scaled by 1 / (1 - rate); a no-op in eval or at rate 0.
  """
  return nn.Dropout(rate, broadcast_dims=tuple(range(1, x.ndim)), deterministic=not train)(x)


# The float32 error function of Eigen and XLA: z P(z^2) / Q(z^2) on z clipped to [-4, 4], within 4e-7 of erf.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _cdf(x: jax.Array) -> jax.Array:
  """Phi(x) = 0.5 (1 + erf(x / sqrt 2)) in float32, erf as XLA computes it."""
  z = jnp.clip(x * np.float32(np.sqrt(0.5)), -4.0, 4.0)
  z2 = z * z
  horner = lambda coefficients: functools.reduce(lambda value, c: value * z2 + c, coefficients[1:],
                                                 coefficients[0])
  return 0.5 * (1 + z * horner(_ERF_P) / horner(_ERF_Q))


@jax.custom_jvp
def exact_gelu(x: jax.Array) -> jax.Array:
  """x * Phi(x) with the error function, as PyTorch computes it: 0.5 x (1 + erf(x / sqrt 2)), in float32.

  The same function as `nn.gelu(x, approximate=False)` (within 2e-6 in float32), which computes
  erfc(-x / sqrt 2) instead: XLA expands erfc into two approximations and an exponential, and on a TPU
  an MLP's first layer waits for its GELU (ConvNeXt-T's at 17 of 197 TFLOP/s). erf is written out
  as XLA computes it because `lax.erf` lowers to a composite op that TensorFlow's SavedModel loader
  cannot read (the `--mode=export` SavedModel). Its derivative is GELU's own, Phi(x) + x phi(x), not
  autodiff's of the rational function (2.2x the vector operations).
  """
  wide = x.astype(jnp.float32)
  return (wide * _cdf(wide)).astype(x.dtype)


@exact_gelu.defjvp
def _exact_gelu_jvp(primals, tangents):
  x, = primals
  dx, = tangents
  wide = x.astype(jnp.float32)
  cdf = _cdf(wide)
  # The slope in x's dtype: what a backward pass keeps of this layer is no larger than x.
  slope = (cdf + wide * jnp.exp(-0.5 * wide * wide) * np.float32(1 / np.sqrt(2 * np.pi))).astype(x.dtype)
  return (wide * cdf).astype(x.dtype), slope * dx


def activation(gelu: str) -> Callable[[jax.Array], jax.Array]:
  """'exact' (erf, timm) | 'tanh' (big_vision) | 'quick' (OpenAI CLIP's QuickGELU)."""
  if gelu == 'quick':
    return lambda x: x * nn.sigmoid(1.702 * x)
  return exact_gelu if gelu == 'exact' else functools.partial(nn.gelu, approximate=True)


def mlp(x: jax.Array, mlp_dim: int, gelu: str, dropout: Callable, dtype: Any) -> jax.Array:
  """The two-layer MLP of a block or a MAP head (mlp1, mlp2), built in the calling module."""
  dense = lambda features, name: nn.Dense(
      features, dtype=dtype, kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6), name=name)
  y = dropout(activation(gelu)(dense(mlp_dim, 'mlp1')(x)))
  return dense(x.shape[-1], 'mlp2')(y)


def fused_attention(query, key, value, bias=None, mask=None, **_):
  """flax's dot_product_attention for nn.MultiHeadDotProductAttention without dropout, bias or mask, as
  `attention_kernel.attention` computes it on q, k and v flattened to [batch, tokens, channels]: one
  kernel on a TPU (its logits and softmax never leave the core's memory), the plain form elsewhere."""
  if bias is not None or mask is not None:
    return nn.dot_product_attention(query, key, value, bias, mask)
  batch, tokens, heads, head_dim = query.shape
  flat = lambda x: x.reshape(batch, tokens, heads * head_dim)
  out = attention_kernel.attention(flat(query / jnp.sqrt(head_dim).astype(query.dtype)), flat(key),
                                   flat(value), heads)
  return out.reshape(batch, tokens, heads, head_dim)


class EncoderBlock(nn.Module):
  """Pre-LayerNorm self-attention and GELU MLP, each a residual branch: one remat unit."""
  num_heads: int
  mlp_dim: int
  train: bool
  dropout: float = 0.0
  drop_path: float = 0.0
  gelu: str = 'exact'  # 'exact' (erf, timm) | 'tanh' (big_vision) | 'quick' (OpenAI CLIP)
  layer_scale: bool = False  # DINOv2: each branch times a learned per-channel scale (ls1, ls2), from 1e-5
  norm_eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    dropout = nn.Dropout(self.dropout, deterministic=not self.train)
    scale = lambda y, name: (y * self.param(name, nn.initializers.constant(1e-5), (y.shape[-1],)).astype(
        self.dtype) if self.layer_scale else y)
    y = nn.LayerNorm(self.norm_eps, dtype=self.dtype, name='norm1')(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dtype=self.dtype,
                                        kernel_init=nn.initializers.xavier_uniform(),
                                        attention_fn=fused_attention, deterministic=True,
                                        name='attention')(y, y)
    x = x + stochastic_depth(scale(dropout(y), 'ls1'), self.drop_path, self.train)
    y = nn.LayerNorm(self.norm_eps, dtype=self.dtype, name='norm2')(x)
    y = mlp(y, self.mlp_dim, self.gelu, dropout, self.dtype)
    return x + stochastic_depth(scale(dropout(y), 'ls2'), self.drop_path, self.train)


class MAPHead(nn.Module):
  """Multihead attention pooling (big_vision's MAPHead, timm's AttentionPoolLatent): one learned query
  (`probe`) attends over the tokens, then a residual pre-LayerNorm MLP; returns [batch, width]."""
  num_heads: int
  mlp_dim: int
  gelu: str = 'exact'
  norm_eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    batch, _, width = x.shape
    probe = self.param('probe', nn.initializers.xavier_uniform(), (1, 1, width))
    x = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dtype=self.dtype,
                                        kernel_init=nn.initializers.xavier_uniform(), deterministic=True,
                                        name='attention')(jnp.broadcast_to(probe.astype(self.dtype),
                                                                           (batch, 1, width)), x)
    y = nn.LayerNorm(self.norm_eps, dtype=self.dtype, name='norm')(x)
    return (x + mlp(y, self.mlp_dim, self.gelu, lambda y: y, self.dtype))[:, 0]


class ViT(nn.Module):
  num_classes: int
  patch_size: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  block: Callable[..., nn.Module] = EncoderBlock  # possibly wrapped in nn.remat
  pool: str = 'gap'  # 'gap' | 'tok' | 'map' | 'avg'
  dropout: float = 0.0
  drop_path: float = 0.0  # the last block's rate
  gelu: str = 'exact'
  distilled: bool = False  # DeiT: a distillation token and its own head (head_dist), the two averaged
  registers: int = 0  # DINOv2's register tokens, after the class token; no position embeddings for either
  layer_scale: bool = False
  pre_norm: bool = False  # CLIP: a LayerNorm (norm_pre) after the embeddings, which have no bias then
  norm_eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    patch = (self.patch_size, self.patch_size)
    x = nn.Conv(self.width, patch, strides=patch, padding='VALID', use_bias=not self.pre_norm,
                dtype=self.dtype, name='embedding')(x.astype(self.dtype))
    batch, rows, cols, _ = x.shape
    x = x.reshape(batch, rows * cols, self.width)
    prefix = []  # the tokens before the patches, in timm's order
    if self.pool in ('tok', 'avg'):
      prefix.append(self.param('cls', nn.initializers.zeros, (1, 1, self.width)))
    if self.distilled:
      prefix.append(self.param('dist', nn.initializers.zeros, (1, 1, self.width)))
    if self.registers:
      prefix.append(self.param('registers', nn.initializers.normal(stddev=1e-6),
                               (1, self.registers, self.width)))
    prepend = lambda x: jnp.concatenate(
        [jnp.broadcast_to(token.astype(self.dtype), (batch, *token.shape[1:])) for token in prefix] + [x], 1)
    if not self.registers:
      x = prepend(x)
    # One embedding per token of the image size seen at init: a new size needs a new model.
    position = self.param('pos_embedding', nn.initializers.normal(stddev=self.width**-0.5),
                          (1, x.shape[1], self.width))
    x = x + position.astype(self.dtype)
    if self.registers:
      x = prepend(x)
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    norm = lambda name: nn.LayerNorm(self.norm_eps, dtype=self.dtype, name=name)
    if self.pre_norm:
      x = norm('norm_pre')(x)
    for index in range(self.depth):
      # Explicit names: the same parameter tree with and without remat.
      x = self.block(self.num_heads, self.mlp_dim, train, dropout=self.dropout,
                     drop_path=self.drop_path * index / max(self.depth - 1, 1), gelu=self.gelu,
                     layer_scale=self.layer_scale, norm_eps=self.norm_eps, dtype=self.dtype,
                     name=f'block{index + 1}')(x)
    patches = sum(token.shape[1] for token in prefix)  # where the patch tokens start
    if self.pool == 'avg':
      x = norm('fc_norm')(jnp.mean(x[:, patches:], axis=1))
    else:
      x = norm('encoder_norm')(x)
    if self.pool == 'map':
      x = MAPHead(self.num_heads, self.mlp_dim, self.gelu, self.norm_eps, self.dtype, name='map_head')(
          x[:, patches:])
    elif self.pool == 'gap':
      x = jnp.mean(x[:, patches:], axis=1)
    head = lambda name: nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=nn.initializers.zeros,
                                 name=name)
    if self.distilled:  # timm's DeiT: the mean of the two heads, in training too (no teacher here)
      return ((head('head')(x[:, 0]) + head('head_dist')(x[:, 1])) / 2).astype(jnp.float32)
    if self.pool == 'tok':
      x = x[:, 0]
    return head('head')(x).astype(jnp.float32)
