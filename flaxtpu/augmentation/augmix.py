"""AugMix (Hendrycks et al. 2020) of one uint8 image on the device, as timm's `augmix-m3-w3-d-1`
(`augment.policy=augmix`, `augment.augmix_*`).

`width` chains, each of `depth` ops (-1: uniform in 1..3 per chain) drawn
uniformly with replacement from AUGMIX_OPS, each at a strength uniform in
[0, severity / 10] of the op's full level (timm's magnitude_std=inf), signed
ops negated with probability 1/2. The chains are summed with Dirichlet(alpha)
weights, clipped to 0..255 and truncated to uint8, then blended with the
original image: (1 - m) * image + m * mix with m ~ Beta(alpha, alpha),
truncated (timm's `_apply_basic` and PIL's blend).

The ops are flaxtpu/augmentation/randaugment.py's (torchvision's formulas and
RandAugment's full levels): timm's augmix list, with Brightness, Color,
Contrast and Sharpness as its *Increasing variants (factor 1 +- up to 0.9),
and translations up to 150/331 of the side where timm's augmix uses 0.3.
The JSD consistency loss of the paper (three views of every image through
the network) is not implemented: AugMix here is a train-time augmentation
alone, as timm's `--aug-splits 0`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxtpu.augmentation import randaugment

AUGMIX_OPS = ('AutoContrast', 'Color', 'Contrast', 'Brightness', 'Sharpness', 'Equalize', 'Rotate',
              'Posterize', 'Solarize', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY')
MAX_DEPTH = 3  # depth=-1: each chain's depth is uniform in 1..3 (timm, the paper)
MAX_SEVERITY = 10  # timm's magnitude scale (_LEVEL_DENOM)
# Added before truncating a weighted sum of integers whose weights sum to 1 up to float error, so
# that equal inputs give that value back rather than one less.
_SLACK = 1e-3


def _chain(image: jax.Array, uniforms: jax.Array, count: jax.Array, severity: float) -> jax.Array:
  """The first `count` steps of one chain, from [steps, 3] numbers uniform in [0, 1): each step's
  op, strength and sign. A scan, so XLA compiles the op switch once rather than once per step."""
  levels = randaugment._max_levels('randaugment', image.shape[0], image.shape[1])  # pylint: disable=protected-access
  maxima = jnp.array([levels[op] for op in AUGMIX_OPS], jnp.float32)
  signed = jnp.array([op in randaugment._SIGNED for op in AUGMIX_OPS])  # pylint: disable=protected-access
  functions = [randaugment._FUNCTIONS[op] for op in AUGMIX_OPS]  # pylint: disable=protected-access

  def step(image, draws):
    (op_draw, strength_draw, sign_draw), index_in_chain = draws
    index = jnp.minimum(jnp.floor(op_draw * len(AUGMIX_OPS)).astype(jnp.int32), len(AUGMIX_OPS) - 1)
    sign = jnp.where(signed[index] & (sign_draw < 0.5), -1.0, 1.0)
    level = randaugment._snap(sign * strength_draw * severity / MAX_SEVERITY * maxima[index])  # pylint: disable=protected-access
    changed = jax.lax.switch(index, functions, image, level)
    return jnp.where(index_in_chain < count, changed, image), None

  steps = uniforms.shape[0]
  return jax.lax.scan(step, image, ((uniforms[:, 0], uniforms[:, 1], uniforms[:, 2]), jnp.arange(steps)))[0]


def parts(key: jax.Array, image: jax.Array, *, severity: float, width: int, depth: int,
          alpha: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(chains uint8 [width, H, W, C], Dirichlet weights [width], m): what `apply` mixes."""
  gamma_key, uniform_key = jax.random.split(key)
  gammas = jax.random.gamma(gamma_key, alpha, (width + 2,))  # Dirichlet = normalised gammas; Beta likewise
  weights = gammas[:width] / gammas[:width].sum()
  m = gammas[width] / (gammas[width] + gammas[width + 1])
  steps = MAX_DEPTH if depth < 0 else depth
  uniforms = jax.random.uniform(uniform_key, (width, 3 * steps + 1))  # per chain: 3 per step, its depth
  counts = (jnp.floor(uniforms[:, -1] * MAX_DEPTH).astype(jnp.int32) + 1 if depth < 0
            else jnp.full((width,), depth))
  draws = uniforms[:, :-1].reshape(width, steps, 3)
  chains = jax.vmap(lambda u, count: _chain(image, u, count, severity))(draws, counts)
  return chains, weights, m


def mix(image: jax.Array, chains: jax.Array, weights: jax.Array, m: jax.Array) -> jax.Array:
  """timm's mix: the chains' weighted sum clipped and truncated to uint8, blended with the image."""
  mixed = jnp.einsum('n,nhwc->hwc', weights, chains.astype(jnp.float32))
  mixed = jnp.floor(jnp.clip(mixed, 0.0, 255.0) + _SLACK)
  out = (1.0 - m) * image.astype(jnp.float32) + m * mixed
  return jnp.clip(jnp.floor(out + _SLACK), 0.0, 255.0).astype(jnp.uint8)


def apply(key: jax.Array, image: jax.Array, *, severity: float = 3, width: int = 3, depth: int = -1,
          alpha: float = 1.0) -> jax.Array:
  """AugMix of one uint8 [H, W, 1 or 3] image; same key and image: same output."""
  chains, weights, m = parts(key, image, severity=severity, width=width, depth=depth, alpha=alpha)
  return mix(image, chains, weights, m)
