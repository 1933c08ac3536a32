"""TensorBoard event files written without TensorFlow.

clu's `metric_writers` package imports TensorFlow (its `SummaryWriter` writes through `tf.summary`),
and `import tensorflow` takes 15.1 s on a TPU v5e host. `SummaryWriter` here writes the same events
from TensorBoard's own TensorFlow-free pieces: the protos, `RecordWriter` (the TFRecord framing) and
the plugins' `*_pb` functions. Each `write_*` method writes what clu's SummaryWriter writes for it
(`clu/metric_writers/tf/summary_writer.py`): one event per tag and step, holding the tensor and the
plugin's metadata as `tf.summary` writes them; the hparams at step 0; every image of a batch.

It has every method of clu's `MetricWriter`; `flaxtpu.io.writers` registers it as its `MetricWriter`.
Nothing here imports TensorFlow, JAX or clu.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import socket
import time
import wave
from typing import Any, Mapping

import numpy as np
from PIL import Image
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.audio import metadata as audio_metadata
from tensorboard.plugins.histogram.summary_v2 import histogram_pb
from tensorboard.plugins.hparams.summary_v2 import hparams_pb
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.plugins.scalar.summary_v2 import scalar_pb
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

FILE_VERSION = 'brain.Event:2'
_file_counter = itertools.count()  # TensorFlow's: two writers of one process in one second differ by it
_PNG_MODES = {1: 'L', 2: 'LA', 3: 'RGB', 4: 'RGBA'}
_warned_videos: list[bool] = []


def event_file_name(now: float | None = None) -> str:
  """`events.out.tfevents.<seconds>.<host>.<pid>.<counter>.v2`, the name TensorFlow's v2 writer gives."""
  seconds = int(time.time() if now is None else now)
  return f'events.out.tfevents.{seconds}.{socket.gethostname()}.{os.getpid()}.{next(_file_counter)}.v2'


def image_uint8(images) -> np.ndarray:
  """Pixels as `tf.image.convert_image_dtype(images, tf.uint8, saturate=True)` makes them, which
  `tf.summary.image` does: floats in [0, 1] times 255.5, clipped and truncated; wider integers
  divided down (uint16 by 256); uint8 as is."""
  images = np.asarray(images)
  if images.dtype == np.uint8:
    return images
  if images.dtype == np.bool_:
    raise ValueError('images of bools: pass uint8 or float in [0, 1]')
  if np.issubdtype(images.dtype, np.integer):
    top = int(np.iinfo(images.dtype).max)
    if top > 255:
      return np.clip(images // ((top + 1) // 256), 0, 255).astype(np.uint8)
    return (np.clip(images.astype(np.int32), 0, 255) * (256 // (top + 1))).astype(np.uint8)
  if not np.issubdtype(images.dtype, np.floating):  # bfloat16 and other ml_dtypes: in float32
    images = images.astype(np.float32)
  scaled = images * images.dtype.type(255.5)
  return np.clip(np.nan_to_num(scaled), 0, 255).astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
  """One [height, width, channels] uint8 image (1, 2, 3 or 4 channels) as PNG bytes."""
  if image.ndim != 3 or image.shape[-1] not in _PNG_MODES:
    raise ValueError(f'an image is [height, width, 1-4 channels], not {list(image.shape)}')
  channels = image.shape[-1]
  pixels = image[..., 0] if channels == 1 else image
  buffer = io.BytesIO()
  Image.fromarray(np.ascontiguousarray(pixels), _PNG_MODES[channels]).save(buffer, format='PNG')
  return buffer.getvalue()


def image_pb(tag: str, images, max_outputs: int | None = None) -> summary_pb2.Summary:
  """`tf.summary.image`'s summary: a [2 + k] string tensor [width, height, png_0, ..., png_k-1] of the
  first `max_outputs` (default all) of the [k, height, width, channels] images."""
  pixels = image_uint8(images)
  if pixels.ndim != 4:
    raise ValueError(f'images are [k, height, width, channels], not {list(pixels.shape)}')
  limited = pixels if max_outputs is None else pixels[:max_outputs]
  strings = [str(pixels.shape[2]).encode(), str(pixels.shape[1]).encode(),
             *(encode_png(image) for image in limited)]
  tensor = tensor_util.make_tensor_proto(np.array(strings, dtype=np.object_), dtype=np.object_)
  summary = summary_pb2.Summary()
  summary.value.add(tag=tag, tensor=tensor,
                    metadata=image_metadata.create_summary_metadata(display_name=None, description=None))
  return summary


def encode_wav(audio: np.ndarray, sample_rate: int) -> bytes:
  """`tf.audio.encode_wav`: [time, channels] floats in [-1, 1] as 16-bit PCM, each sample
  round(x * 32768) clipped to int16."""
  scaled = np.asarray(audio, np.float32) * np.float32(32768)
  rounded = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))  # C's roundf: halves away from 0
  samples = np.clip(np.nan_to_num(rounded), -32768, 32767).astype('<i2')
  buffer = io.BytesIO()
  with wave.open(buffer, 'wb') as f:
    f.setnchannels(samples.shape[1])
    f.setsampwidth(2)
    f.setframerate(int(sample_rate))
    f.writeframes(samples.tobytes())
  return buffer.getvalue()


def audio_pb(tag: str, audios, sample_rate: int, max_outputs: int | None = None) -> summary_pb2.Summary:
  """`tf.summary.audio`'s summary: a [k, 2] string tensor of (WAV bytes, empty label) rows."""
  audios = np.asarray(audios)
  if audios.ndim != 3:
    raise ValueError(f'audios are [k, time, channels], not {list(audios.shape)}')
  limited = audios if max_outputs is None else audios[:max_outputs]
  rows = np.array([[encode_wav(audio, sample_rate), b''] for audio in limited],
                  dtype=np.object_).reshape(-1, 2)
  tensor = tensor_util.make_tensor_proto(rows, dtype=np.object_)
  summary = summary_pb2.Summary()
  summary.value.add(tag=tag, tensor=tensor, metadata=audio_metadata.create_summary_metadata(
      display_name=None, description=None, encoding=audio_metadata.Encoding.Value('WAV')))
  return summary


def _tensor_value(value) -> np.ndarray:
  """A value as `tf.summary.write` converts it: numpy and JAX arrays keep their dtype; Python floats
  and ints (and lists of them) become float32 and int32, as `tf.convert_to_tensor` makes them."""
  if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, '__array__'):
    return np.asarray(value)
  array = np.asarray(value)
  if array.dtype == np.float64:
    return array.astype(np.float32)
  if array.dtype == np.int64 and np.all(np.abs(array) < 2**31):
    return array.astype(np.int32)
  return array


