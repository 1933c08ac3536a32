"""`loss=bce`: a sigmoid binary cross-entropy per class for single-label training, as timm's
BinaryCrossEntropy (the ResNet-strikes-back and DeiT III recipes).

The targets are the train step's: one-hot, smoothed (`label_smoothing`: 1 - s
+ s / C for the class, s / C for the others, timm's on/off values) and mixed by
mixup/CutMix. With `bce_target_threshold` t > 0 they are binarised: above t
-> 1, else 0 (timm's `target_threshold`; 0.2 in its recipes, so both classes
of a mixed pair stay positive and smoothing's small values drop to 0). The
loss of an example is the mean over the classes (timm's default) or their sum
(`bce_sum`, timm's `--bce-sum`: C times larger, the scale of the softmax
loss), each class's term times its class weight when `dataset.class_weights`
sets them. Evaluation is unchanged: accuracy from the argmax and `eval_loss`
the softmax cross-entropy, as timm validates with CrossEntropyLoss.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Bce:
  """The options of `loss=bce`."""
  threshold: float = 0.0  # > 0: targets above it -> 1, others -> 0
  sum_classes: bool = False  # sum over the classes instead of the mean


def from_config(config: ml_collections.ConfigDict) -> Optional[Bce]:
  """The config's `Bce`, or None for the softmax loss (and for task=multilabel, sigmoid already)."""
  if config.get('loss', 'softmax') != 'bce' or config.task == 'multilabel':
    return None
  return Bce(threshold=float(config.bce_target_threshold), sum_classes=bool(config.bce_sum))


def binarized(targets: jax.Array, threshold: float) -> jax.Array:
  """`targets` > threshold as 1.0/0.0 when threshold > 0, else the targets themselves."""
  return (targets > threshold).astype(targets.dtype) if threshold > 0 else targets


def loss_per_example(logits: jax.Array, targets: jax.Array, options: Bce,
                     class_weights: Optional[np.ndarray] = None) -> jax.Array:
  """float32 [batch]: each example's binary cross-entropy over its classes (mean or sum)."""
  targets = binarized(targets.astype(jnp.float32), options.threshold)
  terms = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), targets)
  if class_weights is not None:
    terms = terms * jnp.asarray(class_weights)
  return terms.sum(-1) if options.sum_classes else terms.mean(-1)
