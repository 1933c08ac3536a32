"""RandAugment, TrivialAugment-Wide and AutoAugment as pure, jittable JAX functions on one uint8 image.

RandAugment (Cubuk et al. 2019) applies `num_layers` ops drawn uniformly with
replacement from OPS, all at one fixed magnitude; TrivialAugment-Wide (Mueller &
Hutter 2021) applies one op at a magnitude drawn per image; AutoAugment (Cubuk
et al. 2018, its ImageNet policy) applies one of 25 learned sub-policies, two
ops each with their own probability and magnitude. Op set, magnitude ranges and
op semantics follow torchvision's `RandAugment` / `TrivialAugmentWide` /
`AutoAugment(AutoAugmentPolicy.IMAGENET)` on uint8 tensors (nearest-neighbour
warps, blends truncated to uint8).

They run on device, inside the jitted train step, rather than in the input
pipeline: the host stays a plain uint8 loader, and the result is deterministic
per (seed, step, example). `apply` takes one image and its own key, and the
caller vmaps it over the batch with keys folded from (step key, position in the
global batch), so each example depends only on its own key and image: the
batch is the same under one device, `jit` sharding or `pmap` (bit for bit, but
for the rare Rotate tie below).

Bit-exact across compilations: float32 blends truncated to uint8 came out one
apart between eager and jit(vmap) runs of the same example (XLA compiles the
arithmetic differently), so the ops work in exact arithmetic instead: op levels
are snapped to multiples of 1/4096 (at most 1/8192 of the op's unit away),
blends, grayscale and smoothing are integer fixed-point, and warp sample points
are snapped to 1/256 pixel before rounding. Shear and translate are then exact;
Rotate's cos/sin can still differ in the last bit between compilations, which
the snapping turns into a different pixel only in rare exact-tie cases.

Choices (documented differences from torchvision):
  * Geometric ops fill the area outside the source image with FILL = 128 (mid
    gray, timm's choice); torchvision's default fill for tensors is 0.
  * Results are the exact-arithmetic values of torchvision's formulas, which
    torchvision's own float32 code misses by one now and then (e.g. its
    AutoContrast maps the maximum to 254 when max - min is 7, 14, 28, ...).
  * Nearest-neighbour ties (a sample point exactly half-way between pixels)
    round up, like PIL; torchvision's grid_sample rounds them to even.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POLICIES = ('randaugment', 'trivialaugment', 'autoaugment')
OPS = ('Identity', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate', 'Brightness',
       'Color', 'Contrast', 'Sharpness', 'Posterize', 'Solarize', 'AutoContrast', 'Equalize')
FILL = 128  # geometric ops' value outside the source image (timm's gray; torchvision uses 0)
MAX_MAGNITUDE = 30.0  # RandAugment's magnitude scale (torchvision/timm: 31 bins, 0..30)
_LEVEL_ONE = 4096  # fixed point: op levels and blend factors in units of 1/4096
_PIXEL_ONE = 256  # blend targets (gray means) and warp sample points in units of 1/256
_SIGNED = ('ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate',
           'Brightness', 'Color', 'Contrast', 'Sharpness')


def _max_levels(policy: str, height: int, width: int) -> dict[str, float]:
  """Each op's level at full strength, in the op's own unit (see the op functions)."""
  if policy == 'randaugment':
    shear, translate_x, translate_y, rotate, enhance, posterize = (
        0.3, 150 / 331 * width, 150 / 331 * height, 30.0, 0.9, 4.0)
  else:  # trivialaugment: torchvision's TrivialAugmentWide ranges
    shear, translate_x, translate_y, rotate, enhance, posterize = 0.99, 32.0, 32.0, 135.0, 0.99, 6.0
  return dict(Identity=0.0, ShearX=shear, ShearY=shear, TranslateX=translate_x,
              TranslateY=translate_y, Rotate=rotate, Brightness=enhance, Color=enhance,
              Contrast=enhance, Sharpness=enhance, Posterize=posterize, Solarize=255.0,
              AutoContrast=0.0, Equalize=0.0, Invert=0.0)


# --- geometric ops -----------------------------------------------------------


def _warp(image: jax.Array, matrix: jax.Array) -> jax.Array:
  """Nearest-neighbour affine warp; FILL outside the source.

  `matrix` (2x3) maps an output pixel (x, y) to the source point it samples,
  both in pixel-index units relative to the image centre ((W-1)/2, (H-1)/2),
  torchvision's grid convention. Sample points are snapped to 1/256 pixel so
  that ties round up whatever float error the compiled program makes.
  """
  height, width, _ = image.shape
  cy, cx = (height - 1) / 2, (width - 1) / 2
  y, x = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32) - cy,
                      jnp.arange(width, dtype=jnp.float32) - cx, indexing='ij')

  def nearest(row, centre):
    point = jnp.round((row[0] * x + row[1] * y + row[2] + centre) * _PIXEL_ONE).astype(jnp.int32)
    return (point + _PIXEL_ONE // 2) // _PIXEL_ONE

  src_x, src_y = nearest(matrix[0], cx), nearest(matrix[1], cy)
  inside = (src_x >= 0) & (src_x < width) & (src_y >= 0) & (src_y < height)
  pixels = image[jnp.clip(src_y, 0, height - 1), jnp.clip(src_x, 0, width - 1)]
  return jnp.where(inside[:, :, None], pixels, jnp.uint8(FILL))


def shear_x(image: jax.Array, level: jax.Array) -> jax.Array:
  """Source x = x + level * (y - top edge): torchvision's shear about the top-left corner."""
  top = -image.shape[0] / 2
  return _warp(image, jnp.array([[1.0, level, -level * top], [0.0, 1.0, 0.0]]))


