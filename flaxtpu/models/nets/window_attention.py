"""Swin's window attention as one fused TPU kernel (Pallas), forward and backward, beside the plain form.

A window holds 49 tokens and a head 32 features, so on a TPU, whose vector registers and memory tiles are
8 x 128, every array of the plain form wastes most of its lanes: the logits [windows, heads, 49, 49] and
the per-head q, k, v [windows, 49, heads, 32] are padded to 128 in their last dimension, and XLA spends a
third of Swin-T's step copying q, k and v between layouts. The kernel reads q, k and v as the projections
write them ([windows, 49, channels]), keeps the logits in the core's memory, and writes the output as the
next projection reads it; its backward pass recomputes the logits instead of storing them (as flash
attention does). A head is picked out of a 128-lane slice of the channels by zeroing the other heads'
lanes, so no array is ever sliced at 32 lanes.

`attention` takes the kernel on a TPU and the plain form elsewhere (`platforms.tpu_or_plain`), so a
step compiled for a TPU from another machine gets the kernel too. Both compute the softmax in float32.
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flaxtpu.models.nets import platforms

_LANES = 128
# What a grid step's blocks may take of the core's memory (double-buffered inputs and outputs, and the
# float32 logits of one head), and the scoped limit the kernel asks for: a v5e core has 128 MiB.
_BLOCK_BUDGET = 24 * 2**20
_VMEM_LIMIT = 96 * 2**20


def plain(q, k, v, bias, num_heads: int):
  """[count, tokens, channels] out of q, k, v of that shape, and `bias` [groups, heads, tokens, tokens]
  added to each window's logits (window w takes group w % groups). q is already scaled."""
  count, tokens, channels = q.shape
  split = lambda x: x.reshape(count, tokens, num_heads, channels // num_heads)
  logits = jnp.einsum('bqhd,bkhd->bhqk', split(q), split(k), preferred_element_type=jnp.float32)
  groups = bias.shape[0]
  logits = (logits.reshape(count // groups, groups, num_heads, tokens, tokens) + bias).reshape(logits.shape)
  weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum('bhqk,bkhd->bqhd', weights, split(v)).reshape(count, tokens, channels)


def _windows_per_block(count: int, groups: int, tokens: int, channels: int, num_heads: int) -> int:
  """The most windows a grid step takes within the budget: a divisor of `count`, and a multiple or a
  divisor of `groups` (so that a block's windows meet the bias groups in one fixed pattern)."""
  rows = -(-tokens // 8) * 8
  lanes = -(-channels // _LANES) * _LANES
  per_window = (rows * lanes * 2 * 8 * 2  # q, k, v, out and their gradients, bfloat16, double-buffered
                + rows * -(-tokens // _LANES) * _LANES * 4 * (6 + 2 * num_heads))  # logits; bias blocks
  fits = [size for size in range(1, count + 1) if count % size == 0 and size * per_window <= _BLOCK_BUDGET
          and (size % groups == 0 or groups % size == 0)]
  return max(fits, default=1)


def _slices(channels: int, num_heads: int):
  """The 128-lane slices of the channels, each with its heads as (head, its lanes within the slice): a
  head's features lie in one slice (128 is a multiple of the head's width)."""
  head_dim = channels // num_heads
  slices = []
  for start in range(0, channels, _LANES):
    stop = min(start + _LANES, channels)
    heads = [(head, (head * head_dim - start, (head + 1) * head_dim - start))
             for head in range(start // head_dim, stop // head_dim)]
    slices.append((slice(start, stop), heads))
  return slices


def _own(x, lanes):
  """x with the lanes outside [lanes) zeroed (built in the kernel: a kernel captures no arrays)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.where((lane >= lanes[0]) & (lane < lanes[1]), x, jnp.zeros_like(x))


def _logits(q, k, bias, lanes):
  """One head's float32 logits [windows, tokens, tokens]: the other heads' lanes of q zeroed."""
  return jnp.einsum('wqc,wkc->wqk', _own(q, lanes), k, preferred_element_type=jnp.float32) + bias


def _softmax(logits):
  weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
  return weights / weights.sum(axis=-1, keepdims=True)


def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, out_ref, *, slices):
  for lanes, heads in slices:
    q, k, v = q_ref[:, :, lanes], k_ref[:, :, lanes], v_ref[:, :, lanes]
    out = 0
    for head, bounds in heads:
      weights = _softmax(_logits(q, k, bias_ref[:, head], bounds)).astype(v.dtype)
      out += jnp.einsum('wqk,wkc->wqc', weights, _own(v, bounds), preferred_element_type=jnp.float32)
    out_ref[:, :, lanes] = out.astype(out_ref.dtype)


def _backward_kernel(q_ref, k_ref, v_ref, bias_ref, grad_ref, dq_ref, dk_ref, dv_ref, dbias_ref, *, slices):
  @pl.when(pl.program_id(1) == 0)
  def _():
    dbias_ref[...] = jnp.zeros_like(dbias_ref)

  for lanes, heads in slices:
    q, k, v, grad = q_ref[:, :, lanes], k_ref[:, :, lanes], v_ref[:, :, lanes], grad_ref[:, :, lanes]
    dq = dk = dv = 0
    for head, bounds in heads:
      weights = _softmax(_logits(q, k, bias_ref[:, head], bounds))
      own_grad = _own(grad, bounds)
      dv += jnp.einsum('wqk,wqc->wkc', weights.astype(v.dtype), own_grad, preferred_element_type=jnp.float32)
      weights_grad = jnp.einsum('wqc,wkc->wqk', own_grad, v, preferred_element_type=jnp.float32)
      logits_grad = weights * (weights_grad - (weights * weights_grad).sum(axis=-1, keepdims=True))
      dbias_ref[:, head] += logits_grad
      logits_grad = logits_grad.astype(q.dtype)
      dq += jnp.einsum('wqk,wkc->wqc', logits_grad, _own(k, bounds), preferred_element_type=jnp.float32)
      dk += jnp.einsum('wqk,wqc->wkc', logits_grad, _own(q, bounds), preferred_element_type=jnp.float32)
    for value, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
      ref[:, :, lanes] = value.astype(ref.dtype)


def _specs(count, tokens, channels, groups, num_heads):
  """The grid (bias patterns, blocks of each) and the block specs of the windows' arrays and the bias."""
  size = _windows_per_block(count, groups, tokens, channels, num_heads)
  patterns = max(groups // size, 1)  # a block's windows meet the groups in one of these patterns
  grid = (patterns, count // size // patterns)
  windows = pl.BlockSpec((size, tokens, channels), lambda p, i: (i * patterns + p, 0, 0))
  bias = pl.BlockSpec((size, num_heads, tokens, tokens), lambda p, i: (p, 0, 0, 0))
  return size, grid, windows, bias


def _tiled_bias(bias, size):
  """bias [groups, ...] repeated to a block's windows, where a block holds whole groups."""
  return jnp.tile(bias, (max(size // bias.shape[0], 1), 1, 1, 1))


def _cost(q, num_heads: int, products: int, arrays: int):
  """What a kernel computes, for XLA's cost analysis (and so MFU): `products` matrix products of q's
  shape by the logits' (as many as the plain form has: recomputed logits are not counted), an
  exponential a logit, and `arrays` arrays of q's size read or written."""
  count, tokens, channels = q.shape
  return pl.CostEstimate(flops=2 * products * count * tokens * tokens * channels,
                         transcendentals=count * num_heads * tokens * tokens,
                         bytes_accessed=arrays * q.size * q.dtype.itemsize)


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, semantics, cost):
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  params = {} if interpret else {'compiler_params': pltpu.CompilerParams(
      dimension_semantics=semantics, vmem_limit_bytes=_VMEM_LIMIT)}
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, cost_estimate=cost, **params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fused(q, k, v, bias, num_heads: int, interpret: bool = False):
  """What `plain` computes, as one Pallas kernel (`interpret`: run it by the Pallas interpreter, on any
  machine)."""
  return _fused_forward(q, k, v, bias, num_heads, interpret)[0]


def _fused_forward(q, k, v, bias, num_heads, interpret):
  count, tokens, channels = q.shape
  size, grid, windows, bias_spec = _specs(count, tokens, channels, bias.shape[0], num_heads)
  kernel = functools.partial(_forward_kernel, slices=_slices(channels, num_heads))
  out = _call(kernel, grid, [windows, windows, windows, bias_spec], windows,
              jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, ('parallel', 'parallel'),
              _cost(q, num_heads, products=2, arrays=4))(
                  q, k, v, _tiled_bias(bias.astype(jnp.float32), size))
  return out, (q, k, v, bias)


def _fused_backward(num_heads, interpret, residuals, grad):
  q, k, v, bias = residuals
  count, tokens, channels = q.shape
  groups = bias.shape[0]
  size, grid, windows, bias_spec = _specs(count, tokens, channels, groups, num_heads)
  kernel = functools.partial(_backward_kernel, slices=_slices(channels, num_heads))
  dbias_shape = jax.ShapeDtypeStruct((max(size, groups), num_heads, tokens, tokens), jnp.float32)
  dq, dk, dv, dbias = _call(
      kernel, grid, [windows] * 3 + [bias_spec, windows], [windows] * 3 + [bias_spec],
      [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3 + [dbias_shape], interpret, ('parallel', 'arbitrary'),
      _cost(q, num_heads, products=4, arrays=7))(
          q, k, v, _tiled_bias(bias.astype(jnp.float32), size), grad.astype(q.dtype))
  dbias = dbias.reshape(-1, groups, num_heads, tokens, tokens).sum(axis=0).astype(bias.dtype)
  return dq, dk, dv, dbias


fused.defvjp(_fused_forward, _fused_backward)


def attention(q, k, v, bias, num_heads: int, kernel: Optional[bool] = None):
  """Window attention (see `plain`): the fused kernel on a TPU, the plain form elsewhere; `kernel`
  True or False forces one (True off a TPU runs the kernel by the Pallas interpreter). Heads wider than
  128 lanes, or not dividing them, take the plain form everywhere, and so does a symbolic number of
  windows (an export's batch: the kernel's blocks are sized to a known one)."""
  if (kernel is False or not isinstance(q.shape[0], int) or _LANES % (q.shape[-1] // num_heads)
      or q.shape[0] % bias.shape[0]):
    return plain(q, k, v, bias, num_heads)
  if kernel is None:
    return platforms.tpu_or_plain(lambda *a: fused(*a, num_heads), lambda *a: plain(*a, num_heads), q, k, v,
                                  bias)
  return fused(q, k, v, bias, num_heads, jax.default_backend() != 'tpu')
