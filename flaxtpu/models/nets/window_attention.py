"""Swin's window attention as one fused TPU kernel (Pallas), forward and backward, beside the plain form.

A window holds 49 tokens and a head 32 features, so on a TPU, whose vector registers and memory tiles are
8 x 128, every array of the plain form wastes most of its lanes: the logits [windows, heads, 49, 49] and
the per-head q, k, v [windows, 49, heads, 32] are padded to 128 in their last dimension, and XLA spends a
third of Swin-T's step copying q, k and v between layouts. The kernel takes a block of windows
[windows, tokens, channels] (tokens padded to whole bfloat16 tiles, 49 -> 64, as the chip's memory
stores them anyway) and does the whole attention branch in the core's memory: the qkv projection, each
head's logits with the relative position bias and the shifted windows' mask, the softmax, and the output
projection. Its backward pass recomputes q, k, v and the logits from the windows instead of storing
them (as flash attention does), and sums the projections' gradients over the blocks. A head is picked
out of a 128-lane slice of the channels by zeroing the other heads' lanes, so no array is ever sliced
at 32 lanes.

`block` takes the kernel on a TPU and the plain form elsewhere (`platforms.tpu_or_plain`), so a step
compiled for a TPU from another machine gets the kernel too. Both compute the softmax in float32. The
per-head pieces are `attention_kernel`'s.
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flaxtpu.models.nets import attention_kernel as kernels
from flaxtpu.models.nets import platforms
from flaxtpu.models.nets.attention_kernel import own


def _windows_per_block(count: int, groups: int, tokens: int, channels: int, num_heads: int) -> int:
  """The most windows a grid step takes (see `attention_kernel.blocks_within_budget`)."""
  lanes = -(-channels // kernels.LANES) * kernels.LANES
  # Bytes a token row a lane: x, y and their gradients double-buffered, q, k, v, their gradients and the
  # output in scratch, float32 temporaries of the projections; then the logits and the bias blocks.
  per_window = tokens * lanes * 50 + kernels.logits_bytes(tokens, num_heads, bias=True)
  return kernels.blocks_within_budget(count, groups, per_window)


def _rows(x, rows: int):
  """[windows, tokens, channels] <-> [windows * tokens, channels] (tokens a multiple of 16, so that
  the change is whole tiles), through float32, whose tiles are 8 rows (bfloat16's pack 16 in 8)."""
  wide = x.astype(jnp.float32)
  return (wide.reshape(-1, wide.shape[-1]) if rows < 0 else wide.reshape(-1, rows, wide.shape[-1]))


def _matmul(a, b, dtype, transpose_a=False, transpose_b=False):
  """a @ b in `dtype` with a float32 result (a or b transposed where asked)."""
  dims = (((0,) if transpose_a else (1,)), ((1,) if transpose_b else (0,)))
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())),
                             preferred_element_type=jnp.float32)


def _project_qkv(x2, w_refs, b_refs, q_ref, k_ref, v_ref, scale):
  """q, k, v of a block (x2: its tokens as rows) into the scratch arrays, q scaled."""
  tokens = q_ref.shape[1]
  for w_ref, b_ref, out_ref, factor in zip(w_refs, b_refs, (q_ref, k_ref, v_ref), (scale, 1, 1)):
    projected = (_matmul(x2, w_ref[...], out_ref.dtype) + b_ref[...]) * factor
    out_ref[...] = _rows(projected, tokens).astype(out_ref.dtype)