def shear_y(image: jax.Array, level: jax.Array) -> jax.Array:
  """Source y = y + level * (x - left edge)."""
  left = -image.shape[1] / 2
  return _warp(image, jnp.array([[1.0, 0.0, 0.0], [level, 1.0, -level * left]]))


def translate_x(image: jax.Array, level: jax.Array) -> jax.Array:
  """Shift right by int(level) pixels (truncated toward zero, as torchvision does)."""
  return _warp(image, jnp.array([[1.0, 0.0, -jnp.trunc(level)], [0.0, 1.0, 0.0]]))


def translate_y(image: jax.Array, level: jax.Array) -> jax.Array:
  """Shift down by int(level) pixels."""
  return _warp(image, jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, -jnp.trunc(level)]]))


def rotate(image: jax.Array, level: jax.Array) -> jax.Array:
  """Rotate by `level` degrees about the centre, counter-clockwise for positive angles."""
  cos, sin = jnp.cos(jnp.deg2rad(level)), jnp.sin(jnp.deg2rad(level))
  return _warp(image, jnp.array([[cos, -sin, 0.0], [sin, cos, 0.0]]))


# --- colour ops ----------------------------------------------------------------


def _blend(image: jax.Array, degenerate: jax.Array, level: jax.Array) -> jax.Array:
  """degenerate + factor * (image - degenerate) with factor = 1 + level, clipped to 0..255
  and truncated, as torchvision's _blend, but exact: `degenerate` is in 1/256 units."""
  factor = _LEVEL_ONE + jnp.round(level * _LEVEL_ONE).astype(jnp.int32)
  difference = image.astype(jnp.int32) * _PIXEL_ONE - degenerate
  out = (degenerate * _LEVEL_ONE + factor * difference) // (_LEVEL_ONE * _PIXEL_ONE)
  return jnp.clip(out, 0, 255).astype(jnp.uint8)


