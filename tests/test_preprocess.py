"""Host preprocessing: crops in range, any file decoded upright to RGB, reduced-scale JPEG decoding."""

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from flaxtpu.data import preprocess
from flaxtpu.data.preprocess import Transform


def _draws(seed):
  """One image's crop draws."""
  return preprocess.crop_draws(np.random.default_rng(seed), 1)[0]


def test_random_crop_boxes_stay_inside_and_in_range():
  areas, aspects = [], []
  for draws in preprocess.crop_draws(np.random.default_rng(0), 2000):
    left, top, right, bottom = preprocess.random_crop_box(draws, 300, 200, (0.08, 1.0), (3 / 4, 4 / 3))
    assert 0 <= left < right <= 300 and 0 <= top < bottom <= 200
    areas.append((right - left) * (bottom - top) / (300 * 200))
    aspects.append((right - left) / (bottom - top))
  assert 0.07 <= min(areas) and max(areas) <= 1.0
  assert 0.70 <= min(aspects) and max(aspects) <= 1.42  # rounding to whole pixels
  # Uniform in area over [0.08, 1], less the large crops that do not fit at the drawn aspect.
  assert 0.3 < np.median(areas) < 0.55


def test_crop_falls_back_to_the_centre_when_nothing_fits():
  # A 1000x10 strip cannot hold a 3/4..4/3 crop of 50% of its area: centre crop, aspect clipped.
  box = preprocess.random_crop_box(_draws(0), 1000, 10, (0.5, 1.0), (3 / 4, 4 / 3))
  assert box == (493, 0, 506, 10)


def _png(image):
  buffer = io.BytesIO()
  image.save(buffer, 'PNG')
  return buffer.getvalue()


def test_eval_image_is_the_centre_of_the_resized_shorter_side():
  pixels = np.zeros((40, 80, 3), np.uint8)
  pixels[:, 20:60] = 255  # a white centre square 40x40 on a black 80-wide image
  out = preprocess.eval_image(preprocess.open_image(_png(Image.fromarray(pixels))),
                              Transform(size=16, crop_fraction=1.0))
  assert out.shape == (16, 16, 3) and out[1:-1, 1:-1].min() == 255  # edges blend with the border


@pytest.mark.parametrize('mode', ['L', 'CMYK', 'P', 'RGBA', 'LA', 'I;16'])
def test_every_mode_decodes_to_rgb(mode):
  rgb = Image.new('RGB', (6, 4), (200, 200, 200))
  image = Image.fromarray(np.full((4, 6), 200 * 257, np.uint16)) if mode == 'I;16' else rgb.convert(mode)
  encoded = _png(image) if mode != 'CMYK' else _jpeg(image)
  out = preprocess.to_array(preprocess.decode(preprocess.open_image(encoded), 3), 3)
  assert out.shape == (4, 6, 3)
  assert np.all(np.abs(out.astype(int) - 200) <= 6), out[0, 0]  # CMYK JPEG: Pillow's naive conversion


def test_transparent_pixels_become_white():
  image = Image.new('RGBA', (4, 4), (255, 0, 0, 0))
  out = preprocess.to_array(preprocess.decode(preprocess.open_image(_png(image)), 3), 3)
  assert out[0, 0].tolist() == [255, 255, 255]


def _jpeg(image, **kwargs):
  buffer = io.BytesIO()
  image.save(buffer, 'JPEG', quality=95, **kwargs)
  return buffer.getvalue()


def test_exif_rotated_photo_is_decoded_upright():
  pixels = np.zeros((20, 40, 3), np.uint8)
  pixels[:, :20] = 255  # left half white, as stored
  exif = Image.Exif()
  exif[0x0112] = 6  # "rotate 90 degrees clockwise to view"
  data = _jpeg(Image.fromarray(pixels), exif=exif)
  image = preprocess.open_image(data)
  assert preprocess.upright_size(image) == (20, 40)
  out = preprocess.to_array(preprocess.decode(image, 3), 3)
  assert out.shape == (40, 20, 3)
  assert out[:15].mean() > 200 and out[25:].mean() < 50  # the white half is now on top


