import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from flaxtpu.augmentation import augment

IMAGES = jnp.asarray(np.random.default_rng(0).integers(0, 256, (16, 8, 8, 3)), jnp.uint8)


def _config(crop_padding=0, flip=False, cutout=0, **more):
  return ml_collections.ConfigDict(dict(crop_padding=crop_padding, flip=flip, cutout=cutout, **more))


def test_normalize_unit_and_standardize():
  unit = augment.normalize(IMAGES, None, None)
  assert unit.dtype == jnp.float32 and float(unit.min()) >= 0.0 and float(unit.max()) <= 1.0
  np.testing.assert_allclose(unit * 255, np.asarray(IMAGES, np.float32), atol=1e-4)
  mean, std = np.array([0.5, 0.4, 0.3], np.float32), np.array([0.2, 0.25, 0.3], np.float32)
  np.testing.assert_allclose(augment.normalize(IMAGES, mean, std), (unit - mean) / std, rtol=1e-6)


def test_flip_is_a_mirror_or_identity():
  out = augment.augment_batch(jax.random.PRNGKey(0), IMAGES, jnp.arange(16), _config(flip=True))
  assert out.shape == IMAGES.shape and out.dtype == IMAGES.dtype
  flipped = [bool(jnp.array_equal(o, i[:, ::-1])) for o, i in zip(out, IMAGES)]
  kept = [bool(jnp.array_equal(o, i)) for o, i in zip(out, IMAGES)]
  assert all(f or k for f, k in zip(flipped, kept))
  assert 0 < sum(flipped) < 16  # both happen


def test_crop_is_a_shifted_window_of_the_padded_image():
  out = augment.augment_batch(jax.random.PRNGKey(1), IMAGES, jnp.arange(16), _config(crop_padding=2))
  assert out.shape == IMAGES.shape
  for o, i in zip(np.asarray(out), np.asarray(IMAGES)):
    padded = np.pad(i, ((2, 2), (2, 2), (0, 0)))
    windows = [padded[y:y + 8, x:x + 8] for y in range(5) for x in range(5)]
    assert any(np.array_equal(o, w) for w in windows)
  assert not jnp.array_equal(out, IMAGES)


@pytest.mark.parametrize('mode, numpy_mode', [('reflect', 'reflect'), ('edge', 'edge')])
def test_crop_pads_with_mirrored_or_repeated_pixels(mode, numpy_mode):
  config = _config(crop_padding=3, crop_pad_mode=mode)
  out = np.asarray(augment.augment_batch(jax.random.PRNGKey(1), IMAGES, jnp.arange(16), config))
  offsets = []
  for o, i in zip(out, np.asarray(IMAGES)):
    padded = np.pad(i, ((3, 3), (3, 3), (0, 0)), mode=numpy_mode)
    offsets += [(y, x) for y in range(7) for x in range(7) if np.array_equal(o, padded[y:y + 8, x:x + 8])]
  assert len(offsets) >= 16 and len(set(offsets)) > 1  # each a window of the padded image, not all one
  # The same draws as zero padding: only the fill differs.
  zeros = np.asarray(augment.augment_batch(jax.random.PRNGKey(1), IMAGES, jnp.arange(16),
                                           _config(crop_padding=3)))
  centre = (slice(None), slice(3, 5), slice(3, 5))
  np.testing.assert_array_equal(out[centre], zeros[centre])


def test_alternate_flip_leaves_the_flip_to_the_host():
  run = lambda config: augment.augment_batch(jax.random.PRNGKey(0), IMAGES, jnp.arange(16), config)
  no_flip = run(_config(crop_padding=2))
  assert not np.array_equal(run(_config(crop_padding=2, flip=True)), no_flip)  # the device's coin flips some
  np.testing.assert_array_equal(run(_config(crop_padding=2, flip=True, alternate_flip=True)), no_flip)
  np.testing.assert_array_equal(run(_config(flip=True, alternate_flip=True)), IMAGES)


@pytest.mark.parametrize('size', [3, 4])
def test_cutout_zeroes_a_size_by_size_square_away_from_the_border(size):
  image = jnp.ones((16, 16, 3), jnp.uint8)
  for seed in range(20):
    key = jax.random.PRNGKey(seed)
    centre_y, centre_x = (int(v) for v in jax.random.randint(key, (2,), 0, jnp.array([16, 16])))
    zero = np.all(np.asarray(augment.cutout(key, image, size)) == 0, axis=-1)
    rows, cols = np.nonzero(zero)
    top, left = centre_y - size // 2, centre_x - size // 2
    expected_rows = range(max(top, 0), min(top + size, 16))
    expected_cols = range(max(left, 0), min(left + size, 16))
    assert zero.sum() == len(expected_rows) * len(expected_cols)  # clipped only at the border
    assert set(rows) == set(expected_rows) and set(cols) == set(expected_cols)
    if 0 <= top and top + size <= 16 and 0 <= left and left + size <= 16:
      assert zero.sum() == size * size


def test_randomness_depends_on_position_not_on_batch_split():
  config = _config(crop_padding=4, flip=True, cutout=3)
  key = jax.random.PRNGKey(3)
  whole = augment.augment_batch(key, IMAGES, jnp.arange(16), config)
  halves = [augment.augment_batch(key, IMAGES[s], jnp.arange(16)[s], config)
            for s in (slice(0, 8), slice(8, 16))]
  np.testing.assert_array_equal(whole, jnp.concatenate(halves))
  other = augment.augment_batch(jax.random.PRNGKey(4), IMAGES, jnp.arange(16), config)
  assert not jnp.array_equal(whole, other)


def test_no_augmentation_is_identity():
  out = augment.augment_batch(jax.random.PRNGKey(0), IMAGES, jnp.arange(16), _config())
  np.testing.assert_array_equal(out, IMAGES)
