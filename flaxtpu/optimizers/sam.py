"""Sharpness-aware minimisation (Foret et al. 2021) and its adaptive form ASAM (Kwon et al. 2021): the
gradient at the worst point of a rho-ball around the weights, taken as the train step's gradient.

    e = rho * g / ||g||                      (SAM)
    e = rho * T^2 g / ||T g||,  T = |w| + eta  (ASAM, optimizer.sam_adaptive)
    gradient = dL/dw at w + e

The step takes two gradients (`gradients.compute`). g is the gradient of the
micro-batch the step sees, averaged over every device: under jit, pmap and
fsdp the perturbation is the same (SAM's m-sharpness with m = batch_size),
and under `optimizer.accumulate_steps` each micro-batch is perturbed by its own
gradient, as SAM's data-parallel implementations perturb each worker's batch
by its own (the accumulated gradient is not known until the last micro-batch,
and the paper found smaller m generalises better). Frozen parameters are not
perturbed and do not count in the norm. optax.contrib.sam is not used: it
alternates the perturbation and the update over two optimizer steps (or, in
its opaque mode, wraps the optimizer and needs a grad_fn threaded through the
MultiSteps, param-group and Lookahead wrappers); here the update stays one
optax update of the SAM gradient, so every wrapper keeps its meaning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

ASAM_ETA = 0.01  # ASAM's eta: T = |w| + eta, so a zero weight is still perturbed


def perturbed(params, grads, trainable, *, rho: float, adaptive: bool):
  """params + e, where e is SAM's (or ASAM's) ascent step of length rho; `trainable`: a bool tree."""
  grads = jax.tree.map(lambda g, t: g if t else jnp.zeros_like(g), grads, trainable)
  if adaptive:
    scale = jax.tree.map(lambda p: jnp.abs(p) + ASAM_ETA, params)
    scaled = jax.tree.map(lambda s, g: s * g, scale, grads)
    norm = optax.global_norm(scaled)
    step = jax.tree.map(lambda s, g: s * s * g, scale, grads)
  else:
    norm, step = optax.global_norm(grads), grads
  factor = rho / (norm + 1e-12)
  return jax.tree.map(lambda p, e: p + (factor * e).astype(p.dtype), params, step)
