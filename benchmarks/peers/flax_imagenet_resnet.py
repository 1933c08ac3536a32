"""The Flax ImageNet example's ResNet-50 and train step, written plainly: the peer of flaxtpu's step.

Follows google/flax `examples/imagenet` (models.py, train.py): ResNet v1.5
(the stride on the bottleneck's 3x3 convolution), convolutions without bias,
BatchNorm with momentum 0.9 and epsilon 1e-5 whose last scale in each block
starts at zero, a 7x7 stem and a 3x3 max pool, global average pool, dense
head; compute in `dtype` (bfloat16 on a TPU) with float32 parameters;
softmax cross-entropy on one-hot labels plus the example's L2 penalty
(1e-4 x 0.5 ||w||^2 on every kernel, not on biases or BatchNorm), SGD with
Nesterov momentum 0.9 on a warmup + cosine schedule, one `jax.jit` step that
donates the state.

One departure, kept small on purpose: the example normalises images in
tf.data and sends float batches, this step takes uint8 batches and
normalises on the device (the same arithmetic, a quarter of the float32
bytes over the host link), so it eats what flaxtpu's step and
`benchmarks.input.input_pipeline.tf_batches` both produce.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

# The example's ImageNet statistics, on the 0-255 scale (input_pipeline.py's MEAN_RGB / STDDEV_RGB).
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)
WEIGHT_DECAY = 1e-4


class Bottleneck(nn.Module):
  """1x1 -> 3x3 (strided: v1.5) -> 1x1 x4, with a projection where the shape changes."""
  filters: int
  conv: Callable
  norm: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)  # each block starts as the identity
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name='conv_proj')(residual)
      residual = self.norm(name='norm_proj')(residual)
    return nn.relu(residual + y)


class ResNet(nn.Module):
  """ResNet v1.5 as the example builds it; `stage_sizes` (3, 4, 6, 3) is ResNet-50."""
  num_classes: int
  stage_sizes: Sequence[int] = (3, 4, 6, 3)
  num_filters: int = 64
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                             dtype=self.dtype)
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name='conv_init')(x)
    x = nn.relu(norm(name='bn_init')(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
    for stage, blocks in enumerate(self.stage_sizes):
      for block in range(blocks):
        strides = (2, 2) if stage > 0 and block == 0 else (1, 1)
        x = Bottleneck(self.num_filters * 2**stage, conv=conv, norm=norm, strides=strides)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, self.dtype)


class TrainState(train_state.TrainState):
  batch_stats: Any


def learning_rate_schedule(base_rate: float, steps_per_epoch: int, warmup_epochs: float = 5.0,
                           num_epochs: float = 90.0) -> optax.Schedule:
  """The example's linear warmup then cosine decay, per step."""
  warmup = int(warmup_epochs * steps_per_epoch)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, base_rate, warmup),
       optax.cosine_decay_schedule(base_rate, int((num_epochs - warmup_epochs) * steps_per_epoch))],
      [warmup])


def create_state(model: ResNet, image_size: int, batch_size: int, seed: int = 0,
                 steps_per_epoch: int = 5000) -> TrainState:
  """Parameters (float32) and BatchNorm statistics from a jitted init; SGD + Nesterov 0.9 at the
  example's 0.1 x batch / 256."""
  init = jax.jit(functools.partial(model.init, train=False))
  variables = init(jax.random.PRNGKey(seed), jnp.ones((1, image_size, image_size, 3), model.dtype))
  schedule = learning_rate_schedule(0.1 * batch_size / 256, steps_per_epoch)
  return TrainState.create(apply_fn=model.apply, params=variables['params'],
                           batch_stats=variables['batch_stats'],
                           tx=optax.sgd(schedule, momentum=0.9, nesterov=True))


def train_step(state: TrainState, images: jax.Array, labels: jax.Array, *, num_classes: int,
               dtype: Any) -> tuple[TrainState, dict]:
  """One step on uint8 images [B, H, W, 3] and int32 labels [B]: loss, gradients, update."""
  mean, std = jnp.asarray(MEAN_RGB, jnp.float32), jnp.asarray(STDDEV_RGB, jnp.float32)
  inputs = ((images.astype(jnp.float32) - mean) / std).astype(dtype)

  def loss_fn(params):
    logits, updates = state.apply_fn({'params': params, 'batch_stats': state.batch_stats}, inputs,
                                     mutable=['batch_stats'])
    one_hot = jax.nn.one_hot(labels, num_classes)
    loss = jnp.mean(optax.softmax_cross_entropy(logits.astype(jnp.float32), one_hot))
    l2 = sum(jnp.sum(p**2) for p in jax.tree_util.tree_leaves(params) if p.ndim > 1)
    return loss + WEIGHT_DECAY * 0.5 * l2, (updates, logits)

  (loss, (updates, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads, batch_stats=updates['batch_stats'])
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  return state, {'loss': loss, 'accuracy': accuracy}


def build(batch_size: int, image_size: int, num_classes: int = 1000, dtype: Any = jnp.bfloat16,
          seed: int = 0):
  """(state, compiled step, XLA's FLOPs per step): the step compiled ahead of time, called as
  step(state, images, labels) on uint8 [B, S, S, 3] and int32 [B] device arrays."""
  model = ResNet(num_classes=num_classes, dtype=dtype)
  state = create_state(model, image_size, batch_size, seed)
  step = jax.jit(functools.partial(train_step, num_classes=num_classes, dtype=dtype), donate_argnums=0)
  images = jax.ShapeDtypeStruct((batch_size, image_size, image_size, 3), jnp.uint8)
  labels = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  compiled = step.lower(state, images, labels).compile()
  return state, compiled, flops_of(compiled)


def cost_of(compiled, key: str) -> float:
  """`key` ('flops', 'bytes accessed') of one call as XLA's cost analysis counts it (0 where the backend
  does not say)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get(key, 0.0))


def flops_of(compiled) -> float:
  """FLOPs of one call as XLA's cost analysis counts them (0 where the backend does not say)."""
  return cost_of(compiled, 'flops')


def random_batch(batch_size: int, image_size: int, num_classes: int = 1000, seed: int = 0):
  """uint8 images and int32 labels on the host, the same for every contestant."""
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 256, (batch_size, image_size, image_size, 3), np.uint8),
          rng.integers(0, num_classes, batch_size).astype(np.int32))
