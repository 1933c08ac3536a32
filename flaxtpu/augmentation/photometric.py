"""Colour jitter and Gaussian blur of one uint8 image, on the device (`augment.color_jitter*`,
`augment.blur*`), as torchvision's ColorJitter and GaussianBlur (which timm's train transforms use).

ColorJitter: brightness, contrast and saturation factors uniform in
[max(0, 1 - s), 1 + s], a hue shift uniform in [-h, h] (fraction of the colour
wheel), the four applied in a random order per image (torchvision's
`randperm`), each op with a zero strength left out, as torchvision does. The
ops follow torchvision's formulas on uint8 tensors: each result clipped to
0..255 and truncated back to uint8, grey = trunc(0.2989 R + 0.587 G + 0.114 B),
contrast blends with the mean grey, hue goes through HSV (back to uint8 as
torchvision's convert_image_dtype: trunc(x * (256 - 1e-3))). 1-channel images
skip saturation and hue. With `color_jitter_prob` < 1 the whole jitter is
applied with that probability (timm's `color_jitter_prob`).

GaussianBlur: with probability `blur`, a separable Gaussian kernel of
`blur_kernel` taps (timm: 23; at most 2 * side - 1 on small images) with sigma
uniform in `blur_sigma`, the image padded by reflection (torchvision's and
scipy.ndimage's 'mirror'), rounded back to uint8 as torchvision does.

Per-image randomness: one uniform draw from the example's key (each
random-number call costs XLA:CPU seconds to compile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

_GREY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


def active(config: ml_collections.ConfigDict) -> bool:
  """Whether the config turns on colour jitter or blur."""
  return bool(jitter_strengths(config) != (0.0,) * 4 or config.get('blur'))


def jitter_strengths(config: ml_collections.ConfigDict) -> tuple[float, float, float, float]:
  """(brightness, contrast, saturation, hue) strengths: `color_jitter` for the first three (timm's
  scalar form), `color_jitter_hue` for the hue."""
  strength = float(config.get('color_jitter', 0.0))
  return strength, strength, strength, float(config.get('color_jitter_hue', 0.0))


def _to_uint8(x: jax.Array) -> jax.Array:
  """Clip to 0..255 and truncate, as torchvision's uint8 `_blend` does."""
  return jnp.clip(x, 0.0, 255.0).astype(jnp.uint8)


def grey(image: jax.Array) -> jax.Array:
  """float32 [H, W, 1] grey levels truncated to integers (torchvision's uint8 rgb_to_grayscale)."""
  pixels = image.astype(jnp.float32)
  if image.shape[-1] == 1:
    return pixels
  return jnp.floor(pixels @ jnp.array(_GREY, jnp.float32))[..., None]


def _blend(image: jax.Array, other: jax.Array, factor: jax.Array) -> jax.Array:
  return _to_uint8(factor * image.astype(jnp.float32) + (1.0 - factor) * other)


def brightness(image: jax.Array, factor: jax.Array) -> jax.Array:
  """torchvision's adjust_brightness: blend with black."""
  return _blend(image, jnp.zeros((), jnp.float32), factor)


def contrast(image: jax.Array, factor: jax.Array) -> jax.Array:
  """torchvision's adjust_contrast: blend with the image's mean grey level."""
  return _blend(image, jnp.mean(grey(image)), factor)


def saturation(image: jax.Array, factor: jax.Array) -> jax.Array:
  """torchvision's adjust_saturation: blend with the grey image (identity on 1 channel)."""
  return image if image.shape[-1] == 1 else _blend(image, grey(image), factor)


