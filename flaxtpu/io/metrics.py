"""Metrics: the clu collections the train and eval steps accumulate, and a log window saved with a
checkpoint. Where they are written (TensorBoard, metrics.jsonl, W&B, MLflow): flaxtpu/io/writers.py."""


import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics


@metrics.flax.struct.dataclass
class Metrics(metrics.Collection):
  """Mean loss and accuracy of a train step's batch (multilabel: the exact-match accuracy at 0.5)."""
  loss: metrics.Average.from_output('loss')
  accuracy: metrics.Average.from_output('accuracy')


@metrics.flax.struct.dataclass
class BalancedAccuracy(metrics.Metric):
  """The mean over classes with examples of each class's recall (the fraction of its examples
  classified right): accuracy that every class weighs equally in, however rare.

  Counts per class, so it merges over batches and devices like an average.
  """
  correct: jnp.ndarray  # int32 [classes]
  support: jnp.ndarray  # int32 [classes]

  @classmethod
  def from_model_output(cls, *, label_one_hot: jnp.ndarray, accuracy: jnp.ndarray,
                        mask: jnp.ndarray | None = None, **_) -> 'BalancedAccuracy':
    counted = label_one_hot.astype(jnp.int32)
    if mask is not None:
      counted = counted * mask.astype(jnp.int32)[:, None]
    return cls(correct=(counted * accuracy.astype(jnp.int32)[:, None]).sum(0), support=counted.sum(0))

  def merge(self, other: 'BalancedAccuracy') -> 'BalancedAccuracy':
    return type(self)(correct=self.correct + other.correct, support=self.support + other.support)

  def compute(self) -> jnp.ndarray:
    present = self.support > 0
    recall = jnp.where(present, self.correct / jnp.maximum(self.support, 1), 0.0)
    return recall.sum() / jnp.maximum(present.sum(), 1)


@metrics.flax.struct.dataclass
class EvalMetrics(metrics.Collection):
  """Evaluation of a multiclass model: loss, accuracy and balanced accuracy (masked)."""
  loss: metrics.Average.from_output('loss')
  accuracy: metrics.Average.from_output('accuracy')
  balanced_accuracy: BalancedAccuracy


@metrics.flax.struct.dataclass
class EvalTop5Metrics(metrics.Collection):
  """... with more than 5 classes, also the true class among the 5 highest logits."""
  loss: metrics.Average.from_output('loss')
  accuracy: metrics.Average.from_output('accuracy')
  balanced_accuracy: BalancedAccuracy
  top5_accuracy: metrics.Average.from_output('top5_accuracy')


@metrics.flax.struct.dataclass
class LossMetrics(metrics.Collection):
  """Evaluation of a multilabel model on the devices: the loss. Its ranking metrics (mAP, F1 at a
  threshold) need every example's scores at once: evaluate.py computes them on the host."""
  loss: metrics.Average.from_output('loss')


def window_to_json(window: Metrics | None) -> dict | None:
  """The train metrics accumulated since the last log line, for the checkpoint record.

  A run resumed from a checkpoint between two log lines then logs the same
  averages as a run that was never stopped.
  """
  if window is None:
    return None
  return jax.tree.map(lambda x: np.asarray(x).item(), flax.serialization.to_state_dict(window))


def window_from_json(saved: dict | None, collection=Metrics):
  """`window_to_json`'s record read back into the train step's metric `collection` (None stays None)."""
  if saved is None:
    return None
  empty = collection.empty()
  restored = flax.serialization.from_state_dict(empty, saved)
  return jax.tree.map(lambda like, value: jnp.asarray(value, like.dtype), empty, restored)