def _grayscale(image: jax.Array) -> jax.Array:
  """[H, W, 1] int32 luma 0.2989 R + 0.587 G + 0.114 B truncated (torchvision's rgb_to_grayscale)."""
  pixels = image.astype(jnp.int32)
  if image.shape[-1] == 1:
    return pixels
  luma = 2989 * pixels[..., 0] + 5870 * pixels[..., 1] + 1140 * pixels[..., 2]
  return (luma // 10000)[..., None]


def brightness(image: jax.Array, level: jax.Array) -> jax.Array:
  """Blend with black by factor 1 + level."""
  return _blend(image, jnp.zeros((), jnp.int32), level)


def color(image: jax.Array, level: jax.Array) -> jax.Array:
  """Blend with the grayscale image by factor 1 + level (saturation); identity for C = 1."""
  if image.shape[-1] == 1:
    return image
  return _blend(image, _grayscale(image) * _PIXEL_ONE, level)


def contrast(image: jax.Array, level: jax.Array) -> jax.Array:
  """Blend with the mean gray level (rounded to 1/256) by factor 1 + level."""
  total, count = jnp.sum(_grayscale(image)), image.shape[0] * image.shape[1]
  mean = total // count * _PIXEL_ONE + (total % count * _PIXEL_ONE + count // 2) // count
  return _blend(image, mean, level)


def sharpness(image: jax.Array, level: jax.Array) -> jax.Array:
  """Blend with a smoothed image (3x3 kernel 1s with 5 in the middle, / 13, rounded; the
  one-pixel border kept) by factor 1 + level."""
  height, width, _ = image.shape
  if height <= 2 or width <= 2:
    return image
  pixels = image.astype(jnp.int32)
  window = sum(pixels[dy:height - 2 + dy, dx:width - 2 + dx] for dy in range(3) for dx in range(3))
  smooth = (window + 4 * pixels[1:-1, 1:-1] + 6) // 13  # rounded: never a tie, 13 is odd
  return _blend(image, pixels.at[1:-1, 1:-1].set(smooth) * _PIXEL_ONE, level)


def posterize(image: jax.Array, level: jax.Array) -> jax.Array:
  """Keep the top 8 - round(level) bits of every channel."""
  dropped = jnp.round(level).astype(jnp.uint32)
  mask = (jnp.uint32(0xFF) << dropped) & jnp.uint32(0xFF)
  return image & mask.astype(jnp.uint8)


def solarize(image: jax.Array, level: jax.Array) -> jax.Array:
  """Invert pixels >= 255 - level (at level 0 this still inverts 255s, as torchvision does)."""
  threshold = 255.0 - level
  return jnp.where(image.astype(jnp.float32) >= threshold, 255 - image, image)


def autocontrast(image: jax.Array, level: jax.Array) -> jax.Array:
  """Stretch each channel's min..max to 0..255 (channels with min == max are kept)."""
  del level
  pixels = image.astype(jnp.int32)
  low, high = pixels.min(axis=(0, 1)), pixels.max(axis=(0, 1))
  span = jnp.maximum(high - low, 1)
  stretched = ((pixels - low) * 255 // span).astype(jnp.uint8)
  return jnp.where(high > low, stretched, image)


def _equalize_channel(channel: jax.Array) -> jax.Array:
  """PIL's ImageOps.equalize on one [H, W] uint8 channel."""
  hist = jnp.bincount(channel.ravel(), length=256)
  step = (channel.size - hist[channel.max()]) // 255  # all pixels but the brightest value's
  cumulative = jnp.cumsum(hist) + step // 2
  lut = jnp.concatenate([jnp.zeros(1, hist.dtype), cumulative[:-1] // jnp.maximum(step, 1)])
  lut = jnp.clip(lut, 0, 255).astype(jnp.uint8)
  return jnp.where(step > 0, lut[channel], channel)


def equalize(image: jax.Array, level: jax.Array) -> jax.Array:
  """Per-channel histogram equalization."""
  del level
  return jax.vmap(_equalize_channel, in_axes=2, out_axes=2)(image)


def invert(image: jax.Array, level: jax.Array) -> jax.Array:
  """255 - every pixel (AutoAugment's; not among RandAugment's OPS)."""
  del level
  return 255 - image


def identity(image: jax.Array, level: jax.Array) -> jax.Array:
  """The image unchanged."""
  del level
  return image


_FUNCTIONS = dict(Identity=identity, ShearX=shear_x, ShearY=shear_y, TranslateX=translate_x,
                  TranslateY=translate_y, Rotate=rotate, Brightness=brightness, Color=color,
                  Contrast=contrast, Sharpness=sharpness, Posterize=posterize, Solarize=solarize,
                  AutoContrast=autocontrast, Equalize=equalize, Invert=invert)


def _snap(level: jax.Array) -> jax.Array:
  """Round to a multiple of 1/4096, so every later step computes on exact values."""
  return jnp.round(jnp.asarray(level, jnp.float32) * _LEVEL_ONE) / _LEVEL_ONE


def apply_op(image: jax.Array, op: str, level) -> jax.Array:
  """One named op at `level`, in the op's unit (shear factor, pixels, degrees, enhance
  delta, bits dropped, 255 - solarize threshold); for tests and one-off use."""
  return _FUNCTIONS[op](image, _snap(level))


def _random_op(key: jax.Array, image: jax.Array, fraction: jax.Array,
               max_levels: dict[str, float]) -> jax.Array:
  """One op drawn uniformly from OPS at `fraction` of its full level, signed ops negated
  with probability 1/2.

  lax.switch on a per-example index: under vmap it becomes a select over all
  branches (every op is computed for every image), which is fine at the small
  image sizes this is meant for.
  """
  op_key, sign_key = jax.random.split(key)
  index = jax.random.randint(op_key, (), 0, len(OPS))
  maxima = jnp.array([max_levels[op] for op in OPS], jnp.float32)
  signed = jnp.array([op in _SIGNED for op in OPS])
  sign = jnp.where(signed[index] & jax.random.bernoulli(sign_key), -1.0, 1.0)
  level = _snap(sign * fraction * maxima[index])
  return jax.lax.switch(index, [_FUNCTIONS[op] for op in OPS], image, level)


# AutoAugment's ImageNet policy (Cubuk et al. 2018), as torchvision's AutoAugmentPolicy.IMAGENET:
# 25 sub-policies of two (op, probability, magnitude bin of 0..9 or None) steps. Duplicates are the
# paper's (and torchvision's): those sub-policies are drawn twice as often.
AUTOAUGMENT_IMAGENET = (
    (('Posterize', 0.4, 8), ('Rotate', 0.6, 9)),
    (('Solarize', 0.6, 5), ('AutoContrast', 0.6, None)),
    (('Equalize', 0.8, None), ('Equalize', 0.6, None)),
    (('Posterize', 0.6, 7), ('Posterize', 0.6, 6)),
    (('Equalize', 0.4, None), ('Solarize', 0.2, 4)),
    (('Equalize', 0.4, None), ('Rotate', 0.8, 8)),
    (('Solarize', 0.6, 3), ('Equalize', 0.6, None)),
    (('Posterize', 0.8, 5), ('Equalize', 1.0, None)),
    (('Rotate', 0.2, 3), ('Solarize', 0.6, 8)),
    (('Equalize', 0.6, None), ('Posterize', 0.4, 6)),
    (('Rotate', 0.8, 8), ('Color', 0.4, 0)),
    (('Rotate', 0.4, 9), ('Equalize', 0.6, None)),
    (('Equalize', 0.0, None), ('Equalize', 0.8, None)),
    (('Invert', 0.6, None), ('Equalize', 1.0, None)),
    (('Color', 0.6, 4), ('Contrast', 1.0, 8)),
    (('Rotate', 0.8, 8), ('Color', 1.0, 2)),
    (('Color', 0.8, 8), ('Solarize', 0.8, 7)),
    (('Sharpness', 0.4, 7), ('Invert', 0.6, None)),
    (('ShearX', 0.6, 5), ('Equalize', 1.0, None)),
    (('Color', 0.4, 0), ('Equalize', 0.6, None)),
    (('Equalize', 0.4, None), ('Solarize', 0.2, 4)),
    (('Solarize', 0.6, 5), ('AutoContrast', 0.6, None)),
    (('Invert', 0.6, None), ('Equalize', 1.0, None)),
    (('Color', 0.6, 4), ('Contrast', 1.0, 8)),
    (('Equalize', 0.8, None), ('Equalize', 0.6, None)),
)
AUTOAUGMENT_BINS = 10  # magnitude bins 0..9: bin b is b / 9 of an op's full level


def autoaugment_step(sub_policy: int, step: int, image_shape: tuple[int, ...]) -> tuple[str, float, float]:
  """(op, probability, level in the op's unit, unsigned) of step 0 or 1 of an ImageNet sub-policy."""
  op, probability, magnitude_bin = AUTOAUGMENT_IMAGENET[sub_policy][step]
  full = _max_levels('randaugment', image_shape[0], image_shape[1])[op]  # torchvision's ranges
  return op, probability, full * (magnitude_bin or 0) / (AUTOAUGMENT_BINS - 1)


def autoaugment_draws(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(sub-policy index, two uniform numbers that each step's probability must reach, whether each
  step's level is negated), from one uniform sample (each random-number call costs XLA:CPU seconds
  of compilation)."""
  uniforms = jax.random.uniform(key, (5,))
  count = len(AUTOAUGMENT_IMAGENET)
  sub_policy = jnp.minimum(jnp.floor(uniforms[0] * count).astype(jnp.int32), count - 1)
  return sub_policy, uniforms[1:3], uniforms[3:5] < 0.5


def _autoaugment(key: jax.Array, image: jax.Array) -> jax.Array:
  """One sub-policy drawn uniformly; each of its two ops applied when its draw is <= its probability
  (torchvision's test), signed ops negated with probability 1/2."""
  sub_policy, draws, negate = autoaugment_draws(key)
  ops = ('Identity',) + tuple(sorted({op for steps in AUTOAUGMENT_IMAGENET for op, _, _ in steps}))
  for step in range(2):
    table = [autoaugment_step(index, step, image.shape) for index in range(len(AUTOAUGMENT_IMAGENET))]
    op_index = jnp.array([ops.index(op) for op, _, _ in table])[sub_policy]
    probability = jnp.array([probability for _, probability, _ in table], jnp.float32)[sub_policy]
    level = jnp.array([level for _, _, level in table], jnp.float32)[sub_policy]
    signed = jnp.array([op in _SIGNED for op in ops])[op_index]
    level = _snap(jnp.where(signed & negate[step], -level, level))
    op_index = jnp.where(draws[step] <= probability, op_index, 0)  # 0: Identity, the step skipped
    image = jax.lax.switch(op_index, [_FUNCTIONS[op] for op in ops], image, level)
  return image


def apply(key: jax.Array, image: jax.Array, *, policy: str, num_layers: int,
          magnitude: float) -> jax.Array:
  """Augment one uint8 [H, W, C] image (C = 1 or 3); same shape and dtype out.

  policy='randaugment': `num_layers` ops, each at `magnitude` on the 0..30
  scale (magnitude / 30 of each op's full strength). policy='trivialaugment':
  one op at a magnitude bin drawn uniformly from 0..30 (TrivialAugmentWide).
  policy='autoaugment': a sub-policy of AUTOAUGMENT_IMAGENET. The last two
  ignore `num_layers` and `magnitude`. Same key and image: same output.
  """
  if policy not in POLICIES:
    raise ValueError(f'unknown augmentation policy {policy!r}; expected one of {POLICIES}')
  if image.ndim != 3 or image.shape[-1] not in (1, 3) or image.dtype != jnp.uint8:
    raise ValueError(f'expected a uint8 [H, W, 1 or 3] image, got {image.dtype} {image.shape}')
  if policy == 'autoaugment':
    return _autoaugment(key, image)
  height, width, _ = image.shape
  max_levels = _max_levels(policy, height, width)
  if policy == 'trivialaugment':
    bin_key, op_key = jax.random.split(key)
    fraction = jax.random.randint(bin_key, (), 0, 31) / MAX_MAGNITUDE
    return _random_op(op_key, image, fraction, max_levels)
  if isinstance(magnitude, (int, float)) and not 0 <= magnitude <= MAX_MAGNITUDE:
    raise ValueError(f'randaugment magnitude must be in [0, {MAX_MAGNITUDE:g}], got {magnitude}')
  fraction = jnp.asarray(magnitude, jnp.float32) / MAX_MAGNITUDE
  for layer_key in jax.random.split(key, num_layers):
    image = _random_op(layer_key, image, fraction, max_levels)
  return image
