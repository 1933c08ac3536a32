"""benchmarks/peers/keras_cifar_resnet.py: its host augmentation, schedule and optimizer are flaxtpu's."""

import numpy as np
import pytest

k = pytest.importorskip('benchmarks.peers.keras_cifar_resnet')  # sets KERAS_BACKEND=jax, then imports keras
optax = pytest.importorskip('optax')
if k.keras.backend.backend() != 'jax':
  pytest.skip('keras was imported with another backend', allow_module_level=True)


def test_augment_is_a_padded_crop_and_flip():
  images = np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3)).astype(np.uint8)
  out = k.augment(np.random.default_rng(1), images)
  rng = np.random.default_rng(1)  # the same draws, in the same order
  top, left = rng.integers(0, 9, (2, 6))
  flip = rng.random(6) < 0.5
  padded = np.pad(images, ((0, 0), (4, 4), (4, 4), (0, 0)))
  for i in range(6):
    want = padded[i, top[i]:top[i] + 32, left[i]:left[i] + 32]
    np.testing.assert_array_equal(out[i], want[:, ::-1] if flip[i] else want)


def test_schedule_is_optax_warmup_cosine():
  ours, theirs = k.WarmupCosine(0.1, 390, 3900), optax.warmup_cosine_decay_schedule(0.0, 0.1, 390, 3900, 0.0)
  for step in (0, 1, 389, 390, 391, 2000, 3899, 3900):
    assert float(ours(step)) == pytest.approx(float(theirs(step)), abs=1e-7)


def test_optimizer_is_optax_nesterov_sgd():
  schedule = k.WarmupCosine(0.1, 2, 6)
  weights = k.keras.Variable(np.ones(4, np.float32))
  optimizer = k.OptaxNesterov(schedule, momentum=0.9, nesterov=True)
  tx = optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 6, 0.0), 0.9, nesterov=True)
  params = np.ones(4, np.float32)
  state = tx.init(params)
  for step in range(5):
    gradient = np.arange(4, dtype=np.float32) + step
    optimizer.apply_gradients([(gradient, weights)])
    updates, state = tx.update(gradient, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(np.asarray(weights.value), np.asarray(params), rtol=1e-6)
