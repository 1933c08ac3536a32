"""Remat: the same gradients, and the compiled step really recomputes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxtpu import models

IMAGES = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, 16, 3)), jnp.float32)
LABELS = jnp.arange(8) % 10


def _loss(params, batch_stats, model):
  logits, _ = model.apply({'params': params, 'batch_stats': batch_stats}, IMAGES, train=True,
                          mutable=['batch_stats'])
  return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()


def _grad_fn(name, remat):
  model = models.create(name, num_classes=10, remat=remat)
  variables = models.create(name, num_classes=10).init(jax.random.PRNGKey(0), IMAGES, train=False)
  grad = jax.jit(jax.grad(functools.partial(_loss, model=model)))
  return grad, variables['params'], variables.get('batch_stats', {})


def _convolutions(name, remat):
  grad, params, batch_stats = _grad_fn(name, remat)
  return grad.lower(params, batch_stats).compile().as_text().count('convolution(')


@pytest.mark.parametrize('name', ['cnn', 'resnet20'])
@pytest.mark.parametrize('remat', ['full', 'dots_saveable', 'nothing_saveable',
                                   'dots_with_no_batch_dims_saveable'])
def test_remat_gives_the_same_gradients(name, remat):
  grad, params, batch_stats = _grad_fn(name, 'none')
  reference = grad(params, batch_stats)
  grad, _, _ = _grad_fn(name, remat)
  for x, y in zip(jax.tree.leaves(reference), jax.tree.leaves(grad(params, batch_stats))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', ['cnn', 'resnet20'])
def test_full_remat_recomputes_convolutions_in_the_compiled_step(name):
  plain, full = _convolutions(name, 'none'), _convolutions(name, 'full')
  # Forward convolutions run again in the backward pass.
  assert full > plain, (plain, full)
  # Saving the dot/convolution outputs means nothing convolutional is recomputed.
  assert _convolutions(name, 'dots_saveable') == plain
