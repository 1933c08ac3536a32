"""Jittable preprocessing of device batches: normalisation and train-time augmentation.

Each example draws its randomness from a key folded from (step key, its
position in the global batch), so the augmented batch is the same whether it
is computed on one device, sharded by `jit`, or split by `pmap`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np


def normalize(images: jax.Array, mean: np.ndarray | None, std: np.ndarray | None) -> jax.Array:
  """uint8 pixels -> float32 in [0, 1], then standardised per channel when mean/std are given."""
  images = images.astype(jnp.float32) / 255.0
  if mean is not None:
    images = (images - mean) / std
  return images


def random_crop(key: jax.Array, image: jax.Array, padding: int) -> jax.Array:
  """Zero-pad by `padding` on every side and cut a random window of the original size."""
  height, width, channels = image.shape
  padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)))
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
  crop_key, flip_key, cutout_key = jax.random.split(key, 3)
  if config.crop_padding:
    image = random_crop(crop_key, image, config.crop_padding)
  if config.flip:
    image = random_flip(flip_key, image)
  if config.cutout:
    image = cutout(cutout_key, image, config.cutout)
  return image


def augment_batch(key: jax.Array, images: jax.Array, positions: jax.Array,
                  config: ml_collections.ConfigDict) -> jax.Array:
  """Augments each image with a key from `key` and its global batch position."""
  if not (config.crop_padding or config.flip or config.cutout):
    return images
  keys = jax.vmap(lambda position: jax.random.fold_in(key, position))(positions)
  return jax.vmap(lambda k, image: augment_image(k, image, config))(keys, images)
