"""Multi-head attention as one TPU kernel (Pallas), forward and backward, beside the plain form; and
the pieces Swin's fused block (`window_attention`) shares with it.

On a TPU, whose vector registers and memory tiles are 8 x 128, a head of 32 or 64 features wastes
lanes in every per-head array of the plain form ([batch, tokens, heads, head_dim] and the logits
[batch, heads, tokens, tokens]), and XLA spends a large share of a transformer's step copying q, k and
v between layouts (12% of ViT-B/16's, a third of Swin-T's). The kernel takes q, k and v with their
heads side by side ([batch, tokens, channels]), keeps each head's logits in the core's memory, and
writes the output in that layout; its backward pass recomputes the logits instead of storing them, as
flash attention does. A head is picked out of a 128-lane slice of the channels by
zeroing the other heads' lanes, so no array is ever sliced narrower than 128 lanes.

`attention` takes the kernel on a TPU and the plain form elsewhere (`platforms.tpu_or_plain`), so a
step compiled for a TPU from another machine gets the kernel too. Both compute the softmax in float32.
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flaxtpu.models.nets import platforms

LANES = 128
# What a grid step's blocks may take of the core's memory (double-buffered inputs and outputs, and the
# float32 logits of one head), and the scoped limit a kernel asks for: a v5e core has 128 MiB.
BLOCK_BUDGET = 24 * 2**20
VMEM_LIMIT = 96 * 2**20


def plain(q, k, v, bias, num_heads: int):
  """[count, tokens, channels] out of q, k, v of that shape, and `bias` (None, or [groups, heads,
  tokens, tokens] added to each window's logits: window w takes group w % groups). q is already scaled."""
  count, tokens, channels = q.shape
  split = lambda x: x.reshape(count, tokens, num_heads, channels // num_heads)
  logits = jnp.einsum('bqhd,bkhd->bhqk', split(q), split(k), preferred_element_type=jnp.float32)
  if bias is not None:
    groups = bias.shape[0]
    logits = (logits.reshape(count // groups, groups, num_heads, tokens, tokens) + bias).reshape(logits.shape)
  weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum('bhqk,bkhd->bqhd', weights, split(v)).reshape(count, tokens, channels)


def fits(count, channels: int, num_heads: int, groups: int = 1) -> bool:
  """Whether the kernels take these shapes: heads of 128 lanes or a divisor of them, a known count
  (an export's batch is symbolic: the kernel's blocks are sized to a known one), whole bias groups."""
  return (isinstance(count, int) and channels % num_heads == 0 and LANES % (channels // num_heads) == 0
          and count % groups == 0)


def blocks_within_budget(count: int, groups: int, per_window: int) -> int:
  """The most windows a grid step takes within the budget: a divisor of `count`, and a multiple or a
  divisor of `groups` (so that a block's windows meet the bias groups in one fixed pattern)."""
  sizes = [size for size in range(1, count + 1) if count % size == 0 and size * per_window <= BLOCK_BUDGET
           and (size % groups == 0 or groups % size == 0)]
  return max(sizes, default=1)


def logits_bytes(tokens: int, num_heads: int, bias: bool) -> int:
  """A window's bytes of float32 logits-shaped temporaries (six), and of its bias blocks."""
  rows = -(-tokens // 8) * 8
  return rows * -(-tokens // LANES) * LANES * 4 * (6 + (2 * num_heads if bias else 0))


def each_slice(channels: int, num_heads: int, body) -> None:
  """body(lanes, first head, the heads' lanes within the slice) for each 128-lane slice of the
  channels (a head's features lie in one slice: 128 is a multiple of a head's width): a loop where the
  slices are alike (so a 24-head layer compiles 4 heads' code, not 24), else one call each."""
  head_dim = channels // num_heads
  heads = [(head * head_dim, (head + 1) * head_dim) for head in range(LANES // head_dim)]
  if channels % LANES:
    for start in range(0, channels, LANES):
      stop = min(start + LANES, channels)
      body(slice(start, stop), start // head_dim, heads[:(stop - start) // head_dim])
    return

  def step(index, carry):
    body(pl.ds(pl.multiple_of(index * LANES, LANES), LANES), index * len(heads), heads)
    return carry
  jax.lax.fori_loop(0, channels // LANES, step, 0)


def own(x, lanes):
  """x with the lanes outside [lanes) zeroed (built in the kernel: a kernel captures no arrays)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.where((lane >= lanes[0]) & (lane < lanes[1]), x, jnp.zeros_like(x))


def head_logits(q, k, bias, lanes):
  """One head's float32 logits [windows, tokens, tokens] (the other heads' lanes of q zeroed), plus
  its bias block where there is one."""
  logits = jnp.einsum('wqc,wkc->wqk', own(q, lanes), k, preferred_element_type=jnp.float32)
  return logits if bias is None else logits + bias


def softmax(logits):
  weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
  return weights / weights.sum(axis=-1, keepdims=True)


def head_output(q, k, v, bias, lanes):
  """One head's share of the output [windows, tokens, slice] in float32: its softmax weights times its
  lanes of v (the other heads' lanes zero)."""
  weights = softmax(head_logits(q, k, bias, lanes)).astype(v.dtype)
  return jnp.einsum('wqk,wkc->wqc', weights, own(v, lanes), preferred_element_type=jnp.float32)


def head_gradients(q, k, v, grad, bias, lanes):
  """One head's backward pass, its logits recomputed: its softmax weights in v's dtype, the float32
  gradient of its logits (the bias's), and its shares of the gradients of q, k and v in float32."""
  weights = softmax(head_logits(q, k, bias, lanes))
  half = weights.astype(v.dtype)
  own_grad = own(grad, lanes)
  dv = jnp.einsum('wqk,wqc->wkc', half, own_grad, preferred_element_type=jnp.float32)
  weights_grad = jnp.einsum('wqc,wkc->wqk', own_grad, v, preferred_element_type=jnp.float32)
  logits_grad = weights * (weights_grad - (weights * weights_grad).sum(axis=-1, keepdims=True))
  rounded = logits_grad.astype(q.dtype)
  dq = jnp.einsum('wqk,wkc->wqc', rounded, own(k, lanes), preferred_element_type=jnp.float32)
  dk = jnp.einsum('wqk,wqc->wkc', rounded, own(q, lanes), preferred_element_type=jnp.float32)
  return half, logits_grad, dq, dk, dv


def tiled_bias(bias, size):
  """bias [groups, ...] repeated to a block's windows, where a block holds whole groups."""
  return jnp.tile(bias, (max(size // bias.shape[0], 1), 1, 1, 1))


def call(kernel, grid, in_specs, out_specs, out_shape, interpret, semantics, cost, scratch=()):
  """pl.pallas_call with the TPU's compiler parameters (none for the interpreter); `scratch`: the
  (shape, dtype) of each array in the core's memory."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  params = {} if interpret else {'compiler_params': pltpu.CompilerParams(
      dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT)}
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch],
                        interpret=interpret, cost_estimate=cost, **params)


def _forward_kernel(*refs, num_heads, biased):
  q_ref, k_ref, v_ref, out_ref = refs[0], refs[1], refs[2], refs[-1]
  bias_ref = refs[3] if biased else None

  def one_slice(lanes, first, heads):
    q, k, v = q_ref[:, :, lanes], k_ref[:, :, lanes], v_ref[:, :, lanes]
    out = 0
    for head, bounds in enumerate(heads):
      out += head_output(q, k, v, None if bias_ref is None else bias_ref[:, first + head], bounds)
    out_ref[:, :, lanes] = out.astype(out_ref.dtype)
  each_slice(q_ref.shape[-1], num_heads, one_slice)


def _backward_kernel(*refs, num_heads, biased):
  if biased:
    q_ref, k_ref, v_ref, bias_ref, grad_ref, dq_ref, dk_ref, dv_ref, dbias_ref = refs

    @pl.when(pl.program_id(1) == 0)
    def _():
      dbias_ref[...] = jnp.zeros_like(dbias_ref)
  else:
    (q_ref, k_ref, v_ref, grad_ref, dq_ref, dk_ref, dv_ref), bias_ref = refs, None

  def one_slice(lanes, first, heads):
    q, k, v, grad = q_ref[:, :, lanes], k_ref[:, :, lanes], v_ref[:, :, lanes], grad_ref[:, :, lanes]
    dq = dk = dv = 0
    for head, bounds in enumerate(heads):
      bias = None if bias_ref is None else bias_ref[:, first + head]
      _, logits_grad, head_dq, head_dk, head_dv = head_gradients(q, k, v, grad, bias, bounds)
      if bias_ref is not None:
        dbias_ref[:, first + head] += logits_grad
      dq, dk, dv = dq + head_dq, dk + head_dk, dv + head_dv
    for value, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
      ref[:, :, lanes] = value.astype(ref.dtype)
  each_slice(q_ref.shape[-1], num_heads, one_slice)


def _window_bytes(tokens, channels, num_heads, biased) -> int:
  """What a window takes of the core's memory in a grid step: q, k, v, the output and the gradients
  (bfloat16, double-buffered), and the logits-shaped temporaries."""
  lanes = -(-channels // LANES) * LANES
  return -(-tokens // 8) * 8 * lanes * 2 * 8 * 2 + logits_bytes(tokens, num_heads, biased)


def grid_and_specs(count, size, tokens, channels, groups, num_heads):
  """For blocks of `size` windows: the grid (bias patterns, blocks of each), and the block specs of the
  windows' arrays [count, tokens, channels] and of the bias tiled to a block (`tiled_bias`)."""
  patterns = max(groups // size, 1)  # a block's windows meet the groups in one of these patterns
  grid = (patterns, count // size // patterns)
  windows = pl.BlockSpec((size, tokens, channels), lambda p, i: (i * patterns + p, 0, 0))
  bias = pl.BlockSpec((size, num_heads, tokens, tokens), lambda p, i: (p, 0, 0, 0))
  return grid, windows, bias


def _specs(count, tokens, channels, groups, num_heads, biased):
  """The block size, the grid and the block specs of the windows' arrays and the bias."""
  size = blocks_within_budget(count, groups, _window_bytes(tokens, channels, num_heads, biased))
  return (size, *grid_and_specs(count, size, tokens, channels, groups, num_heads))


def _cost(q, num_heads: int, products: int, arrays: int):
  """What a kernel computes, for XLA's cost analysis (and so MFU): `products` matrix products of q's
  shape by the logits' (as many as the plain form has: recomputed logits are not counted), an
  exponential a logit, and `arrays` arrays of q's size read or written."""
  count, tokens, channels = q.shape
  return pl.CostEstimate(flops=2 * products * count * tokens * tokens * channels,
                         transcendentals=count * num_heads * tokens * tokens,
                         bytes_accessed=arrays * q.size * q.dtype.itemsize)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fused(q, k, v, bias, num_heads: int, interpret: bool = False):
  """What `plain` computes, as one Pallas kernel (`interpret`: run it by the Pallas interpreter, on any
  machine)."""
  return _fused_forward(q, k, v, bias, num_heads, interpret)[0]


# Jitted, so that alike calls (ViT-B/16's twelve blocks) trace the kernel once, not once a block.
@functools.partial(jax.jit, static_argnums=(4, 5))
def _fused_forward(q, k, v, bias, num_heads, interpret):
  count, tokens, channels = q.shape
  biased = bias is not None
  size, grid, windows, bias_spec = _specs(count, tokens, channels, bias.shape[0] if biased else 1, num_heads,
                                          biased)
  kernel = functools.partial(_forward_kernel, num_heads=num_heads, biased=biased)
  biases = [tiled_bias(bias.astype(jnp.float32), size)] if biased else []
  out = call(kernel, grid, [windows] * 3 + [bias_spec] * biased, windows,
             jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, ('parallel', 'parallel'),
             _cost(q, num_heads, products=2, arrays=4))(q, k, v, *biases)
  return out, (q, k, v, bias)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _fused_backward(num_heads, interpret, residuals, grad):
  q, k, v, bias = residuals
  count, tokens, channels = q.shape
  biased = bias is not None
  groups = bias.shape[0] if biased else 1
  size, grid, windows, bias_spec = _specs(count, tokens, channels, groups, num_heads, biased)
  kernel = functools.partial(_backward_kernel, num_heads=num_heads, biased=biased)
  like_q = jax.ShapeDtypeStruct(q.shape, q.dtype)
  if not biased:
    dq, dk, dv = call(kernel, grid, [windows] * 4, [windows] * 3, [like_q] * 3, interpret,
                      ('parallel', 'parallel'), _cost(q, num_heads, products=4, arrays=7))(
                          q, k, v, grad.astype(q.dtype))
    return dq, dk, dv, None
  dbias_shape = jax.ShapeDtypeStruct((max(size, groups), num_heads, tokens, tokens), jnp.float32)
  dq, dk, dv, dbias = call(
      kernel, grid, [windows] * 3 + [bias_spec, windows], [windows] * 3 + [bias_spec],
      [like_q] * 3 + [dbias_shape], interpret, ('parallel', 'arbitrary'),
      _cost(q, num_heads, products=4, arrays=7))(
          q, k, v, tiled_bias(bias.astype(jnp.float32), size), grad.astype(q.dtype))
  dbias = dbias.reshape(-1, groups, num_heads, tokens, tokens).sum(axis=0).astype(bias.dtype)
  return dq, dk, dv, dbias


fused.defvjp(_fused_forward, _fused_backward)


def attention(q, k, v, num_heads: int, bias=None, kernel: Optional[bool] = None):
  """Multi-head attention (see `plain`): the fused kernel on a TPU, the plain form elsewhere; `kernel`
  True or False forces one (True off a TPU runs the kernel by the Pallas interpreter). Shapes the
  kernel does not take (see `fits`), and sequences so long that one alone overflows a grid step's
  budget of the core's memory (a ViT's thousands of tokens), get the plain form everywhere."""
  count, tokens, channels = q.shape
  groups = 1 if bias is None else bias.shape[0]
  if (kernel is False or not fits(count, channels, num_heads, groups)
      or _window_bytes(tokens, channels, num_heads, bias is not None) > BLOCK_BUDGET):
    return plain(q, k, v, bias, num_heads)
  if kernel is None:
    return platforms.tpu_or_plain(lambda q, k, v: fused(q, k, v, bias, num_heads),
                                  lambda q, k, v: plain(q, k, v, bias, num_heads), q, k, v)
  return fused(q, k, v, bias, num_heads, jax.default_backend() != 'tpu')
