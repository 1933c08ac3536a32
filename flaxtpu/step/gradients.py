"""How a train step gets its gradient: one backward pass, or SAM's two (sam.py), in float32/bfloat16 or
under float16's dynamic loss scale (loss_scale.py); averaged over the devices either way."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from flaxtpu.optimizers import loss_scale, optim, sam


class Gradient(NamedTuple):
  loss: jax.Array
  aux: Any  # loss_fn's auxiliary outputs of the first (unperturbed) pass
  grads: Any  # mean over every device's examples
  finite: jax.Array  # bool []: False where float16 overflowed (the step is skipped)
  reported: jax.Array  # bool []: whether the step's loss counts in the train metrics
  opt_state: Any  # with its new loss scale (float16), else as given
  loss_scale: Optional[jax.Array]  # the scale the step used (float16), else None


def compute(loss_fn: Callable, params, opt_state, *, sam_rho: float, sam_adaptive: bool, param_groups,
            axis_name: Optional[str]) -> Gradient:
  """`loss_fn(params) -> (loss, aux)` differentiated at `params`: SAM's gradient where sam_rho > 0."""
  dynamic_scale = loss_scale.get(opt_state)

  def value_and_grad(point):
    if dynamic_scale is None:
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(point)
      grads = grads if axis_name is None else jax.lax.pmean(grads, axis_name)
      return None, jnp.bool_(True), (loss, aux), grads
    return dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name=axis_name)(point)

  scale, finite, (loss, aux), grads = value_and_grad(params)
  if sam_rho:
    trainable = (jax.tree.map(lambda label: label != optim.FROZEN, param_groups.labels(params))
                 if param_groups else jax.tree.map(lambda _: True, params))
    point = sam.perturbed(params, grads, trainable, rho=sam_rho, adaptive=sam_adaptive)
    second_scale, second_finite, _, grads = value_and_grad(point)
    if dynamic_scale is not None:  # halved once if either pass overflowed
      scale = jax.tree.map(lambda a, b: jnp.where(finite, a, b), second_scale, scale)
      finite = finite & second_finite
  if dynamic_scale is None:
    return Gradient(loss, aux, grads, finite, jnp.bool_(True), opt_state, None)
  return Gradient(loss, aux, grads, finite, loss_scale.reported(finite, dynamic_scale.scale),
                  loss_scale.put(opt_state, scale), dynamic_scale.scale)