def _summary_metadata(metadata) -> summary_pb2.SummaryMetadata | None:
  """`tf.summary.write`'s metadata argument: None, serialized bytes or a SummaryMetadata proto (this
  module's or TensorFlow's)."""
  if metadata is None:
    return None
  if isinstance(metadata, summary_pb2.SummaryMetadata):
    return metadata
  if isinstance(metadata, bytes):
    return summary_pb2.SummaryMetadata.FromString(metadata)
  return summary_pb2.SummaryMetadata.FromString(metadata.SerializeToString())


def flatten_hparams(hparams: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, Any]:
  """clu's `flatten_dict` for `write_hparams`: nested keys joined by dots, list items by index, None
  as ''."""
  flat = {}
  for key, value in hparams.items():
    if isinstance(value, Mapping) or hasattr(value, 'items'):
      flat.update(flatten_hparams(value, prefix + (key,)))
    elif isinstance(value, (list, tuple)):
      flat.update(flatten_hparams({str(i): item for i, item in enumerate(value)}, prefix + (key,)))
    else:
      flat['.'.join(prefix + (key,))] = '' if value is None else value
  return flat


class SummaryWriter:
  """TensorBoard events in `logdir` (a local directory), written as clu's `SummaryWriter` writes them
  but without TensorFlow. One new event file per writer, like TensorFlow's."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    self.path = os.path.join(logdir, event_file_name(now))
    self._records = RecordWriter(open(self.path, 'wb'))  # pylint: disable=consider-using-with
    self._write(event_pb2.Event(wall_time=int(now), file_version=FILE_VERSION,
                                source_metadata=event_pb2.SourceMetadata(writer='flaxtpu.events')))
    self._records.flush()

  def _write(self, event: event_pb2.Event) -> None:
    self._records.write(event.SerializeToString())

  def write_summary(self, step: int, summary: summary_pb2.Summary) -> None:
    """One event at `step` for each of the summary's values, as TensorFlow's writer does."""
    for value in summary.value:
      event = event_pb2.Event(wall_time=time.time(), step=int(step))
      event.summary.value.append(value)
      self._write(event)

  def write_summaries(self, step: int, values: Mapping[str, Any],
                      metadata: Mapping[str, Any] | None = None):
    for key, value in values.items():
      summary = summary_pb2.Summary()
      entry = summary.value.add(tag=key, tensor=tensor_util.make_tensor_proto(_tensor_value(value)))
      md = _summary_metadata(metadata.get(key) if metadata is not None else None)
      if md is not None:
        entry.metadata.CopyFrom(md)
      self.write_summary(step, summary)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    for key, value in scalars.items():
      self.write_summary(step, scalar_pb(key, np.asarray(value)))

  def write_images(self, step: int, images: Mapping[str, Any]):
    for key, value in images.items():
      value = np.asarray(value)
      if value.ndim == 3:
        value = value[None]
      self.write_summary(step, image_pb(key, value, max_outputs=value.shape[0]))

  def write_videos(self, step: int, videos: Mapping[str, Any]):
    if not _warned_videos:  # clu's SummaryWriter: one warning a process
      _warned_videos.append(True)
      logging.warning('SummaryWriter does not support writing videos.')

  def write_audios(self, step: int, audios: Mapping[str, Any], *, sample_rate: int):
    for key, value in audios.items():
      value = np.asarray(value)
      self.write_summary(step, audio_pb(key, value, sample_rate, max_outputs=value.shape[0]))

  def write_texts(self, step: int, texts: Mapping[str, str]):
    for key, value in texts.items():
      self.write_summary(step, text_pb(key, value))

  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None):
    for key, value in arrays.items():
      buckets = None if num_buckets is None else num_buckets.get(key)
      self.write_summary(step, histogram_pb(key, np.asarray(value), buckets=buckets))

  def write_hparams(self, hparams: Mapping[str, Any]):
    self.write_summary(0, hparams_pb(flatten_hparams(hparams)))  # tensorboard's hparams(): at step 0

  def flush(self):
    if not self._records.closed:
      self._records.flush()

  def close(self):
    if not self._records.closed:
      self._records.flush()
      self._records.close()
