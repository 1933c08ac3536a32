"""float16 training's dynamic loss scale (flax.training.dynamic_scale.DynamicScale), kept in the optimizer
state so that it is checkpointed, restored and sharded with it, and runs without it keep their layout.

A step whose gradients overflow is skipped (parameters, statistics and optimizer state kept) and the
scale halves; after `growth_interval` finite steps it doubles. The train step reads it with `get` and
writes it back with `put`; `reported` decides which steps' losses count in the train metrics.
"""


from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from clu import metrics
from flax.training.dynamic_scale import DynamicScale

INITIAL_SCALE = 2.0 ** 16  # flax's, PyTorch's GradScaler's and jmp's start
FLOOR = 1.0  # a step that still overflows at this scale has really diverged


class LossScaleState(NamedTuple):
  inner: Any  # the optimizer's state
  dynamic_scale: DynamicScale


def wrap(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` with a DynamicScale beside its state; its updates pass through unchanged."""

  def init(params):
    scale = DynamicScale(fin_steps=jnp.zeros([], jnp.int32), scale=jnp.full([], INITIAL_SCALE, jnp.float32))
    return LossScaleState(inner.init(params), scale)

  def update(grads, state, params=None):
    updates, inner_state = inner.update(grads, state.inner, params)
    return updates, LossScaleState(inner_state, state.dynamic_scale)

  return optax.GradientTransformation(init, update)


def get(opt_state) -> Optional[DynamicScale]:
  return opt_state.dynamic_scale if isinstance(opt_state, LossScaleState) else None


def put(opt_state, dynamic_scale: DynamicScale):
  return opt_state._replace(dynamic_scale=dynamic_scale)


def keep_if_finite(finite: jax.Array, new, old):
  """`new` where the step's gradients were finite, else `old`: a skipped step changes nothing."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def reported(finite: jax.Array, scale_before: jax.Array) -> jax.Array:
  """Whether a step's loss counts in the train metrics: every finite step, and an overflowing one at the
  floor scale (a real divergence, whose NaN/Inf loss then stops the run as in float32)."""
  return finite | (scale_before <= FLOOR)


@metrics.flax.struct.dataclass
class _Counted(metrics.Average):
  """The mean of the steps whose `reported` is set (0 where none is: a window of skipped steps)."""

  @classmethod
  def from_step(cls, value: jax.Array, reported: jax.Array) -> '_Counted':
    return cls(total=jnp.where(reported, value, 0.0).astype(jnp.float32), count=reported.astype(jnp.int32))

  def compute(self) -> jax.Array:
    return jnp.where(self.count > 0, self.total / jnp.maximum(self.count, 1), 0.0)


def _counted(name: str):
  @metrics.flax.struct.dataclass
  class Counted(_Counted):
    @classmethod
    def from_model_output(cls, **outputs) -> '_Counted':
      return cls.from_step(outputs[name], outputs['reported'])
  return Counted


@metrics.flax.struct.dataclass
class _Total(metrics.Average):
  """A sum over the steps (skipped steps in a log window)."""

  @classmethod
  def from_model_output(cls, **outputs) -> '_Total':
    return cls(total=outputs['skipped'].astype(jnp.float32), count=jnp.array(1, jnp.int32))

  def compute(self) -> jax.Array:
    return self.total


@metrics.flax.struct.dataclass
class Metrics(metrics.Collection):
  """A float16 train step's metrics: loss and accuracy of the steps that counted (`reported`), the loss
  scale of the window's last step, and how many steps of the window were skipped."""
  loss: _counted('loss')
  accuracy: _counted('accuracy')
  loss_scale: metrics.LastValue.from_output('loss_scale')
  skipped_steps: _Total
