"""The per-example loss and accuracy that train and eval steps share (targets from labels, cross-entropy
weighted by class, exact-match accuracy): pure functions of arrays, no state."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flaxtpu.loss import bce as bce_loss


def label_targets(labels: jax.Array, task) -> jax.Array:
  """float32 [batch, classes] targets of a batch's labels: one-hot of int [batch] class indices
  (multiclass), or the uint8 [batch, classes] multi-hot rows themselves (multilabel)."""
  if task.multilabel:
    return labels.astype(jnp.float32)
  return jax.nn.one_hot(labels, task.num_classes)


def loss_per_example(logits: jax.Array, targets: jax.Array, hard_targets: jax.Array, *,
                     multilabel: bool, class_weights: Optional[np.ndarray] = None,
                     bce: Optional[bce_loss.Bce] = None) -> jax.Array:
  """float32 [batch]: each example's cross-entropy, weighted by class as Keras' `class_weight`.

  Multiclass: softmax cross-entropy with the (smoothed, mixed) `targets`, times the weight of the
  example's class: `hard_targets` (one-hot, mixed by mixup/CutMix) @ class_weights, which is
  weight[label] for an unmixed example. Multilabel: a sigmoid cross-entropy per class, each class's
  term times its weight, summed over the classes (big_vision's sigmoid_xent), so an example's loss
  and its gradients are on the scale of the softmax loss and its learning rates carry over (timm's
  BCE averages over the classes: C times smaller). `bce` (loss=bce): single-label sigmoid
  cross-entropy, `bce.loss_per_example`.
  """
  logits = logits.astype(jnp.float32)
  if bce is not None and not multilabel:  # loss=bce: timm's BinaryCrossEntropy (flaxtpu/loss/bce.py)
    return bce_loss.loss_per_example(logits, targets, bce, class_weights)
  if multilabel:
    terms = optax.sigmoid_binary_cross_entropy(logits, targets)
    if class_weights is not None:
      terms = terms * jnp.asarray(class_weights)
    return terms.sum(-1)
  losses = optax.softmax_cross_entropy(logits, targets)
  if class_weights is not None:
    losses = losses * (hard_targets @ jnp.asarray(class_weights))
  return losses


def batch_accuracy(logits: jax.Array, labels: jax.Array, multilabel: bool) -> jax.Array:
  """float32 [batch]: 1 where the prediction is right. Multilabel: exact match, every tag's sigmoid
  on the right side of 0.5 (logit 0), so an image counts only with its whole tag set right."""
  if multilabel:
    return jnp.all((logits >= 0) == (labels > 0), axis=-1).astype(jnp.float32)
  return (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
