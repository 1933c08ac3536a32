"""Jittable preprocessing of device batches: normalisation, train-time augmentation, random erasing,
mixup/CutMix.

Each example draws its randomness from a key folded from (step key, its
position in the global batch), so the augmented batch is the same whether it
is computed on one device, sharded by `jit`, or split by `pmap`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from flaxtpu.augmentation import augmix, photometric, randaugment

# Streams apart from the crop/flip/cutout draws, so that turning one of these on leaves the
# others' draws (and earlier runs' augmentation) unchanged: the policy's is folded into an
# example's key, the mix's and the erasing's into the step key (then each example's position).
_POLICY_STREAM = 1
_PHOTOMETRIC_STREAM = 2  # colour jitter and blur (photometric.py), folded into an example's key
_MIX_STREAM = 2**31 - 1
_ERASE_STREAM = 2**31 - 2
ERASE_ATTEMPTS = 10  # timm's: draws of a box's size before giving that box up


def normalize(images: jax.Array, mean: np.ndarray | None, std: np.ndarray | None) -> jax.Array:
  """uint8 pixels -> float32 in [0, 1], then standardised per channel when mean/std are given."""
  images = images.astype(jnp.float32) / 255.0
  if mean is not None:
    images = (images - mean) / std
  return images


# augment.crop_pad_mode -> jnp.pad's mode.
CROP_PAD_MODES = {'zeros': 'constant', 'reflect': 'reflect', 'edge': 'edge'}


def random_crop(key: jax.Array, image: jax.Array, padding: int, pad_mode: str = 'zeros') -> jax.Array:
  """Pad by `padding` on every side (zeros, mirrored or repeated edge pixels) and cut a random window
  of the original size."""
  height, width, channels = image.shape
  padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)), mode=CROP_PAD_MODES[pad_mode])
  top, left = jax.random.randint(key, (2,), 0, 2 * padding + 1)
  return jax.lax.dynamic_slice(padded, (top, left, 0), (height, width, channels))


def random_flip(key: jax.Array, image: jax.Array) -> jax.Array:
  """Mirror left-right with probability 1/2."""
  return jnp.where(jax.random.bernoulli(key), image[:, ::-1, :], image)


def cutout(key: jax.Array, image: jax.Array, size: int) -> jax.Array:
  """Zero a `size` x `size` square centred at a random pixel (clipped at the border).

  The square covers [centre - size // 2, centre - size // 2 + size): exactly
  `size` rows and columns for odd and even sizes alike.
  """
  height, width, _ = image.shape
  centre_y, centre_x = jax.random.randint(key, (2,), 0, jnp.array([height, width]))
  rows = (jnp.arange(height) - (centre_y - size // 2)).astype(jnp.uint32) < size
  cols = (jnp.arange(width) - (centre_x - size // 2)).astype(jnp.uint32) < size
  inside = rows[:, None] & cols[None, :]
  return jnp.where(inside[:, :, None], jnp.zeros_like(image), image)


def augment_image(key: jax.Array, image: jax.Array, config: ml_collections.ConfigDict) -> jax.Array:
  """Crop, flip, RandAugment/TrivialAugment/AutoAugment/AugMix, colour jitter, blur, cutout: each when
  the config turns it on."""
  crop_key, flip_key, cutout_key = jax.random.split(key, 3)
  if config.crop_padding:
    image = random_crop(crop_key, image, config.crop_padding, config.get('crop_pad_mode', 'zeros'))
  if config.flip and not config.get('alternate_flip'):  # alternate_flip: the host mirrors (data/loaders.py)
    image = random_flip(flip_key, image)
  if config.get('policy') == 'augmix':
    image = augmix.apply(jax.random.fold_in(key, _POLICY_STREAM), image, severity=config.augmix_severity,
                         width=config.augmix_width, depth=config.augmix_depth, alpha=config.augmix_alpha)
  elif config.get('policy'):
    image = randaugment.apply(jax.random.fold_in(key, _POLICY_STREAM), image, policy=config.policy,
                              num_layers=config.randaugment_layers,
                              magnitude=config.randaugment_magnitude)
  if photometric.active(config):
    image = photometric.apply(jax.random.fold_in(key, _PHOTOMETRIC_STREAM), image, config)
  if config.cutout:
    image = cutout(cutout_key, image, config.cutout)
  return image


def augment_batch(key: jax.Array, images: jax.Array, positions: jax.Array,
                  config: ml_collections.ConfigDict) -> jax.Array:
  """Augments each image with a key from `key` and its global batch position."""
  if not (config.crop_padding or (config.flip and not config.get('alternate_flip')) or config.cutout
          or config.get('policy') or photometric.active(config)):
    return images
  keys = jax.vmap(lambda position: jax.random.fold_in(key, position))(positions)
  return jax.vmap(lambda k, image: augment_image(k, image, config))(keys, images)


BOX_DRAWS = 2 * ERASE_ATTEMPTS + 2  # uniform numbers a box takes: each attempt's area and aspect, its place


def erase_box(uniforms: jax.Array, height: int, width: int, count, area: tuple[float, float],
              aspect: tuple[float, float]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(top, left, box height, box width) of one of `count` random-erasing boxes, as timm draws it, from
  BOX_DRAWS numbers uniform in [0, 1).

  Up to ERASE_ATTEMPTS draws of an area (a uniform fraction in `area` of the
  image, divided by `count`) and a log-uniform aspect (height / width) in
  `aspect`, rounded to whole pixels; the first that fits strictly inside the
  image is placed uniformly. A 0 x 0 box when none fits.
  """
  area_draws, aspect_draws = uniforms[:ERASE_ATTEMPTS], uniforms[ERASE_ATTEMPTS:2 * ERASE_ATTEMPTS]
  target = (area[0] + (area[1] - area[0]) * area_draws) * (height * width / count)
  low, high = math.log(aspect[0]), math.log(aspect[1])
  ratio = jnp.exp(low + (high - low) * aspect_draws)
  box_height = jnp.round(jnp.sqrt(target * ratio)).astype(jnp.int32)
  box_width = jnp.round(jnp.sqrt(target / ratio)).astype(jnp.int32)
  fits = (box_height < height) & (box_width < width)
  first = jnp.argmax(fits)
  box_height = jnp.where(fits[first], box_height[first], 0)
  box_width = jnp.where(fits[first], box_width[first], 0)
  place = lambda draw, room: jnp.minimum(jnp.floor(draw * (room + 1)).astype(jnp.int32), room)
  top, left = place(uniforms[-2], height - box_height), place(uniforms[-1], width - box_width)
  return top, left, box_height, box_width


def random_erase(key: jax.Array, image: jax.Array, config: ml_collections.ConfigDict) -> jax.Array:
  """timm's RandomErasing of one normalised [H, W, C] image: with probability `erase_prob`,
  1..erase_count boxes (uniform) filled as `erase_mode` says: per-pixel normal noise (pixel), a
  normal colour per box (rand) or 0 (const).

  All its draws come from one uniform and one normal sample: XLA:CPU takes
  seconds to compile each random-number call.
  """
  height, width, channels = image.shape
  boxes = config.erase_count
  draw_key, fill_key = jax.random.split(key)
  uniforms = jax.random.uniform(draw_key, (2 + boxes * BOX_DRAWS,))
  count = jnp.minimum(jnp.floor(uniforms[1] * boxes).astype(jnp.int32) + 1, boxes)
  shape = {'pixel': (boxes, *image.shape), 'rand': (boxes, 1, 1, channels), 'const': None}[config.erase_mode]
  fills = (jax.random.normal(fill_key, shape, image.dtype) if shape
           else jnp.zeros((boxes, 1, 1, 1), image.dtype))
  rows, cols = jnp.arange(height)[:, None], jnp.arange(width)[None, :]
  erased = image
  for index in range(boxes):
    draws = uniforms[2 + index * BOX_DRAWS:2 + (index + 1) * BOX_DRAWS]
    top, left, box_height, box_width = erase_box(draws, height, width, count, tuple(config.erase_area),
                                                 tuple(config.erase_aspect))
    inside = ((rows >= top) & (rows < top + box_height) & (cols >= left) & (cols < left + box_width)
              & (index < count))
    erased = jnp.where(inside[:, :, None], fills[index], erased)
  return jnp.where(uniforms[0] < config.erase_prob, erased, image)


def erase_batch(key: jax.Array, images: jax.Array, positions: jax.Array,
                config: ml_collections.ConfigDict) -> jax.Array:
  """Random erasing of normalised float images: `random_erase` of each example with a key from
  `key` and its global batch position.

  After normalisation, as timm's RandomErasing (whose docstring asks for
  normalised tensors): 'const' 0 is then the mean colour and 'pixel' noise
  has the data's own per-channel spread; before mixup/CutMix, as in timm.
  """
  if not config.get('erase_prob'):
    return images
  stream = jax.random.fold_in(key, _ERASE_STREAM)
  return jax.vmap(lambda position, image: random_erase(jax.random.fold_in(stream, position), image, config))(
      positions, images)


def mixes(config: ml_collections.ConfigDict) -> bool:
  return bool(config.get('mixup_alpha') or config.get('cutmix_alpha'))


def partner(x: jax.Array) -> jax.Array:
  """Rows 2i and 2i+1 swapped: whom each example is mixed with.

  Batches are shuffled, so a neighbour is as random a partner as any; and a
  pair never spans two devices while each device holds an even number of
  rows, so the mix needs no communication and is the same under jit and pmap.
  """
  return x.reshape(-1, 2, *x.shape[1:])[:, ::-1].reshape(x.shape)


def cutmix_box(key: jax.Array, height: int, width: int, keep: jax.Array) -> jax.Array:
  """A [H, W] bool box of about (1 - keep) of the image, centred at a random pixel, clipped at the border."""
  cut = jnp.sqrt(1.0 - keep)
  half_h = (jnp.floor(height * cut) / 2).astype(jnp.int32)
  half_w = (jnp.floor(width * cut) / 2).astype(jnp.int32)
  centre_y, centre_x = jax.random.randint(key, (2,), 0, jnp.array([height, width]))
  rows = (jnp.arange(height) >= centre_y - half_h) & (jnp.arange(height) < centre_y + half_h)
  cols = (jnp.arange(width) >= centre_x - half_w) & (jnp.arange(width) < centre_x + half_w)
  return rows[:, None] & cols[None, :]


def mix_example(key: jax.Array, image: jax.Array, other: jax.Array,
                config: ml_collections.ConfigDict) -> tuple[jax.Array, jax.Array]:
  """(mixed image, weight of its own label) for one example and its partner.

  With probability `mix_prob` the example is mixed: CutMix with probability
  `mix_switch_prob` when both alphas are set, else the one that is. mixup
  blends the pixels at lambda ~ Beta(alpha, alpha); CutMix pastes a box of the
  partner and weighs the labels by the area actually kept (after clipping).
  """
  use_key, switch_key, mixup_key, cutmix_key, box_key = jax.random.split(key, 5)
  mixed, keep = image, jnp.float32(1.0)
  if config.mixup_alpha:
    lam = jax.random.beta(mixup_key, config.mixup_alpha, config.mixup_alpha)
    mixed, keep = lam * image + (1.0 - lam) * other, lam
  if config.cutmix_alpha:
    lam = jax.random.beta(cutmix_key, config.cutmix_alpha, config.cutmix_alpha)
    box = cutmix_box(box_key, image.shape[0], image.shape[1], lam)
    cut_image = jnp.where(box[:, :, None], other, image)
    cut_keep = 1.0 - jnp.mean(box.astype(jnp.float32))
    use_cutmix = jax.random.bernoulli(switch_key, config.mix_switch_prob) if config.mixup_alpha else True
    mixed, keep = jnp.where(use_cutmix, cut_image, mixed), jnp.where(use_cutmix, cut_keep, keep)
  use = jax.random.bernoulli(use_key, config.mix_prob)
  return jnp.where(use, mixed, image), jnp.where(use, keep, 1.0)


def mix_batch(key: jax.Array, images: jax.Array, targets: jax.Array, positions: jax.Array,
              config: ml_collections.ConfigDict) -> tuple[jax.Array, jax.Array]:
  """mixup/CutMix of float images and their [B, classes] targets; the label mass stays 1 per example."""
  if not mixes(config):
    return images, targets
  keys = jax.vmap(lambda position: jax.random.fold_in(jax.random.fold_in(key, _MIX_STREAM), position))(
      positions)
  mixed, keep = jax.vmap(lambda k, image, other: mix_example(k, image, other, config))(
      keys, images, partner(images))
  return mixed, keep[:, None] * targets + (1.0 - keep[:, None]) * partner(targets)
