"""Swin's fused window-attention kernel (models/nets/window_attention.py: the qkv projection, attention
and the output projection) against the plain form: the same outputs and gradients (run by the Pallas
interpreter here), chosen on a TPU only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import assert_close, weighted_sum

from flaxtpu.models.nets import attention_kernel, window_attention


def _inputs(count, tokens, channels, heads, groups, dtype=jnp.float32, seed=0):
  """Windows x, the projections (qkv kernel and bias, output kernel and bias) and the bias groups."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, dtype)
  return (normal(count, tokens, channels), normal(channels, 3 * channels, scale=channels**-0.5),
          normal(3 * channels, scale=0.1), normal(channels, channels, scale=channels**-0.5),
          normal(channels, scale=0.1),
          jnp.asarray(rng.normal(size=(groups, heads, tokens, tokens)), jnp.float32))


# (windows, tokens, channels, heads, bias groups): Swin-T's first stage's shifted windows in miniature,
# its second stage's channels (two 128-lane slices, the second half full), a block of several groups
# with 16 tokens (no padding), and 9 tokens in two whole 128-lane slices (a loop over them).
CASES = [(8, 49, 96, 3, 4), (6, 49, 192, 6, 1), (12, 16, 64, 2, 2), (4, 9, 256, 8, 4)]


@pytest.mark.parametrize('count,tokens,channels,heads,groups', CASES)
@pytest.mark.parametrize('blocks', ['large', 'small'])
def test_the_kernel_computes_the_plain_forms_outputs_and_gradients(count, tokens, channels, heads, groups,
                                                                    blocks, monkeypatch):
  if blocks == 'small':  # 1-2 windows a block: a bias group spread over several blocks, as at batch 256
    monkeypatch.setattr(attention_kernel, 'BLOCK_BUDGET', 2**20)
  padded = -(-tokens // 16) * 16
  size = window_attention._windows_per_block(count, groups, padded, channels, heads)  # pylint: disable=protected-access
  assert (size < groups) == (blocks == 'small' and groups > 2)
  args = _inputs(count, tokens, channels, heads, groups)
  plain = lambda *a: window_attention.block(*a, heads, kernel=False)
  fused = lambda *a: window_attention.block(*a, heads, kernel=True)
  assert_close(fused(*args), plain(*args), 1e-6)
  expected = jax.grad(weighted_sum(plain, channels), argnums=tuple(range(6)))(*args)
  got = jax.grad(weighted_sum(fused, channels), argnums=tuple(range(6)))(*args)
  names = ('x', 'qkv kernel', 'qkv bias', 'proj kernel', 'proj bias', 'bias')
  for name, want, have in zip(names, expected, got):
    assert_close(have, want, 1e-5, name)


def test_in_bfloat16_the_kernel_is_as_close_to_float32_as_the_plain_form():
  count, tokens, channels, heads, groups = CASES[0]
  half = _inputs(count, tokens, channels, heads, groups, jnp.bfloat16)
  exact = window_attention.plain_block(*(x.astype(jnp.float32) for x in half), heads)  # the same inputs
  fused = window_attention.block(*half, heads, kernel=True)
  plain = window_attention.block(*half, heads, kernel=False)
  assert fused.dtype == plain.dtype == jnp.bfloat16
  fused_error = float(jnp.abs(fused.astype(jnp.float32) - exact).max())
  plain_error = float(jnp.abs(plain.astype(jnp.float32) - exact).max())
  # The kernel rounds to bfloat16 less often (q, k, v and the output stay float32 until a product).
  assert fused_error < 0.05 and fused_error <= 1.5 * plain_error, (fused_error, plain_error)


def test_a_block_takes_whole_bias_groups_or_a_whole_number_of_blocks_fills_a_group():
  # Swin-T at batch 256, 224 px: its four stages' windows, windows per image and channels (64 tokens: 49
  # padded to whole bfloat16 tiles).
  sizes = [window_attention._windows_per_block(count, groups, 64, channels, heads)  # pylint: disable=protected-access
           for count, groups, channels, heads in [(16384, 64, 96, 3), (4096, 16, 192, 6), (1024, 4, 384, 12),
                                                  (256, 1, 768, 24)]]
  assert sizes == [16, 16, 8, 4]
  assert window_attention._windows_per_block(12, 8, 64, 96, 3) == 4  # pylint: disable=protected-access
  assert window_attention._windows_per_block(7, 1, 64, 96, 3) == 7  # pylint: disable=protected-access


def test_the_kernel_is_lowered_for_a_tpu_and_the_plain_form_for_any_other_machine():
  args = _inputs(8, 49, 96, 3, 4)
  step = jax.jit(jax.grad(weighted_sum(lambda *a: window_attention.block(*a, 3), 96), argnums=(0, 1)))
  for platform, kernels in (('tpu', 2), ('cpu', 0)):  # the forward kernel and the backward one
    text = step.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count('tpu_custom_call') == kernels, platform


def test_heads_that_do_not_divide_the_lanes_take_the_plain_form():
  args = _inputs(2, 9, 96, 2, 1)  # 48 features a head
  text = jax.jit(lambda *a: window_attention.block(*a, 2)).trace(*args).lower(
      lowering_platforms=('tpu',)).as_text()
  assert 'tpu_custom_call' not in text
  assert_close(window_attention.block(*args, 2, kernel=True), window_attention.plain_block(*args, 2), 1e-6)


def test_swin_with_the_kernel_has_the_plain_forms_logits_and_gradients(monkeypatch):
  import optax  # pylint: disable=g-import-not-at-top

  from flaxtpu.models.nets import swin  # pylint: disable=g-import-not-at-top
  # A narrow Swin (32 features a head, as in every published one) at 56 px: stage 1 has 14x14 tokens in
  # 2x2 windows, shifted in its second block (4 masks); stage 2 one 7x7 window; stages 3 and 4 one
  # smaller window each (16 and 4 tokens, their tables resized).
  images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 56, 56, 3)), jnp.float32)
  model = swin.Swin(num_classes=10, stage_sizes=(2, 1, 1, 1), width=32, num_heads=(1, 2, 4, 8))
  params = jax.jit(lambda: model.init(jax.random.PRNGKey(0), images, train=False))()['params']

  def logits_and_grads(kernel):
    monkeypatch.setattr(window_attention, 'block', functools.partial(_block, kernel=kernel))
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({'params': p}, images, train=False), jnp.arange(2)).mean()
    return jax.jit(lambda p: (model.apply({'params': p}, images, train=False), jax.grad(loss)(p)))(params)

  logits, grads = logits_and_grads(False)
  fused_logits, fused_grads = logits_and_grads(True)
  assert_close(fused_logits, logits, 1e-5)
  table = 'relative_position_bias_table'
  assert float(jnp.abs(grads['stage1_block2']['attention'][table]).max()) > 1e-5  # the masked block's
  for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(fused_grads)):
    assert_close(have, want, 1e-4, jax.tree_util.keystr(path))


_block = window_attention.block
