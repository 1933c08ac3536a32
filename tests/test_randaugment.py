import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from flaxtpu.augmentation import randaugment as ra

RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, (16, 16, 3)).astype(np.uint8)
GRAY = RNG.integers(0, 256, (16, 16, 1)).astype(np.uint8)
LOW_CONTRAST = (RGB // 4 + 60).astype(np.uint8)  # 60..123: room for every enhance factor


def _op(image, op, level):
  return np.asarray(ra.apply_op(jnp.asarray(image), op, level))


def _pil(image):
  return Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image)


def _np(pil_image, channels):
  out = np.asarray(pil_image)
  return out[..., None] if channels == 1 else out


@pytest.mark.parametrize('op', ['Identity', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate',
                                'Brightness', 'Color', 'Contrast', 'Sharpness', 'Posterize'])
@pytest.mark.parametrize('image', [RGB, GRAY], ids=['rgb', 'gray'])
def test_zero_strength_is_identity(op, image):
  np.testing.assert_array_equal(_op(image, op, 0.0), image)


def test_posterize_keeps_the_top_bits():
  np.testing.assert_array_equal(_op(RGB, 'Posterize', 4), RGB & 0xF0)  # 8 -> 4 bits
  np.testing.assert_array_equal(_op(RGB, 'Posterize', 6), RGB & 0xC0)  # 8 -> 2 bits
  np.testing.assert_array_equal(_op(RGB, 'Posterize', 4), np.asarray(ImageOps.posterize(_pil(RGB), 4)))


@pytest.mark.parametrize('threshold', [0, 1, 100, 128, 254, 255])
def test_solarize_inverts_pixels_at_or_above_the_threshold(threshold):
  expected = np.where(RGB >= threshold, 255 - RGB, RGB)
  np.testing.assert_array_equal(_op(RGB, 'Solarize', 255 - threshold), expected)
  np.testing.assert_array_equal(expected, np.asarray(ImageOps.solarize(_pil(RGB), threshold)))


def test_equalize_hand_computed():
  # 32x32: 512 pixels of 10, 256 of 50, 256 of 200. step = (1024 - 256) // 255 = 3,
  # lut[v] = (pixels below v + step // 2) // step: 10 -> 1 // 3 = 0, 50 -> 513 // 3 = 171,
  # 200 -> 769 // 3 = 256, clipped to 255.
  image = np.full((32, 32, 1), 10, np.uint8)
  image[16:, :16], image[16:, 16:] = 50, 200
  expected = np.full_like(image, 0)
  expected[16:, :16], expected[16:, 16:] = 171, 255
  np.testing.assert_array_equal(_op(image, 'Equalize', 0), expected)
  # Too few pixels for a step of 1 (16 - 4 < 255): unchanged, as in PIL.
  small = np.array([10] * 8 + [50] * 4 + [200] * 4, np.uint8).reshape(4, 4, 1)
  np.testing.assert_array_equal(_op(small, 'Equalize', 0), small)


@pytest.mark.parametrize('image', [RGB, GRAY, LOW_CONTRAST], ids=['rgb', 'gray', 'low'])
def test_equalize_matches_pil(image):
  big = np.tile(image, (2, 2, 1))  # 32x32: enough pixels for a non-zero step
  np.testing.assert_array_equal(_op(big, 'Equalize', 0), _np(ImageOps.equalize(_pil(big)), big.shape[-1]))


