"""What the attention kernels' tests (test_attention_kernel.py, test_window_attention.py) compare with."""

import jax.numpy as jnp


def weighted_sum(attend, channels):
  """A loss whose gradient differs per output channel (so that a head's lanes cannot be mixed up)."""
  return lambda *args: (attend(*args).astype(jnp.float32) * jnp.cos(jnp.arange(channels))).sum()


def assert_close(have, want, tolerance, name='', floor=0.0):
  """Within `tolerance` of want's largest magnitude (parameters' gradients differ in size by 1e4), or
  of `floor` where want is all but zero."""
  assert have.shape == want.shape and have.dtype == want.dtype, name
  scale = max(float(jnp.abs(want).max()), floor)
  assert float(jnp.abs(have - want).max()) <= tolerance * scale, (name, scale)
