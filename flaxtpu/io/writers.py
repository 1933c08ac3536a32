"""Where metrics go: TensorBoard events, metrics.jsonl, and W&B or MLflow where configured.

Apart from the metric collections (flaxtpu/io/metrics.py), which the compiled steps import: this
side imports TensorBoard's pieces (0.9 s on a TPU v5e host), which the train step does not need.
"""

import abc
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from flaxtpu.io import events, files, storage


class MetricWriter(abc.ABC):
  """Where metrics go. It mirrors `clu.metric_writers.interface.MetricWriter` (the same methods and
  signatures), which cannot be imported without TensorFlow: `clu/metric_writers/__init__.py` imports
  clu's TensorFlow SummaryWriter (`import tensorflow`: 15.1 s on a TPU v5e host). flaxtpu's writers
  derive from this one.
  """

  @abc.abstractmethod
  def write_summaries(self, step: int, values: Mapping[str, Any],
                      metadata: Mapping[str, Any] | None = None):
    """Arbitrary tensors (`values`), each with an optional SummaryMetadata proto or its bytes."""

  @abc.abstractmethod
  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    """Scalar values at `step`, by name."""

  @abc.abstractmethod
  def write_images(self, step: int, images: Mapping[str, Any]):
    """Images [N, H, W, C] or [H, W, C] (C 1, 3 or 4; uint8, or float in [0, 1]) at `step`, by name."""

  @abc.abstractmethod
  def write_videos(self, step: int, videos: Mapping[str, Any]):
    """Videos [N, T, H, W, C] or [T, H, W, C] at `step`, by name."""

  @abc.abstractmethod
  def write_audios(self, step: int, audios: Mapping[str, Any], *, sample_rate: int):
    """Audio [N, T, C], floats in [-1, 1], at `step`, by name."""

  @abc.abstractmethod
  def write_texts(self, step: int, texts: Mapping[str, str]):
    """Text snippets at `step`, by name."""

  @abc.abstractmethod
  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None):
    """Histograms of `arrays` at `step`, by name, with `num_buckets[name]` buckets (else a default)."""

  @abc.abstractmethod
  def write_hparams(self, hparams: Mapping[str, Any]):
    """The hyperparameters, a flat mapping from name to value; once a run."""

  @abc.abstractmethod
  def flush(self):
    """Writes out whatever is buffered."""

  @abc.abstractmethod
  def close(self):
    """Flushes and closes; no call after it."""


# TensorBoard's events writer has every method above; it does not import this module (nor JAX, nor clu).
MetricWriter.register(events.SummaryWriter)


class MultiWriter(MetricWriter):
  """Every call forwarded to each of `writers`, in order (clu's `MultiWriter`)."""

  def __init__(self, writers: Sequence[MetricWriter]):
    self._writers = tuple(writers)

  def write_summaries(self, step, values, metadata=None):
    for w in self._writers:
      w.write_summaries(step, values, metadata)

  def write_scalars(self, step, scalars):
    for w in self._writers:
      w.write_scalars(step, scalars)

  def write_images(self, step, images):
    for w in self._writers:
      w.write_images(step, images)

  def write_videos(self, step, videos):
    for w in self._writers:
      w.write_videos(step, videos)

  def write_audios(self, step, audios, *, sample_rate):
    for w in self._writers:
      w.write_audios(step, audios, sample_rate=sample_rate)

  def write_texts(self, step, texts):
    for w in self._writers:
      w.write_texts(step, texts)

  def write_histograms(self, step, arrays, num_buckets=None):
    for w in self._writers:
      w.write_histograms(step, arrays, num_buckets)

  def write_hparams(self, hparams):
    for w in self._writers:
      w.write_hparams(hparams)

  def flush(self):
    for w in self._writers:
      w.flush()

  def close(self):
    for w in self._writers:
      w.close()


