"""Swin's fused window attention kernel (models/nets/window_attention.py) against the plain form: the same
outputs and gradients (run by the Pallas interpreter here), chosen on a TPU only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxtpu.models.nets import window_attention


def _inputs(count, tokens, channels, heads, groups, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(count, tokens, channels)), dtype) for _ in range(3))
  bias = jnp.asarray(rng.normal(size=(groups, heads, tokens, tokens)), jnp.float32)
  return q, k, v, bias


def _weighted_sum(attend, channels):
  """A loss whose gradient differs per output channel (so that a head's lanes cannot be mixed up)."""
  return lambda *args: (attend(*args).astype(jnp.float32) * jnp.cos(jnp.arange(channels))).sum()


# (windows, tokens, channels, heads, bias groups): Swin-T's first stage's shifted windows in miniature
# (more groups than a block's windows), its second stage's channels (two 128-lane slices, the second
# half full), a block of several groups, and no mask.
CASES = [(8, 49, 96, 3, 4), (6, 49, 192, 6, 1), (12, 16, 64, 2, 2), (4, 9, 256, 8, 4)]


@pytest.mark.parametrize('count,tokens,channels,heads,groups', CASES)
@pytest.mark.parametrize('blocks', ['large', 'small'])
def test_the_kernel_computes_the_plain_forms_outputs_and_gradients(count, tokens, channels, heads, groups,
                                                                    blocks, monkeypatch):
  if blocks == 'small':  # 1-2 windows a block: a bias group spread over several blocks, as at batch 256
    monkeypatch.setattr(window_attention, '_BLOCK_BUDGET', 2**20)
  size = window_attention._windows_per_block(count, groups, tokens, channels, heads)  # pylint: disable=protected-access
  assert (size < groups) == (blocks == 'small' and groups > 2)
  args = _inputs(count, tokens, channels, heads, groups)
  plain = lambda *a: window_attention.plain(*a, heads)
  fused = lambda *a: window_attention.attention(*a, heads, kernel=True)
  np.testing.assert_allclose(fused(*args), plain(*args), atol=2e-6)
  expected = jax.grad(_weighted_sum(plain, channels), argnums=(0, 1, 2, 3))(*args)
  got = jax.grad(_weighted_sum(fused, channels), argnums=(0, 1, 2, 3))(*args)
  for name, want, have in zip(('q', 'k', 'v', 'bias'), expected, got):
    assert have.shape == want.shape and have.dtype == want.dtype, name
    np.testing.assert_allclose(have, want, atol=2e-5, rtol=1e-5, err_msg=name)


def test_in_bfloat16_the_kernel_is_as_close_to_float32_as_the_plain_form():
  count, tokens, channels, heads, groups = CASES[0]
  half = _inputs(count, tokens, channels, heads, groups, jnp.bfloat16)
  exact = window_attention.plain(*(x.astype(jnp.float32) for x in half), heads)  # the same rounded inputs
  fused = window_attention.attention(*half, heads, kernel=True)
  plain = window_attention.plain(*half, heads)
  assert fused.dtype == jnp.bfloat16
  fused_error = float(jnp.abs(fused.astype(jnp.float32) - exact).max())
  plain_error = float(jnp.abs(plain.astype(jnp.float32) - exact).max())
  assert fused_error < 0.02 and fused_error <= 1.5 * plain_error, (fused_error, plain_error)


def test_a_block_takes_whole_bias_groups_or_a_whole_number_of_blocks_fills_a_group():
  # Swin-T at batch 256, 224 px: its four stages' windows, windows per image and channels.
  sizes = [window_attention._windows_per_block(count, groups, 49, channels, heads)  # pylint: disable=protected-access
           for count, groups, channels, heads in [(16384, 64, 96, 3), (4096, 16, 192, 6), (1024, 4, 384, 12),
                                                  (256, 1, 768, 24)]]
  assert sizes == [32, 16, 16, 8]
  assert window_attention._windows_per_block(12, 8, 49, 96, 3) == 4  # pylint: disable=protected-access
  assert window_attention._windows_per_block(7, 1, 49, 96, 3) == 7  # pylint: disable=protected-access


def test_the_kernel_is_lowered_for_a_tpu_and_the_plain_form_for_any_other_machine():
  args = _inputs(8, 49, 96, 3, 4)
  step = jax.jit(jax.grad(_weighted_sum(lambda *a: window_attention.attention(*a, 3), 96), argnums=(0, 3)))
  for platform, kernels in (('tpu', 2), ('cpu', 0)):  # the forward kernel and the backward one
    text = step.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count('tpu_custom_call') == kernels, platform


def test_heads_that_do_not_divide_the_lanes_take_the_plain_form():
  args = _inputs(2, 9, 96, 2, 1)  # 48 features a head
  text = jax.jit(lambda *a: window_attention.attention(*a, 2)).trace(*args).lower(
      lowering_platforms=('tpu',)).as_text()
  assert 'tpu_custom_call' not in text
  np.testing.assert_allclose(window_attention.attention(*args, 2, kernel=True),
                             window_attention.plain(*args, 2), atol=1e-6)


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
    monkeypatch.setattr(window_attention, 'attention', functools.partial(_attention, kernel=kernel))
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({'params': p}, images, train=False), jnp.arange(2)).mean()
    return jax.jit(lambda p: (model.apply({'params': p}, images, train=False), jax.grad(loss)(p)))(params)

  logits, grads = logits_and_grads(False)
  fused_logits, fused_grads = logits_and_grads(True)
  np.testing.assert_allclose(fused_logits, logits, atol=1e-5)
  table = 'relative_position_bias_table'
  assert float(jnp.abs(grads['stage1_block2']['attention'][table]).max()) > 1e-5  # the masked block's
  for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(fused_grads)):
    scale = float(jnp.abs(want).max())  # each leaf to its own size: the bias tables' are ~1e-5
    assert float(jnp.abs(have - want).max()) <= 1e-4 * scale, (jax.tree_util.keystr(path), scale)


_attention = window_attention.attention
