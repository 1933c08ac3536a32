"""schedule.name=plateau on the host: after each evaluation, whether the learning rate drops.

The device side is `optim.plateau_scale`, a factor in the optimizer's state that the loop sets
(`optim.set_plateau_scale`) from the scale kept here.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_collections
import optax

from flaxtpu.settings.errors import UserError
from flaxtpu.settings.metric_names import metric_mode


class Plateau:
  """schedule.name=plateau on the host: optax.contrib.reduce_on_plateau's state machine, fed each
  evaluation's metric (negated where it is maximised). Its state is a dict of numbers (for `Progress`);
  any improvement counts (Keras' min_delta=0)."""

  FIELDS = optax.contrib.ReduceLROnPlateauState._fields

  def __init__(self, config: ml_collections.ConfigDict):
    schedule = config.schedule
    self.metric = schedule.plateau_metric or 'eval_loss'
    self.sign = -1.0 if metric_mode(self.metric) == 'max' else 1.0
    self._transform = optax.contrib.reduce_on_plateau(
        factor=schedule.factor, patience=schedule.plateau_patience, rtol=0.0, atol=1e-12,
        cooldown=schedule.plateau_cooldown, accumulation_size=1, min_scale=schedule.final_lr_fraction)

  def initial(self) -> dict:
    return self._to_json(self._template())

  def _template(self):
    return self._transform.init(jnp.zeros([], jnp.float32))

  def update(self, state: dict, metrics: dict) -> dict:
    """The state after an evaluation whose metrics are `metrics`."""
    if self.metric not in metrics:
      raise UserError(f'config.schedule.plateau_metric={self.metric!r} is not among the eval metrics '
                      f'({", ".join(sorted(metrics))}); pick one of them')
    template = self._template()
    current = template._replace(**{name: jnp.asarray(math.inf if state[name] is None else state[name],
                                                     getattr(template, name).dtype) for name in self.FIELDS})
    _, new = self._transform.update({}, current, value=jnp.float32(self.sign * metrics[self.metric]))
    return self._to_json(new)

  @staticmethod
  def _to_json(state) -> dict:
    values = {name: getattr(state, name).item() for name in Plateau.FIELDS}
    return {name: None if value == math.inf else value for name, value in values.items()}  # JSON: no inf