class JsonlWriter(MetricWriter):
  """Appends one JSON object per write_scalars call to `path`: {"step": ..., name: value}.

  Only scalars belong in metrics.jsonl; images, text and the rest go to
  TensorBoard, so this writer ignores them.
  """

  def __init__(self, path: str):
    self._path = path
    if storage.is_remote(path):  # an object cannot be appended to: it is rewritten whole on flush
      self._file, self._lines = None, [json.dumps(row) + '\n' for row in files.read_jsonl(path)]
      self._flushed = len(self._lines)
    else:
      self._file = open(path, 'a', encoding='utf-8')  # pylint: disable=consider-using-with

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {'step': int(step), **{k: float(v) for k, v in scalars.items()}}
    if self._file is None:
      self._lines.append(json.dumps(row) + '\n')
    else:
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
    if self._file is not None:
      self._file.flush()
    elif len(self._lines) != self._flushed:
      files.atomic_write(self._path, lambda temporary: _write_lines(temporary, self._lines))
      self._flushed = len(self._lines)

  def close(self):
    if self._file is not None:
      self._file.close()
    else:
      self.flush()


def _write_lines(path: str, lines: list[str]) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(lines)


class StagedSummaryWriter(events.SummaryWriter):
  """The TensorBoard writer for a workdir on an object store (gs://, s3://): the events writer writes
  local files only, so events are written to a local directory and each flush copies the event files,
  whole, to the workdir with etils.epath (which any store's emulator can stand in for)."""

  def __init__(self, workdir: str):
    self._staging = tempfile.mkdtemp(prefix='flaxtpu-events-')
    self._workdir = workdir
    self._copied: dict[str, int] = {}
    super().__init__(self._staging)

  def flush(self):
    super().flush()
    for name in os.listdir(self._staging):
      size = os.path.getsize(os.path.join(self._staging, name))
      if self._copied.get(name) != size:
        files.atomic_write(files.join(self._workdir, name),
                           functools.partial(shutil.copyfile, os.path.join(self._staging, name)))
        self._copied[name] = size

  def close(self):
    super().close()
    self.flush()
    shutil.rmtree(self._staging, ignore_errors=True)


class ScalarWriter(MetricWriter):
  """A tracker's writer (W&B, MLflow): what it does not record (summaries, videos, audio, histograms;
  images and texts unless it says otherwise) is a no-op."""

  def write_images(self, step, images):
    pass

  def write_texts(self, step, texts):
    pass

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def flush(self):
    pass


class WandbWriter(ScalarWriter):
  """Weights & Biases as one more metric writer: scalars, images, texts and the config.

  One W&B run per workdir (its id is derived from the workdir), so a resumed
  training run keeps appending to the same W&B run.
  """

  def __init__(self, workdir: str, project: str, entity: str, mode: str, config: Mapping[str, Any]):
    import wandb  # pylint: disable=g-import-not-at-top
    self._wandb = wandb
    run_id = hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:16]
    self._run = wandb.init(project=project, entity=entity or None, mode=mode, dir=workdir, id=run_id,
                           name=os.path.basename(os.path.abspath(workdir)), resume='allow',
                           config=dict(config))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    self._run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

  def write_images(self, step: int, images: Mapping[str, Any]):
    self._run.log({k: [self._wandb.Image(np.asarray(image)) for image in v] for k, v in images.items()},
                  step=int(step))

  def write_texts(self, step: int, texts: Mapping[str, str]):
    self._run.log({k: self._wandb.Html(f'<pre>{v}</pre>') for k, v in texts.items()}, step=int(step))

  def write_hparams(self, hparams: Mapping[str, Any]):
    self._run.config.update(dict(hparams), allow_val_change=True)


  def close(self):
    self._run.finish()