def _rgb_to_hsv(rgb: jax.Array) -> jax.Array:
  r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
  maxc, minc = rgb.max(-1), rgb.min(-1)
  flat = maxc == minc
  span = maxc - minc
  s = span / jnp.where(flat, 1.0, maxc)
  span = jnp.where(flat, 1.0, span)
  rc, gc, bc = (maxc - r) / span, (maxc - g) / span, (maxc - b) / span
  h = jnp.where(maxc == r, bc - gc, jnp.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
  return jnp.stack([jnp.mod(h / 6.0 + 1.0, 1.0), s, maxc], -1)


def _hsv_to_rgb(hsv: jax.Array) -> jax.Array:
  h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
  sector = jnp.floor(h * 6.0)
  f = h * 6.0 - sector
  sector = sector.astype(jnp.int32) % 6
  p = jnp.clip(v * (1.0 - s), 0.0, 1.0)
  q = jnp.clip(v * (1.0 - s * f), 0.0, 1.0)
  t = jnp.clip(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
  table = jnp.stack([jnp.stack(channel, -1) for channel in
                     ((v, q, p, p, t, v), (t, v, v, q, p, p), (p, p, t, v, v, q))], -2)  # [H, W, 3, 6]
  return jnp.take_along_axis(table, sector[..., None, None], -1)[..., 0]


def hue(image: jax.Array, shift: jax.Array) -> jax.Array:
  """torchvision's adjust_hue: rotate the hue by `shift` (a fraction of the wheel, in [-0.5, 0.5])."""
  if image.shape[-1] == 1:
    return image
  hsv = _rgb_to_hsv(image.astype(jnp.float32) / 255.0)
  hsv = hsv.at[..., 0].set(jnp.mod(hsv[..., 0] + shift, 1.0))
  return _to_uint8(_hsv_to_rgb(hsv) * (256.0 - 1e-3))  # torchvision's convert_image_dtype to uint8


_JITTER_OPS = (brightness, contrast, saturation, hue)


def color_jitter(image: jax.Array, uniforms: jax.Array, strengths: tuple[float, ...]) -> jax.Array:
  """torchvision's ColorJitter from 8 numbers uniform in [0, 1): four factors, then an order (the ops'
  argsort). Ops of strength 0 are left out (exact identity at zero strength)."""
  used = [index for index, strength in enumerate(strengths) if strength > 0]
  if not used:
    return image
  factors = []
  for index in range(4):
    strength, draw = strengths[index], uniforms[index]
    low, high = (-strength, strength) if index == 3 else (max(0.0, 1.0 - strength), 1.0 + strength)
    factors.append(low + (high - low) * draw)
  order = jnp.argsort(uniforms[4:4 + len(used)])
  branches = [lambda x, f, op=_JITTER_OPS[index], i=index: op(x, f[i]) for index in used]
  factors = jnp.stack(factors)
  for slot in range(len(used)):
    image = jax.lax.switch(order[slot], branches, image, factors)
  return image


def gaussian_kernel(sigma: jax.Array, radius: int) -> jax.Array:
  """torchvision's 1-D kernel: exp(-x^2 / (2 sigma^2)) at x = -radius..radius, normalised to sum 1."""
  x = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
  pdf = jnp.exp(-0.5 * (x / sigma) ** 2)
  return pdf / pdf.sum()


def blur_radius(kernel: int, height: int, width: int) -> int:
  """The kernel's half width, capped so that reflection padding fits the image."""
  return max(0, min(kernel // 2, height - 1, width - 1))


def gaussian_blur(image: jax.Array, sigma: jax.Array, kernel: int) -> jax.Array:
  """Blur one uint8 [H, W, C] image: rows then columns with `gaussian_kernel`, reflect-padded,
  rounded to uint8."""
  height, width, _ = image.shape
  radius = blur_radius(kernel, height, width)
  if not radius:
    return image
  weights = gaussian_kernel(sigma, radius)
  taps = 2 * radius + 1
  x = jnp.pad(image.astype(jnp.float32), ((radius, radius), (radius, radius), (0, 0)), mode='reflect')
  x = sum(weights[k] * x[:, k:k + width] for k in range(taps))
  x = sum(weights[k] * x[k:k + height] for k in range(taps))
  return jnp.clip(jnp.round(x), 0.0, 255.0).astype(jnp.uint8)


def apply(key: jax.Array, image: jax.Array, config: ml_collections.ConfigDict) -> jax.Array:
  """Colour jitter (with probability `color_jitter_prob`), then blur (with probability `blur`), of one
  uint8 image, as the config asks; the image itself when neither is on."""
  strengths = jitter_strengths(config)
  draws = jax.random.uniform(key, (11,))  # 0-7: jitter factors and order; 8: its coin; 9-10: blur's
  if any(strengths):
    jittered = color_jitter(image, draws[:8], strengths)
    image = jnp.where(draws[8] < config.get('color_jitter_prob', 1.0), jittered, image)
  if config.get('blur'):
    low, high = config.blur_sigma
    blurred = gaussian_blur(image, low + (high - low) * draws[10], config.blur_kernel)
    image = jnp.where(draws[9] < config.blur, blurred, image)
  return image