def _forward_kernel(x_ref, wq_ref, wk_ref, wv_ref, wp_ref, bq_ref, bk_ref, bv_ref, bp_ref, bias_ref, y_ref,
                    q_ref, k_ref, v_ref, o_ref, *, num_heads, scale):
  dtype = q_ref.dtype
  x2 = _rows(x_ref[...], -1)
  _project_qkv(x2, (wq_ref, wk_ref, wv_ref), (bq_ref, bk_ref, bv_ref), q_ref, k_ref, v_ref, scale)

  def one_slice(lanes, first, heads):
    q, k, v = q_ref[:, :, lanes], k_ref[:, :, lanes], v_ref[:, :, lanes]
    out = 0
    for head, bounds in enumerate(heads):
      out += kernels.head_output(q, k, v, bias_ref[:, first + head], bounds)
    o_ref[:, :, lanes] = out.astype(dtype)
  kernels.each_slice(q_ref.shape[-1], num_heads, one_slice)
  y = _matmul(_rows(o_ref[...], -1), wp_ref[...], dtype) + bp_ref[...]
  y_ref[...] = _rows(y, y_ref.shape[1]).astype(y_ref.dtype)


def _backward_kernel(x_ref, wq_ref, wk_ref, wv_ref, wp_ref, bq_ref, bk_ref, bv_ref, bp_ref, bias_ref,
                     dy_ref, dx_ref, dwq_ref, dwk_ref, dwv_ref, dwp_ref, dbq_ref, dbk_ref, dbv_ref, dbp_ref,
                     dbias_ref, q_ref, k_ref, v_ref, o_ref, do_ref, dq_ref, dk_ref, dv_ref, *, num_heads,
                     scale):
  dtype = q_ref.dtype
  first_step = (pl.program_id(0) == 0) & (pl.program_id(1) == 0)

  @pl.when(first_step)
  def _():
    for ref in (dwq_ref, dwk_ref, dwv_ref, dwp_ref, dbq_ref, dbk_ref, dbv_ref, dbp_ref):
      ref[...] = jnp.zeros_like(ref)

  @pl.when(pl.program_id(1) == 0)
  def _():
    dbias_ref[...] = jnp.zeros_like(dbias_ref)

  x2 = _rows(x_ref[...], -1)
  _project_qkv(x2, (wq_ref, wk_ref, wv_ref), (bq_ref, bk_ref, bv_ref), q_ref, k_ref, v_ref, scale)
  dy2 = _rows(dy_ref[...], -1)
  do_ref[...] = _rows(_matmul(dy2, wp_ref[...], dtype, transpose_b=True), q_ref.shape[1]).astype(dtype)

  def one_slice(lanes, first, heads):
    q, k, v, grad = q_ref[:, :, lanes], k_ref[:, :, lanes], v_ref[:, :, lanes], do_ref[:, :, lanes]
    out = dq = dk = dv = 0
    for head, bounds in enumerate(heads):
      half, logits_grad, head_dq, head_dk, head_dv = kernels.head_gradients(
          q, k, v, grad, bias_ref[:, first + head], bounds)
      # The output again, for the output projection's gradient (from the weights just recomputed).
      out += jnp.einsum('wqk,wkc->wqc', half, own(v, bounds), preferred_element_type=jnp.float32)
      dbias_ref[:, first + head] += logits_grad
      dq, dk, dv = dq + head_dq, dk + head_dk, dv + head_dv
    for value, ref in ((out, o_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
      ref[:, :, lanes] = value.astype(ref.dtype)
  kernels.each_slice(q_ref.shape[-1], num_heads, one_slice)

  dwp_ref[...] += _matmul(_rows(o_ref[...], -1), dy2, dtype, transpose_a=True)
  dbp_ref[...] += dy2.sum(axis=0, keepdims=True)
  dx = 0
  for grad_ref, w_ref, dw_ref, db_ref, factor in ((dq_ref, wq_ref, dwq_ref, dbq_ref, scale),
                                                  (dk_ref, wk_ref, dwk_ref, dbk_ref, 1),
                                                  (dv_ref, wv_ref, dwv_ref, dbv_ref, 1)):
    grad2 = _rows(grad_ref[...], -1) * factor  # the gradient of x @ w + b
    dw_ref[...] += _matmul(x2, grad2, dtype, transpose_a=True)
    db_ref[...] += grad2.sum(axis=0, keepdims=True)
    dx += _matmul(grad2, w_ref[...], dtype, transpose_b=True)
  dx_ref[...] = _rows(dx, dx_ref.shape[1]).astype(dx_ref.dtype)


def _specs(count, tokens, channels, groups, num_heads):
  """The grid (bias patterns, blocks of each) and the block specs of the windows' arrays, the bias,
  the projections' kernels and their biases (whole, the same block at every step)."""
  size = _windows_per_block(count, groups, tokens, channels, num_heads)
  grid, windows, bias = kernels.grid_and_specs(count, size, tokens, channels, groups, num_heads)
  weights = pl.BlockSpec((channels, channels), lambda p, i: (0, 0))
  biases = pl.BlockSpec((1, channels), lambda p, i: (0, 0))
  return size, grid, windows, bias, weights, biases


def _cost(x, tokens: int, num_heads: int, backward: bool):
  """What a kernel computes, for XLA's cost analysis (and so MFU): the plain form's matrix products
  (the four projections and the two products of each head's logits; the backward pass twice as many;
  recomputed ones not counted) over the `tokens` real tokens, an exponential a logit, and the arrays
  of x's size read or written."""
  count, _, channels = x.shape
  products = 2 * count * tokens * channels * (4 * channels + 2 * tokens)
  return pl.CostEstimate(flops=products * (2 if backward else 1),
                         transcendentals=count * num_heads * tokens * tokens,
                         bytes_accessed=(3 if backward else 2) * x.size * x.dtype.itemsize)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12))