class MlflowWriter(ScalarWriter):
  """MLflow as one more metric writer (flaxtpu/io/tracking.py): the config as parameters, scalars at their
  step. Images and texts go to TensorBoard only; the end's pictures become artifacts."""

  def __init__(self, workdir: str, tracking_uri: str, experiment: str):
    from flaxtpu.io import tracking  # pylint: disable=g-import-not-at-top
    self._tracking = tracking
    self._tracker = tracking.tracker(tracking_uri, experiment)
    self._run_id, self._resumed = tracking.open_run(self._tracker, workdir,
                                                    parent=os.environ.get(tracking.PARENT_ENV, ''))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    if self._run_id:
      self._tracking.log_metrics(self._tracker, self._run_id, step, scalars, int(time.time() * 1000))

  def write_hparams(self, hparams: Mapping[str, Any]):
    if self._run_id and not self._resumed:  # MLflow refuses to log a parameter twice
      self._tracking.log_params(self._tracker, self._run_id, hparams)


  def close(self):
    # Stopped before its end: a resumed run sets it running again; a finished one ends it FINISHED.
    if self._run_id:
      self._tracking.end_run(self._tracker, self._run_id, 'KILLED')


def flat_hparams(config: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """The config as {'optimizer.learning_rate': 0.1, ...}: the scalars TensorBoard's HParams plugin takes."""
  flat = {}
  for key, value in config.items():
    if isinstance(value, Mapping):
      flat.update(flat_hparams(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value if isinstance(value, (bool, int, float, str)) else str(value)
  return flat


class OptionalWriter(MetricWriter):
  """A writer whose failure never stops training (TensorBoard, W&B): its first exception, when it starts
  or at any write, is one warning naming it, and it writes nothing more this run; metrics.jsonl (written
  beside it) keeps every row."""

  def __init__(self, name: str, create: Callable[[], MetricWriter]):
    self.name, self.writer = name, None
    self.writer = self._guarded('its start', create)

  def _guarded(self, doing: str, call: Callable[..., Any], *args, **kwargs) -> Any:
    try:
      return call(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except  # any library's error: the run goes on
      logging.warning('%s failed in %s (%s); training goes on without it (metrics.jsonl keeps every '
                      'metric)', self.name, doing, files.short_error(e, 300))
      self.writer = None
      return None

  def _forward(method: str):  # pylint: disable=no-self-argument
    def forward(self, *args, **kwargs):
      if self.writer is not None:
        self._guarded(method, getattr(self.writer, method), *args, **kwargs)
    return forward

  write_summaries, write_scalars, write_images = (
      _forward('write_summaries'), _forward('write_scalars'), _forward('write_images'))
  write_videos, write_audios, write_texts = (
      _forward('write_videos'), _forward('write_audios'), _forward('write_texts'))
  write_histograms, write_hparams = _forward('write_histograms'), _forward('write_hparams')
  flush, close = _forward('flush'), _forward('close')


def create_writer(workdir: str, *, is_main_process: bool,
                  config: Mapping[str, Any] | None = None) -> MetricWriter:
  """TensorBoard events + metrics.jsonl (+ W&B when config.wandb.project is set, + MLflow when
  config.mlflow.tracking_uri is) from process 0.

  TensorBoard and W&B are `OptionalWriter`s and MLflow warns once by itself: a failing tracker never
  stops training; metrics.jsonl is the run's own record (its failures stop the run like a checkpoint's).
  """
  if not is_main_process:
    return MultiWriter([])
  staged = storage.is_remote(workdir)
  tensorboard = OptionalWriter('TensorBoard', lambda: StagedSummaryWriter(workdir) if staged
                               else events.SummaryWriter(workdir))
  writers = [tensorboard, JsonlWriter(os.path.join(workdir, 'metrics.jsonl'))]
  if config is not None and config.wandb.project:
    wandb = config.wandb
    writers.append(OptionalWriter('Weights & Biases', lambda: WandbWriter(
        workdir, wandb.project, wandb.entity, wandb.mode, flat_hparams(config.to_dict()))))
  if config is not None and config.mlflow.tracking_uri:
    writers.append(MlflowWriter(workdir, config.mlflow.tracking_uri, config.mlflow.experiment))
  return MultiWriter(writers)
