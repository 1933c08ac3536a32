"""Metrics (clu collections) and where they are written: TensorBoard and metrics.jsonl."""


import functools
import json
import os
from typing import Any, Mapping

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
from clu import metric_writers, metrics


@metrics.flax.struct.dataclass
class Metrics(metrics.Collection):
  """Mean loss and accuracy: of a train step's batch, or summed over eval batches (masked)."""
  loss: metrics.Average.from_output('loss')
  accuracy: metrics.Average.from_output('accuracy')


@jax.jit
def merge_window(window: list[Metrics]) -> Metrics:
  """Merges a log window's per-step metrics in one compiled call, not one dispatch per step."""
  return functools.reduce(lambda merged, step: merged.merge(step), window)


def window_to_json(window: Metrics | None) -> dict | None:
  """The train metrics accumulated since the last log line, for the checkpoint record.

  A run resumed from a checkpoint between two log lines then logs the same
  averages as a run that was never stopped.
  """
  if window is None:
    return None
  return jax.tree.map(lambda x: np.asarray(x).item(), flax.serialization.to_state_dict(window))


def window_from_json(saved: dict | None) -> Metrics | None:
  if saved is None:
    return None
  empty = Metrics.empty()
  restored = flax.serialization.from_state_dict(empty, saved)
  return jax.tree.map(lambda like, value: jnp.asarray(value, like.dtype), empty, restored)


class JsonlWriter(metric_writers.MetricWriter):
  """Appends one JSON object per write_scalars call to `path`: {"step": ..., name: value}.

  Only scalars belong in metrics.jsonl; images, text and the rest go to
  TensorBoard, so this writer ignores them.
  """

  def __init__(self, path: str):
    self._file = open(path, 'a', encoding='utf-8')  # pylint: disable=consider-using-with

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {'step': int(step), **{k: float(v) for k, v in scalars.items()}}
    self._file.write(json.dumps(row) + '\n')

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


def create_writer(workdir: str, *, is_main_process: bool) -> metric_writers.MetricWriter:
  """TensorBoard events + metrics.jsonl from process 0; nothing from the others."""
  if not is_main_process:
    return metric_writers.MultiWriter([])
  return metric_writers.MultiWriter([
      metric_writers.SummaryWriter(workdir),
      JsonlWriter(os.path.join(workdir, 'metrics.jsonl')),
  ])