def fused(x, wq, wk, wv, wp, bq, bk, bv, bp, bias, num_heads: int, tokens: int, interpret: bool = False):
  """What `plain_block` computes, as one Pallas kernel, on windows of `tokens` tokens padded to a
  multiple of 16 (x [windows, padded, channels]; bias [groups, heads, padded, padded], its padded keys'
  columns very negative); the projections' kernels split into q, k and v's, their biases [1, channels].
  `interpret`: run by the Pallas interpreter, on any machine."""
  return _fused_forward(x, wq, wk, wv, wp, bq, bk, bv, bp, bias, num_heads, tokens, interpret)[0]


# Jitted, so that alike calls (a stage's blocks of one shift) trace the kernel once, not once a block.
@functools.partial(jax.jit, static_argnums=(10, 11, 12))
def _fused_forward(x, wq, wk, wv, wp, bq, bk, bv, bp, bias, num_heads, tokens, interpret):
  count, padded, channels = x.shape
  size, grid, windows, bias_spec, weights, biases = _specs(count, padded, channels, bias.shape[0], num_heads)
  kernel = functools.partial(_forward_kernel, num_heads=num_heads, scale=(channels // num_heads) ** -0.5)
  y = kernels.call(kernel, grid, [windows] + [weights] * 4 + [biases] * 4 + [bias_spec], windows,
                   jax.ShapeDtypeStruct(x.shape, x.dtype), interpret, ('parallel', 'parallel'),
                   _cost(x, tokens, num_heads, backward=False), [((size, padded, channels), x.dtype)] * 4)(
                x, wq, wk, wv, wp, bq, bk, bv, bp, kernels.tiled_bias(bias, size))
  return y, (x, wq, wk, wv, wp, bq, bk, bv, bp, bias)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _fused_backward(num_heads, tokens, interpret, residuals, grad):
  x, wq, wk, wv, wp, bq, bk, bv, bp, bias = residuals
  count, padded, channels = x.shape
  groups = bias.shape[0]
  size, grid, windows, bias_spec, weights, biases = _specs(count, padded, channels, groups, num_heads)
  kernel = functools.partial(_backward_kernel, num_heads=num_heads, scale=(channels // num_heads) ** -0.5)
  float32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  grads = kernels.call(
      kernel, grid, [windows] + [weights] * 4 + [biases] * 4 + [bias_spec, windows],
      [windows] + [weights] * 4 + [biases] * 4 + [bias_spec],
      [jax.ShapeDtypeStruct(x.shape, x.dtype)] + [float32(channels, channels)] * 4
      + [float32(1, channels)] * 4 + [float32(max(size, groups), num_heads, padded, padded)],
      interpret, ('arbitrary', 'arbitrary'), _cost(x, tokens, num_heads, backward=True),
      [((size, padded, channels), x.dtype)] * 5 + [((size, padded, channels), jnp.float32)] * 3)(
          x, wq, wk, wv, wp, bq, bk, bv, bp, kernels.tiled_bias(bias, size), grad.astype(x.dtype))
  dx, *parameters, dbias = grads
  dbias = dbias.reshape(-1, groups, num_heads, padded, padded).sum(axis=0)
  like = (wq, wk, wv, wp, bq, bk, bv, bp)
  return (dx, *(grad.astype(value.dtype) for grad, value in zip(parameters, like)), dbias.astype(bias.dtype))


fused.defvjp(_fused_forward, _fused_backward)


def plain_block(x, qkv_kernel, qkv_bias, proj_kernel, proj_bias, bias, num_heads: int):
  """The attention branch of a Swin block on its windows x [windows, tokens, channels]: timm's fused
  qkv projection ([channels, 3 * channels]), attention with `bias` (see `plain`), the output projection."""
  q, k, v = jnp.split(x @ qkv_kernel + qkv_bias, 3, axis=-1)
  scaled = q * (x.shape[-1] // num_heads) ** -0.5
  return kernels.plain(scaled, k, v, bias, num_heads) @ proj_kernel + proj_bias


def block(x, qkv_kernel, qkv_bias, proj_kernel, proj_bias, bias, num_heads: int,
          kernel: Optional[bool] = None):
  """`plain_block` as one fused kernel on a TPU and the plain form elsewhere (`kernel` True or False forces
  one; True off a TPU runs the kernel by the Pallas interpreter). Where the kernel does not fit (see
  `attention_kernel.fits`) the plain form runs everywhere."""
  if kernel is False or not kernels.fits(x.shape[0], x.shape[-1], num_heads, bias.shape[0]):
    return plain_block(x, qkv_kernel, qkv_bias, proj_kernel, proj_bias, bias, num_heads)
  fused_form = functools.partial(_padded_kernel, num_heads=num_heads,
                                 interpret=kernel is not None and jax.default_backend() != 'tpu')
  if kernel:
    return fused_form(x, qkv_kernel, qkv_bias, proj_kernel, proj_bias, bias)
  return platforms.tpu_or_plain(fused_form, functools.partial(plain_block, num_heads=num_heads),
                                x, qkv_kernel, qkv_bias, proj_kernel, proj_bias, bias)


def _padded_kernel(x, qkv_kernel, qkv_bias, proj_kernel, proj_bias, bias, *, num_heads, interpret):
  """The kernel on windows padded to a multiple of 16 tokens (whole bfloat16 tiles)."""
  count, tokens, channels = x.shape
  padded = -(-tokens // 16) * 16
  x = jnp.pad(x, ((0, 0), (0, padded - tokens), (0, 0)))
  # A padded key weighs nothing (exp(-1e9) is 0); a padded query's row is dropped.
  bias = jnp.pad(bias.astype(jnp.float32), ((0, 0), (0, 0), (0, padded - tokens), (0, padded - tokens)),
                 constant_values=-1e9)
  wq, wk, wv = jnp.split(qkv_kernel, 3, axis=-1)
  bq, bk, bv = jnp.split(qkv_bias.astype(jnp.float32)[None], 3, axis=-1)
  y = fused(x, wq, wk, wv, proj_kernel, bq, bk, bv, proj_bias.astype(jnp.float32)[None], bias, num_heads,
            tokens, interpret)
  return y[:, :tokens]
