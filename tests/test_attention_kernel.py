"""The multi-head attention kernel (models/nets/attention_kernel.py) against the plain form: the same
outputs and gradients, with and without a bias (run by the Pallas interpreter here), chosen on a TPU only;
and ViT, whose attention it computes, unchanged by it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import assert_close, weighted_sum

from flaxtpu.models.nets import attention_kernel


def _inputs(count, tokens, channels, heads, groups, dtype=jnp.float32, seed=0):
  """q (scaled), k, v [count, tokens, channels], and a bias [groups, heads, tokens, tokens] (or None)."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(count, tokens, channels)), dtype) for _ in range(3))
  bias = None if groups is None else jnp.asarray(rng.normal(size=(groups, heads, tokens, tokens)),
                                                 jnp.float32)
  return q * (channels // heads) ** -0.5, k, v, bias


# (count, tokens, channels, heads, bias groups or None): ViT-B/16's 197 tokens with 64-feature heads
# (two a 128-lane slice) and no bias, in miniature; Swin's 49-token windows with 32-feature heads and
# four bias groups (its shifted windows' masks); three heads in 96 lanes (one partial slice); heads of 128.
CASES = [(4, 197, 128, 2, None), (8, 49, 96, 3, 4), (6, 16, 256, 4, 1), (2, 9, 256, 2, None)]


@pytest.mark.parametrize('count,tokens,channels,heads,groups', CASES)
@pytest.mark.parametrize('blocks', ['large', 'small'])
def test_the_kernel_computes_the_plain_forms_outputs_and_gradients(count, tokens, channels, heads, groups,
                                                                    blocks, monkeypatch):
  if blocks == 'small':  # a window or two a block: a bias group spread over several blocks
    monkeypatch.setattr(attention_kernel, 'BLOCK_BUDGET', 2**20)
  q, k, v, bias = _inputs(count, tokens, channels, heads, groups)
  attend = lambda kernel: lambda q, k, v, bias: attention_kernel.attention(q, k, v, heads, bias, kernel)
  assert_close(attend(True)(q, k, v, bias), attention_kernel.plain(q, k, v, bias, heads), 2e-6)
  arguments = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  expected = jax.grad(weighted_sum(attend(False), channels), argnums=arguments)(q, k, v, bias)
  got = jax.grad(weighted_sum(attend(True), channels), argnums=arguments)(q, k, v, bias)
  for name, want, have in zip(('q', 'k', 'v', 'bias'), expected, got):
    assert_close(have, want, 2e-5, name)


def test_in_bfloat16_the_kernel_is_as_close_to_float32_as_the_plain_form():
  q, k, v, _ = _inputs(4, 197, 256, 4, None, jnp.bfloat16)
  exact = attention_kernel.plain(*(x.astype(jnp.float32) for x in (q, k, v)), None, 4)
  fused = attention_kernel.attention(q, k, v, 4, kernel=True)
  plain = attention_kernel.attention(q, k, v, 4, kernel=False)
  assert fused.dtype == plain.dtype == jnp.bfloat16
  fused_error = float(jnp.abs(fused.astype(jnp.float32) - exact).max())
  plain_error = float(jnp.abs(plain.astype(jnp.float32) - exact).max())
  assert fused_error <= plain_error * 1.01 + 1e-6, (fused_error, plain_error)


def test_the_kernel_is_lowered_for_a_tpu_and_the_plain_form_elsewhere_and_for_a_symbolic_batch():
  q, k, v, _ = _inputs(4, 197, 128, 2, None)
  attend = lambda *a: attention_kernel.attention(*a, 2)
  step = jax.jit(jax.grad(weighted_sum(attend, 128), argnums=(0, 1, 2)))
  for platform, kernels in (('tpu', 2), ('cpu', 0)):  # the forward kernel and the backward one
    assert step.trace(q, k, v).lower(lowering_platforms=(platform,)).as_text().count('tpu_custom_call') \
        == kernels, platform
  batch, = jax.export.symbolic_shape('b')
  symbolic = jax.ShapeDtypeStruct((batch, 197, 128), jnp.float32)
  exported = jax.export.export(jax.jit(attend), platforms=('tpu',))(
      symbolic, symbolic, symbolic)
  assert 'tpu_custom_call' not in exported.mlir_module()


def test_alike_calls_share_one_kernel_each_way():
  # Three layers of one shape, as a ViT's blocks: each kernel is traced and lowered once (the module
  # calls it three times), not once a layer, which cut tracing Swin-T's step in half.
  x, k, v, _ = _inputs(4, 197, 128, 2, None)

  def three_layers(x, k, v):
    for _ in range(3):
      x = attention_kernel.attention(x, k, v, 2)
    return x
  step = jax.jit(jax.grad(weighted_sum(three_layers, 128), argnums=(0, 1, 2)))
  text = step.trace(x, k, v).lower(lowering_platforms=('tpu',)).as_text()
  assert text.count('func.call @_fused_forward') == 3 and text.count('func.call @_fused_backward') == 3
  # One backward kernel; one forward kernel for the first two layers and one for the last, whose unused
  # residual JAX drops (without the sharing: six kernels and no calls).
  assert text.count('tpu_custom_call') == 3


@pytest.mark.parametrize('tokens,channels,heads,kernels', [
    (9, 96, 2, 0),  # 48 features a head: not a divisor of 128 lanes
    (577, 768, 12, 2),  # ViT-B/16 at 384 px: one image a grid step
    (1025, 768, 12, 0),  # at 512 px one image alone overflows the step's budget of the core's memory
])
def test_heads_that_do_not_divide_the_lanes_and_overlong_sequences_take_the_plain_form(tokens, channels,
                                                                                        heads, kernels):
  q = jax.ShapeDtypeStruct((2, tokens, channels), jnp.bfloat16)
  attend = lambda *a: attention_kernel.attention(*a, heads)
  step = jax.jit(jax.grad(weighted_sum(attend, channels), argnums=(0, 1, 2)))
  text = step.trace(q, q, q).lower(lowering_platforms=('tpu',)).as_text()
  assert text.count('tpu_custom_call') == kernels


def test_vit_with_the_kernel_has_flax_attentions_logits_and_gradients(monkeypatch):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from flaxtpu.models.nets import vit  # pylint: disable=g-import-not-at-top
  # A narrow ViT (64 features a head, as ViT-B's) with a class token: 17 tokens at 32 px.
  images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32, 32, 3)), jnp.float32)
  model = vit.ViT(num_classes=10, patch_size=8, width=128, depth=2, mlp_dim=256, num_heads=2, pool='tok')
  params = jax.jit(lambda: model.init(jax.random.PRNGKey(0), images, train=False))()['params']
  # Nothing zero (the head is zero-initialised), so that every gradient is compared.
  params = jax.tree.map(lambda x: x + 0.02 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), params)

  def logits_and_grads(attention_fn):
    monkeypatch.setattr(vit, 'fused_attention', attention_fn)
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({'params': p}, images, train=False), jnp.arange(2)).mean()
    return jax.jit(lambda p: (model.apply({'params': p}, images, train=False), jax.grad(loss)(p)))(params)

  own = vit.fused_attention
  logits, grads = logits_and_grads(nn.dot_product_attention)  # flax's own, as before the kernel
  forced = functools.partial(attention_kernel.attention, kernel=True)  # by the interpreter here
  monkeypatch.setattr(attention_kernel, 'attention', forced)
  fused_logits, fused_grads = logits_and_grads(own)
  assert_close(fused_logits, logits, 1e-5)
  # The keys' bias has no gradient (a softmax does not change when a row's logits shift alike): its
  # rounding noise (1e-8) is held to the floor.
  for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(fused_grads)):
    assert_close(have, want, 1e-4, jax.tree_util.keystr(path), floor=1e-4)
