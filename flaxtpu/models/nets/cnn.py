"""The Keras/TPU recipe's CNN, layer for layer (20,042 parameters at 10 classes).

    keras.Sequential([Conv2D(32, 3, activation='relu'), MaxPooling2D(),
                      Conv2D(64, 3, activation='relu'), GlobalAveragePooling2D(),
                      Dense(num_classes, activation='softmax')])

The softmax lives in the loss, so the model returns logits.
"""

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp


class ConvStage(nn.Module):
  """3x3 VALID convolution + ReLU, optionally followed by 2x2 max pooling: one remat unit."""
  features: int
  pool: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(self.features, (3, 3), padding='VALID', dtype=self.dtype)(x))
    if self.pool:
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    return x


class CNN(nn.Module):
  num_classes: int
  dtype: Any = jnp.float32
  stage: Callable[..., nn.Module] = ConvStage  # nn.remat(ConvStage, ...) to recompute in the backward pass

  # Explicit names: the same parameter tree with and without remat.
  @nn.compact
  def __call__(self, x, train: bool = True):
    del train  # no dropout or batch norm: train and eval are the same function
    x = self.stage(32, pool=True, dtype=self.dtype, name='stage1')(x.astype(self.dtype))
    x = self.stage(64, pool=False, dtype=self.dtype, name='stage2')(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)
