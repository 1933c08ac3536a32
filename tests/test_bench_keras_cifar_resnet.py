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


def test_a_saved_run_resumes_with_its_weights_optimizer_and_schedule(tmp_path):
  """--state: the model saved with its optimizer loads back and trains on exactly as the one that kept
  running (the same next epoch's loss and weights)."""
  rng = np.random.default_rng(0)
  images, labels = rng.integers(0, 256, (64, 32, 32, 3)).astype(np.uint8), np.eye(10)[rng.integers(0, 10, 64)]
  k.keras.utils.set_random_seed(0)
  model = k.resnet(8, np.full(3, 0.5, np.float32), np.full(3, 0.25, np.float32))
  model.compile(optimizer=k.OptaxNesterov(k.WarmupCosine(0.1, 2, 8), momentum=0.9, nesterov=True),
                loss=k.keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
                jit_compile=True)
  model.fit(images, labels, batch_size=16, epochs=1, shuffle=False, verbose=0)
  k.save_state(tmp_path, model, {'history': [[1, 1.0, 0.5]]})
  loaded, state = k.load_state(tmp_path)
  assert state == {'history': [[1, 1.0, 0.5]]} and sorted(p.name for p in tmp_path.iterdir()) == [
      'model.keras', 'state.json']
  assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 4
  going_on = model.fit(images, labels, batch_size=16, epochs=1, shuffle=False, verbose=0).history['loss']
  resumed = loaded.fit(images, labels, batch_size=16, epochs=1, shuffle=False, verbose=0).history['loss']
  assert resumed == going_on
  for a, b in zip(model.get_weights(), loaded.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert k.load_state(tmp_path / 'none') is None