def test_reduced_scale_jpeg_decoding_matches_a_full_decode():
  rng = np.random.default_rng(0)
  blocks = np.kron(rng.integers(0, 255, (30, 40, 3)), np.ones((20, 20, 1))).astype(np.uint8)  # 600x800
  data = _jpeg(Image.fromarray(cv2.GaussianBlur(blocks, (0, 0), 8)))  # colour fields, soft edges
  fast = preprocess.eval_image(preprocess.open_image(data), Transform(size=64))
  full = np.asarray(Image.open(io.BytesIO(data)).convert('RGB'))  # no draft: every pixel decoded
  left, top, right, bottom = (round(v) for v in preprocess.centre_crop_box(800, 600, 64, 0.875))
  reference = cv2.resize(full[top:bottom, left:right], (64, 64), interpolation=cv2.INTER_AREA)
  # Decoded at 1/4 scale (libjpeg's scaled IDCT): within a few levels of the full decode.
  assert np.abs(fast.astype(int) - reference.astype(int)).mean() < 6


def _blurred_photo(height=600, width=800, seed=0):
  rng = np.random.default_rng(seed)
  fields = rng.integers(0, 255, (height // 20, width // 20, 3))
  blocks = np.kron(fields, np.ones((20, 20, 1))).astype(np.uint8)
  return cv2.GaussianBlur(blocks, (0, 0), 8)


def _reference_crop(data, box, size):
  """Every pixel decoded by Pillow, the crop cut out and resized as `_cropped` does a training crop:
  averaged when shrunk 2x or more, else bilinear."""
  full = np.asarray(Image.open(io.BytesIO(data)).convert('RGB'))
  left, top, right, bottom = (round(v) for v in box)
  crop = full[top:bottom, left:right]
  averaging = max(crop.shape[:2]) > 2 * size
  return cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA if averaging else cv2.INTER_LINEAR)


@pytest.mark.parametrize('size', [64, 448])  # 448: no DCT scaling for most crops; 64: 1/2 to 1/8
def test_fast_jpeg_crops_match_a_full_decode_then_crop_and_resize(size):
  data = _jpeg(Image.fromarray(_blurred_photo()))
  assert isinstance(preprocess.open_source(data), preprocess.Jpeg)  # libjpeg-turbo through simplejpeg
  transform = Transform(size=size)
  errors = []
  for seed in range(20):
    box = preprocess.random_crop_box(_draws(seed), 800, 600, transform.crop_area,
                                     transform.crop_aspect)
    fast = preprocess.train_image(data, transform, _draws(seed))
    errors.append(np.abs(fast.astype(int) - _reference_crop(data, box, size).astype(int)))
  errors = np.stack(errors)
  if size == 448:  # no DCT scaling: only the fast IDCT of training crops differs (1 level on average)
    worst = np.percentile(errors, 99.9)
    assert errors.mean() < 1.2 and worst <= 4, (errors.mean(), worst)
    for seed in range(5):  # the accurate IDCT (evaluation, images kept in memory): Pillow's pixels
      box = preprocess.random_crop_box(_draws(seed), 800, 600, transform.crop_area,
                                       transform.crop_aspect)
      accurate = preprocess._cropped(preprocess.open_source(data), box, size, 3, area_below=0.5)  # pylint: disable=protected-access
      assert np.abs(accurate.astype(int) - _reference_crop(data, box, size).astype(int)).max() <= 1
  else:  # decoded at a reduced scale (libjpeg's scaled IDCT), the box rounded to its coarser pixels
    # (up to 4 full-size pixels off at 1/8): within a few levels on average (measured: 4.2, p99 19)
    assert errors.mean() < 5 and np.percentile(errors, 99) < 24, (errors.mean(), np.percentile(errors, 99))


def test_fast_and_pillow_paths_give_the_same_crop():
  data = _jpeg(Image.fromarray(_blurred_photo(300, 400)))
  transform = Transform(size=96)
  for seed in range(10):
    fast = preprocess.train_image(data, transform, _draws(seed))
    pillow = preprocess.train_image(preprocess.open_image(data), transform, _draws(seed))
    # A training crop through the fast IDCT (as tf.data decodes): ~1 level off on average, rarely 5.
    errors = np.abs(fast.astype(int) - pillow.astype(int))
    assert errors.max() <= 6 and np.percentile(errors, 99.9) <= 4 and errors.mean() < 1.2, (
        errors.max(), errors.mean())
    fast, pillow = preprocess.eval_image(data, transform), preprocess.eval_image(preprocess.open_image(data),
                                                                                 transform)
    assert np.abs(fast.astype(int) - pillow.astype(int)).max() <= 1


def test_only_plain_jpegs_take_the_fast_path(tmp_path):
  rgb = Image.fromarray(_blurred_photo(40, 60))
  path = tmp_path / 'photo.jpg'
  rgb.save(path, 'JPEG')
  upright, rotated = Image.Exif(), Image.Exif()
  upright[0x0112], rotated[0x0112] = 1, 6
  assert isinstance(preprocess.open_source(str(path)), preprocess.Jpeg)
  assert isinstance(preprocess.open_source(_jpeg(rgb.convert('L'))), preprocess.Jpeg)
  assert isinstance(preprocess.open_source(_jpeg(rgb, exif=upright)), preprocess.Jpeg)
  for other in (_jpeg(rgb, exif=rotated), _jpeg(rgb.convert('CMYK')), _png(rgb)):
    assert isinstance(preprocess.open_source(other), Image.Image)
  with pytest.raises(OSError, match='cannot identify image'):  # Pillow names what is wrong, as before
    preprocess.open_source(b'\xff\xd8\xff broken')


def test_rotated_photo_bytes_are_cropped_upright():
  pixels = np.zeros((20, 40, 3), np.uint8)
  pixels[:, :20] = 255  # left half white, as stored; orientation 6 puts it on top
  exif = Image.Exif()
  exif[0x0112] = 6
  data = _jpeg(Image.fromarray(pixels), exif=exif)
  out = preprocess.eval_image(data, Transform(size=16, crop_fraction=1.0))
  assert out[:6].mean() > 200 and out[10:].mean() < 50


@pytest.mark.parametrize('channels', [1, 3])
def test_crops_are_written_into_the_given_row(channels):
  data = _jpeg(Image.fromarray(_blurred_photo(60, 80)))
  transform = Transform(size=24, channels=channels)
  batch = np.zeros((2, 24, 24, channels), np.uint8)
  returned = preprocess.train_image(data, transform, _draws(0), out=batch[1])
  assert np.shares_memory(returned, batch) and batch[0].max() == 0
  np.testing.assert_array_equal(batch[1], preprocess.train_image(data, transform, _draws(0)))


def test_training_crops_average_only_when_shrunk_2x_or_more_evaluation_always():
  """INTER_AREA's non-integer path cost 0.48 ms a 224 px training crop against bilinear's 0.08: a
  training crop shrunk less than 2x is bilinear, a larger shrink averaged; evaluation averages any."""
  pixels = _blurred_photo(400, 400)
  png = preprocess.open_image(pixels)  # Pillow's path: no DCT scaling, the shrink is all OpenCV's
  transform = Transform(size=100, crop_area=(1.0, 1.0), crop_aspect=(1.0, 1.0))  # the whole image
  for side, method in ((150, cv2.INTER_LINEAR), (250, cv2.INTER_AREA)):  # 1.5x and 2.5x shrinks
    small = cv2.resize(pixels, (side, side), interpolation=cv2.INTER_AREA)
    trained = preprocess.train_image(preprocess.open_image(small), transform, _draws(0))
    np.testing.assert_array_equal(trained, cv2.resize(small, (100, 100), interpolation=method))
  evaluated = preprocess.eval_image(png, Transform(size=100, crop_fraction=1.0))
  np.testing.assert_array_equal(evaluated, cv2.resize(pixels, (100, 100), interpolation=cv2.INTER_AREA))