def test_autocontrast_stretches_each_channel():
  image = LOW_CONTRAST.copy()
  image[..., 2] = 77  # a flat channel is left alone
  out = _op(image, 'AutoContrast', 0)
  for c in range(2):
    low, high = int(image[..., c].min()), int(image[..., c].max())
    assert out[..., c].min() == 0 and out[..., c].max() == 255
    np.testing.assert_array_equal(out[..., c], (image[..., c].astype(int) - low) * 255 // (high - low))
  np.testing.assert_array_equal(out[..., 2], 77)
  # PIL computes the same stretch in float64 and sometimes lands one below.
  pil = np.asarray(ImageOps.autocontrast(_pil(image))).astype(int)
  assert np.abs(pil - out).max() <= 1


@pytest.mark.parametrize('shift', [3, -2, 3.7, -3.7])
def test_translate_shifts_and_fills_gray(shift):
  k = int(shift)  # truncated toward zero, as torchvision's int()
  out_x, out_y = _op(RGB, 'TranslateX', shift), _op(RGB, 'TranslateY', shift)
  expected_x = np.full_like(RGB, ra.FILL)
  expected_y = np.full_like(RGB, ra.FILL)
  if k > 0:
    expected_x[:, k:], expected_y[k:] = RGB[:, :-k], RGB[:-k]
  else:
    expected_x[:, :k], expected_y[:k] = RGB[:, -k:], RGB[-k:]
  np.testing.assert_array_equal(out_x, expected_x)
  np.testing.assert_array_equal(out_y, expected_y)


@pytest.mark.parametrize('size', [8, 7])
def test_rotate_by_right_angles_is_rot90_counter_clockwise(size):
  image = RGB[:size, :size]
  np.testing.assert_array_equal(_op(image, 'Rotate', 90), np.rot90(image, 1))
  np.testing.assert_array_equal(_op(image, 'Rotate', -90), np.rot90(image, -1))
  np.testing.assert_array_equal(_op(image, 'Rotate', 180), np.rot90(image, 2))


@pytest.mark.parametrize('degrees', [30, -45, 17.3])
def test_rotate_matches_pil(degrees):
  # Angles whose sample points have no exact half-pixel ties (PIL rounds ties up, we to even).
  expected = _pil(RGB).rotate(degrees, resample=Image.NEAREST, fillcolor=(ra.FILL,) * 3)
  np.testing.assert_array_equal(_op(RGB, 'Rotate', degrees), np.asarray(expected))


@pytest.mark.parametrize('m', [0.3, -0.3, 0.99, -0.99])
def test_shear_matches_pil_affine_about_the_top_left_corner(m):
  # The official AutoAugment / timm shear: PIL affine (1, m, 0, 0, 1, 0), i.e. source x = x + m y.
  pil, fill = _pil(RGB), (ra.FILL,) * 3
  expected_x = pil.transform(pil.size, Image.AFFINE, (1, m, 0, 0, 1, 0), Image.NEAREST, fillcolor=fill)
  expected_y = pil.transform(pil.size, Image.AFFINE, (1, 0, 0, m, 1, 0), Image.NEAREST, fillcolor=fill)
  np.testing.assert_array_equal(_op(RGB, 'ShearX', m), np.asarray(expected_x))
  np.testing.assert_array_equal(_op(RGB, 'ShearY', m), np.asarray(expected_y))


@pytest.mark.parametrize('op, enhancer', [('Brightness', ImageEnhance.Brightness),
                                          ('Color', ImageEnhance.Color),
                                          ('Contrast', ImageEnhance.Contrast),
                                          ('Sharpness', ImageEnhance.Sharpness)])
@pytest.mark.parametrize('image', [RGB, LOW_CONTRAST, GRAY], ids=['rgb', 'low', 'gray'])
def test_enhance_matches_pil_within_rounding(op, enhancer, image):
  for factor in (0.1, 0.5, 1.4, 1.9):
    expected = _np(enhancer(_pil(image)).enhance(factor), image.shape[-1]).astype(int)
    out = _op(image, op, factor - 1.0).astype(int)
    assert np.abs(out - expected).max() <= 1, (op, factor)
  if image.shape[-1] == 1 and op == 'Color':
    np.testing.assert_array_equal(_op(image, op, 0.9), image)


def test_ranges_follow_torchvision():
  rand = ra._max_levels('randaugment', 331, 662)
  assert rand['TranslateX'] == pytest.approx(300) and rand['TranslateY'] == pytest.approx(150)
  assert (rand['ShearX'], rand['Rotate'], rand['Sharpness'], rand['Posterize'], rand['Solarize']) == (
      0.3, 30.0, 0.9, 4.0, 255.0)
  wide = ra._max_levels('trivialaugment', 16, 16)
  assert (wide['ShearY'], wide['TranslateX'], wide['Rotate'], wide['Color'], wide['Posterize']) == (
      0.99, 32.0, 135.0, 0.99, 6.0)


def _apply(key, image, policy='randaugment', num_layers=2, magnitude=10.0):
  return ra.apply(key, image, policy=policy, num_layers=num_layers, magnitude=magnitude)


_jit_apply = jax.jit(_apply, static_argnames=('policy', 'num_layers'))


@pytest.mark.parametrize('policy, image', [('randaugment', RGB[:, :12]), ('trivialaugment', GRAY[:12])])
def test_apply_is_deterministic_per_key_and_keeps_shape(policy, image):
  image = jnp.asarray(image)
  outs = [_jit_apply(jax.random.PRNGKey(i), image, policy) for i in range(8)]
  again = _jit_apply(jax.random.PRNGKey(0), image, policy)
  assert all(o.shape == image.shape and o.dtype == jnp.uint8 for o in outs)
  np.testing.assert_array_equal(outs[0], again)
  assert len({np.asarray(o).tobytes() for o in outs}) >= 4  # keys pick different ops


def test_zero_layers_is_identity_and_bad_arguments_fail():
  image = jnp.asarray(RGB)
  np.testing.assert_array_equal(_apply(jax.random.PRNGKey(0), image, num_layers=0), image)
  with pytest.raises(ValueError, match='policy'):
    _apply(jax.random.PRNGKey(0), image, policy='augmix')
  with pytest.raises(ValueError, match='uint8'):
    _apply(jax.random.PRNGKey(0), image.astype(jnp.float32))
  with pytest.raises(ValueError, match='magnitude'):
    _apply(jax.random.PRNGKey(0), image, magnitude=31)


def test_magnitude_sets_strength():
  images = jnp.asarray(np.tile(LOW_CONTRAST[None], (32, 1, 1, 1)))
  keys = jax.random.split(jax.random.PRNGKey(3), 32)

  @jax.jit
  def change(magnitude):
    out = jax.vmap(lambda k, x: _apply(k, x, num_layers=1, magnitude=magnitude))(keys, images)
    return jnp.abs(out.astype(jnp.float32) - images).mean()

  weak, strong = change(2.0), change(30.0)
  assert strong > 2 * weak > 0


@pytest.mark.parametrize('policy', ra.POLICIES)
def test_jit_vmap_rows_match_single_image_calls(policy):
  images = jnp.asarray(np.stack([RGB, LOW_CONTRAST, RGB[::-1], LOW_CONTRAST[:, ::-1]]))
  step_key = jax.random.PRNGKey(7)
  keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(jnp.arange(4))
  batched = jax.jit(jax.vmap(lambda k, x: _apply(k, x, policy)))(keys, images)
  assert batched.shape == images.shape and batched.dtype == jnp.uint8
  for key, image, row in zip(keys, images, batched):
    np.testing.assert_array_equal(row, _apply(key, image, policy))
  assert not jnp.array_equal(batched, images)


@pytest.mark.parametrize('op', ra.OPS)
def test_ops_give_the_same_bits_eagerly_and_under_jit_vmap(op):
  # Float blends truncated to uint8 differ by one between compilations (an FMA under jit);
  # the ops compute exactly, so any compiled form agrees with eager execution.
  full = ra._max_levels('trivialaugment', 16, 16)[op]
  levels = np.linspace(-full, full, 7, dtype=np.float32) * (1 if op in ra._SIGNED else 0.5) + (
      0 if op in ra._SIGNED else full / 2)
  batched = jax.jit(jax.vmap(lambda level: ra.apply_op(jnp.asarray(LOW_CONTRAST), op, level)))(levels)
  for level, row in zip(levels, batched):
    np.testing.assert_array_equal(row, _op(LOW_CONTRAST, op, level), err_msg=f'{op} {level}')
