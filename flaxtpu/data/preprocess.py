"""Host-side image preprocessing: decode any image file, random-resized crop, resize + centre crop.

Runs in the input workers (numpy, Pillow, OpenCV and simplejpeg, no JAX).
Every random choice comes from `crop_draws`, which the caller draws for a
batch from a generator seeded with (seed, step), so a batch is the same
whichever worker builds it and however often it is rebuilt.

Two decoders, one result: a plain JPEG (no EXIF rotation, YCbCr, RGB or
grayscale) is decoded by libjpeg-turbo through simplejpeg, straight from its
bytes at the reduced DCT scale the crop allows; every other file (PNG, CMYK,
rotated photos, files libjpeg-turbo refuses) goes through Pillow. Both
libraries wrap libjpeg-turbo with the same defaults (accurate integer IDCT,
fancy upsampling), so a JPEG's pixels do not depend on the path taken; the
fast one costs less than half of Pillow's per image (no Python header
parsing, no copy out of a Pillow image; measured in docs/performance.md).
One exception: a training crop is decoded with libjpeg-turbo's fast integer
IDCT, as tf.data's `decode_jpeg`/`decode_and_crop_jpeg` decode by default
(3.6% less time per training image here; pixels within 4 levels, 1 on
average, of the accurate IDCT's). Evaluation and the images kept in memory use
the accurate one.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from typing import Optional, Union

import cv2
import numpy as np
import simplejpeg
from PIL import Image, ImageOps

# JPEG, PNG, GIF, BMP, WebP, TIFF: what Pillow decodes without plugins. Other files
# (.DS_Store, Thumbs.db, notes) in a class folder are ignored.
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.gif', '.bmp', '.webp', '.tif', '.tiff')


@dataclasses.dataclass(frozen=True)
class Transform:
  """How a decoded image becomes the model's input.

  `size` 0 keeps the native size (every image must share it). Otherwise
  training takes an Inception-style random crop (a fraction of the area in
  `crop_area`, an aspect ratio in `crop_aspect`, log-uniform) resized to
  `size` x `size`; evaluation resizes the shorter side to
  `size / crop_fraction` and takes the centre `size` x `size`.
  """
  size: int = 0
  channels: int = 3
  crop_area: tuple[float, float] = (0.08, 1.0)
  crop_aspect: tuple[float, float] = (3 / 4, 4 / 3)
  crop_fraction: float = 0.875


def open_image(item: str | bytes | np.ndarray) -> Image.Image:
  """A file path, encoded bytes or a decoded uint8 [H, W, C] array as a Pillow image.

  Files are opened lazily (only the header is read), so `decode` can still
  choose a reduced JPEG scale.
  """
  if isinstance(item, np.ndarray):
    return Image.fromarray(item[:, :, 0] if item.shape[-1] == 1 else item)
  return Image.open(io.BytesIO(item) if isinstance(item, bytes) else item)


@dataclasses.dataclass(frozen=True)
class Jpeg:
  """A JPEG that libjpeg-turbo decodes upright to RGB or gray as it is stored: its bytes and size."""
  data: bytes
  width: int
  height: int


Source = Union[Jpeg, Image.Image]
_FAST_COLOURSPACES = ('YCbCr', 'RGB', 'Gray')  # not CMYK/YCCK: libjpeg-turbo cannot make RGB of those


def open_source(item: str | bytes | np.ndarray | Image.Image) -> Source:
  """What `train_image`/`eval_image` crop from: a `Jpeg` when the fast decoder can take the file,
  else the Pillow image (`open_image`). Reads a file once, whichever path it then takes."""
  if isinstance(item, Image.Image):
    return item
  if isinstance(item, (str, os.PathLike)):
    item = read_file(item)
  if isinstance(item, bytes) and item[:3] == b'\xff\xd8\xff':
    try:
      height, width, colourspace, _ = simplejpeg.decode_jpeg_header(item)
    except ValueError:  # a header libjpeg-turbo refuses: Pillow decides and names what is wrong
      return open_image(item)
    if colourspace in _FAST_COLOURSPACES and (not _has_exif(item) or _orientation(open_image(item)) == 1):
      return Jpeg(item, width, height)
  return open_image(item)


# A photo (~110 KiB in ImageNet) in one read, below malloc's mmap threshold (128 KiB by default): a
# larger buffer is mapped afresh for each file, and each of its pages costs a fault.
READ_PIECE = 120 << 10


def read_file(path: str | os.PathLike) -> bytes:
  """A file's bytes in four system calls (open, read, the empty read at its end, close).

  `open(path, 'rb').read()` makes about eight (fstat twice, ioctl, lseek), which is what a small
  image costs where system calls are slow: on a gVisor sandbox (Cloud TPU hosts) reading a CIFAR
  JPEG took 250 us, decoding it 30 us.
  """
  fd = os.open(path, os.O_RDONLY | getattr(os, 'O_CLOEXEC', 0))
  try:
    pieces = []
    while piece := os.read(fd, READ_PIECE):
      pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b''.join(pieces)
  finally:
    os.close(fd)


def _has_exif(data: bytes) -> bool:
  """Whether an APP1 Exif block (which may rotate the photo) precedes the image data.

  Walks the APPn/COM segments after SOI (a few per file); only a photo with EXIF needs its
  orientation read (by Pillow, which then also decodes it if it is rotated).
  """
  position = 2
  while position + 10 <= len(data) and data[position] == 0xFF:
    marker = data[position + 1]
    if not (0xE0 <= marker <= 0xEF or marker == 0xFE):
      return False
    if marker == 0xE1 and data[position + 4:position + 10] == b'Exif\0\0':
      return True
    position += 2 + int.from_bytes(data[position + 2:position + 4], 'big')
  return False


def source_size(source: Source) -> tuple[int, int]:
  """(width, height) of a `Jpeg` or, upright, of a Pillow image."""
  return (source.width, source.height) if isinstance(source, Jpeg) else upright_size(source)


def upright_size(image: Image.Image) -> tuple[int, int]:
  """(width, height) as the image is meant to be seen: EXIF orientations 5-8 swap them."""
  return image.size[::-1] if _orientation(image) in (5, 6, 7, 8) else image.size


def decode(image: Image.Image, channels: int, target: Optional[tuple[int, int]] = None) -> Image.Image:
  """Decodes to an upright 'RGB' or 'L' image (any mode in: grayscale, palette, CMYK, alpha, 16-bit).

  `target` (upright width, height) lets JPEG decode at a reduced scale that
  still covers it (libjpeg's DCT scaling): a 4000x3000 photo bound for
  224x224 decodes at 1/8 scale, several times faster.
  """
  orientation = _orientation(image)
  if target is not None and image.format == 'JPEG':
    stored_target = target[::-1] if orientation in (5, 6, 7, 8) else target
    if 2 * stored_target[0] <= image.width and 2 * stored_target[1] <= image.height:  # else nothing to gain
      image.draft('RGB' if channels == 3 else 'L', stored_target)
  if orientation != 1:  # exif_transpose copies even an upright image: skip it then
    image = ImageOps.exif_transpose(image)
  if image.mode in ('I;16', 'I;16B', 'I;16L', 'I'):  # 16-bit PNGs: keep the top 8 bits
    image = Image.fromarray((np.asarray(image, np.uint32) >> 8).astype(np.uint8))
  if image.mode in ('RGBA', 'LA', 'PA') or (image.mode == 'P' and 'transparency' in image.info):
    # Transparent pixels become white (as a viewer shows them), not their hidden colour.
    background = Image.new('RGBA', image.size, (255, 255, 255, 255))
    image = Image.alpha_composite(background, image.convert('RGBA'))
  mode = 'RGB' if channels == 3 else 'L'
  return image if image.mode == mode else image.convert(mode)


def to_array(image: Image.Image, channels: int) -> np.ndarray:
  return np.asarray(image, np.uint8).reshape(image.height, image.width, channels)


CROP_ATTEMPTS = 10  # boxes drawn for an image before `random_crop_box` falls back to its centre


def crop_draws(rng: np.random.Generator, count: int) -> np.ndarray:
  """The random numbers of `count` images' random crops, float64 [count, CROP_ATTEMPTS, 4] in [0, 1):
  each attempt's area, aspect, left and top, which `random_crop_box` scales to the image once its size
  is known. Drawn for a whole batch from one generator: one generator per image took 0.12 ms of a
  training image's 1.5 ms on a TPU host (docs/performance.md)."""
  return rng.random((count, CROP_ATTEMPTS, 4))


def random_crop_box(draws: np.ndarray, width: int, height: int, area_range: tuple[float, float],
                    aspect_range: tuple[float, float]) -> tuple[int, int, int, int]:
  """(left, top, right, bottom) of an Inception-style random crop from one image's `crop_draws`: a
  uniform share of the area in `area_range`, a log-uniform aspect in `aspect_range`, a uniform
  position; the first of the attempts that fits, else the centre."""
  area = width * height
  log_aspect = (math.log(aspect_range[0]), math.log(aspect_range[1]))
  for area_draw, aspect_draw, left_draw, top_draw in draws.tolist():
    target_area = area * (area_range[0] + area_draw * (area_range[1] - area_range[0]))
    aspect = math.exp(log_aspect[0] + aspect_draw * (log_aspect[1] - log_aspect[0]))
    crop_width = int(round(math.sqrt(target_area * aspect)))
    crop_height = int(round(math.sqrt(target_area / aspect)))
    if 0 < crop_width <= width and 0 < crop_height <= height:
      left = int(left_draw * (width - crop_width + 1))  # each of the positions equally likely
      top = int(top_draw * (height - crop_height + 1))
      return left, top, left + crop_width, top + crop_height
  # Fallback (as in torchvision/big_vision): the centre crop with the aspect clipped to the range.
  ratio = width / height
  if ratio < aspect_range[0]:
    crop_width, crop_height = width, int(round(width / aspect_range[0]))
  elif ratio > aspect_range[1]:
    crop_width, crop_height = int(round(height * aspect_range[1])), height
  else:
    crop_width, crop_height = width, height
  left, top = (width - crop_width) // 2, (height - crop_height) // 2
  return left, top, left + crop_width, top + crop_height


def centre_crop_box(width: int, height: int, size: int, crop_fraction: float) -> tuple[float, ...]:
  """The box that, resized to `size` x `size`, equals resizing the shorter side to
  `size / crop_fraction` and cutting out the centre `size` x `size`."""
  side = min(width, height) * crop_fraction
  left, top = (width - side) / 2, (height - side) / 2
  return left, top, left + side, top + side


def _cropped(source: Source, box: tuple[float, ...], size: int, channels: int,
             out: Optional[np.ndarray] = None, area_below: float = 1.0,
             fast_idct: bool = False) -> np.ndarray:
  """Decodes only as finely as the crop needs, then resizes the crop `box` (upright pixels) to size,
  into `out` (a [size, size, channels] uint8 view, e.g. a row of the batch) when given.

  The resize is OpenCV's: ~6x faster than Pillow's here (0.14 vs 0.89 ms at 224x224). Shrinking
  to less than `area_below` of the crop's side averages pixels (INTER_AREA), so large crops do not
  alias; otherwise it interpolates (INTER_LINEAR). Evaluation averages every shrink (1.0); training
  crops only those of 2x or more (0.5): after the DCT scaling a JPEG's crop shrinks by less than
  2x, where bilinear reads every pixel's neighbourhood and INTER_AREA's non-integer path cost
  0.48 ms an image against 0.08 (224 px, one core), over a third of a training image's time.
  `fast_idct`: a JPEG through libjpeg-turbo's fast integer IDCT (training crops; see the module's
  docstring).
  """
  width, height = source_size(source)
  target = (math.ceil(size * width / max(box[2] - box[0], 1e-6)),
            math.ceil(size * height / max(box[3] - box[1], 1e-6)))
  pixels = _decoded(source, channels, target, fast_idct)
  scale_x, scale_y = pixels.shape[1] / width, pixels.shape[0] / height  # < 1 at a reduced DCT scale
  left, right = _pixel_span(box[0] * scale_x, box[2] * scale_x, pixels.shape[1])
  top, bottom = _pixel_span(box[1] * scale_y, box[3] * scale_y, pixels.shape[0])
  crop = pixels[top:bottom, left:right]
  averaging = size < area_below * max(crop.shape[0], crop.shape[1])
  if out is None:
    out = np.empty((size, size, channels), np.uint8)
  # A [size, size] view for one channel: OpenCV drops a trailing 1 and would reallocate.
  cv2.resize(crop, (size, size), dst=out.reshape(size, size) if channels == 1 else out,
             interpolation=cv2.INTER_AREA if averaging else cv2.INTER_LINEAR)
  return out


def _decoded(source: Source, channels: int, target: tuple[int, int], fast_idct: bool = False) -> np.ndarray:
  """The whole image, upright, uint8 [H, W, C], decoded only as finely as `target` (width, height)
  needs: libjpeg-turbo straight from a plain JPEG's bytes (`fast_idct`: its fast integer IDCT), else
  Pillow."""
  if isinstance(source, Jpeg):
    try:
      return _decode_jpeg(source, channels, target, fast_idct)
    except ValueError:  # corrupt or truncated data: Pillow's path decides (and names the error)
      source = open_image(source.data)
  return to_array(decode(source, channels, target), channels)


def shorter_side_at_most(item: str | bytes | np.ndarray | Image.Image, channels: int,
                         side: int = 0) -> np.ndarray:
  """The whole image, upright, uint8 [H, W, C]: its shorter side shrunk to `side` where it is
  longer (pixels averaged, INTER_AREA), else (and with `side` 0) at its native size.

  What a split decoded into memory keeps: enough pixels for every crop of `side`.
  """
  source = open_source(item)
  width, height = source_size(source)
  scale = side / min(width, height) if side else 1.0
  target = (max(1, round(width * scale)), max(1, round(height * scale))) if scale < 1 else (width, height)
  pixels = _decoded(source, channels, target)
  if pixels.shape[:2] == (target[1], target[0]):
    return pixels
  resized = cv2.resize(pixels, target, interpolation=cv2.INTER_AREA)
  return resized.reshape(target[1], target[0], channels)


def _decode_jpeg(jpeg: Jpeg, channels: int, target: tuple[int, int], fast_idct: bool = False) -> np.ndarray:
  """The whole JPEG at the coarsest of libjpeg-turbo's 1/1, 1/2, 1/4, 1/8 scales still at least
  `target` (width, height). Other M/8 scales exist but decode slower than 1/1 (a 1000x750 JPEG:
  4.8 ms at 7/8, 2.1 ms at 1/1, 1.5 ms at 1/2), so they are never asked for."""
  factor = 8
  while factor > 1 and (-(-jpeg.width // factor) < target[0] or -(-jpeg.height // factor) < target[1]):
    factor //= 2
  # simplejpeg picks the smallest scale whose size reaches both minimums: exactly 1/factor here.
  pixels = simplejpeg.decode_jpeg(jpeg.data, colorspace='RGB' if channels == 3 else 'GRAY', fastdct=fast_idct,
                                  min_width=-(-jpeg.width // factor), min_height=-(-jpeg.height // factor))
  return pixels.reshape(pixels.shape[0], pixels.shape[1], channels)


def _pixel_span(start: float, stop: float, limit: int) -> tuple[int, int]:
  """Whole pixels [first, last) covering [start, stop), at least one, inside [0, limit)."""
  first = min(max(int(round(start)), 0), limit - 1)
  return first, max(min(int(round(stop)), limit), first + 1)


TRAIN_AREA_BELOW = 0.5  # a training crop is averaged (INTER_AREA) when shrunk 2x or more (`_cropped`)


def train_image(item: str | bytes | np.ndarray | Image.Image, transform: Transform,
                draws: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
  """A training example (a file path, bytes, a decoded array or a Pillow image): a random-resized
  crop to `transform.size` from its `crop_draws`, written into `out` when given (or the native
  image)."""
  source = open_source(item)
  if not transform.size:
    return to_array(decode(_pillow(source), transform.channels), transform.channels)
  box = random_crop_box(draws, *source_size(source), transform.crop_area, transform.crop_aspect)
  return _cropped(source, box, transform.size, transform.channels, out, area_below=TRAIN_AREA_BELOW,
                  fast_idct=True)


def eval_image(item: str | bytes | np.ndarray | Image.Image, transform: Transform,
               out: Optional[np.ndarray] = None) -> np.ndarray:
  """An evaluation example: the shorter side resized, the centre cut out (or the native image)."""
  source = open_source(item)
  if not transform.size:
    return to_array(decode(_pillow(source), transform.channels), transform.channels)
  box = centre_crop_box(*source_size(source), transform.size, transform.crop_fraction)
  return _cropped(source, box, transform.size, transform.channels, out)


def _pillow(source: Source) -> Image.Image:
  return open_image(source.data) if isinstance(source, Jpeg) else source


def _orientation(image: Image.Image) -> int:
  try:
    return int(image.getexif().get(0x0112, 1))
  except Exception:  # pylint: disable=broad-except  (a broken EXIF block must not lose the image)
    return 1
