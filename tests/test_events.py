"""TensorBoard events written without TensorFlow (flaxtpu/io/events.py): what they hold, read back with
TensorFlow's own reader; the same as clu's TensorFlow SummaryWriter writes; and a training run that
never imports TensorFlow."""

import glob
import io
import json
import os
import re
import socket
import subprocess
import sys
import wave

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, cli_env
from flaxtpu.io import events, writers


def read_events(logdir):
  """Every event of the event files in `logdir`, in order, through TensorFlow's reader (which checks the
  records' CRCs)."""
  import tensorflow as tf
  paths = sorted(glob.glob(os.path.join(logdir, 'events.out.tfevents.*')))
  return [event for path in paths for event in tf.compat.v1.train.summary_iterator(path)]


def values(logdir):
  """(tag, step, plugin, value) of every summary value, the value decoded: scalars as floats, text as a
  str, images as (width, height, [pixels of each PNG]), audio as (channels, rate, [samples]), the
  hparams as their plugin data without the start time."""
  from tensorboard.plugins.hparams import plugin_data_pb2
  from tensorboard.util import tensor_util
  out = []
  for event in read_events(logdir):
    for value in event.summary.value:
      plugin = value.metadata.plugin_data.plugin_name
      array = tensor_util.make_ndarray(value.tensor)
      if plugin == 'scalars':
        decoded = float(array)
      elif plugin == 'text':
        decoded = array.item().decode()
      elif plugin == 'images':
        decoded = (int(array[0]), int(array[1]),
                   [np.asarray(Image.open(io.BytesIO(png))).tolist() for png in array[2:]])
      elif plugin == 'audio':
        decoded = [_wav(row[0]) for row in array] + [row[1] for row in array]
      elif plugin == 'hparams':
        data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
        data.session_start_info.ClearField('start_time_secs')
        decoded = data.SerializeToString(deterministic=True)
      else:
        decoded = (str(array.dtype), array.tolist())
      out.append((value.tag, event.step, plugin, decoded))
  return out


def _wav(data):
  with wave.open(io.BytesIO(data)) as f:
    return f.getnchannels(), f.getframerate(), np.frombuffer(f.readframes(f.getnframes()), '<i2').tolist()


RNG = np.random.default_rng(0)
IMAGES = {
    'rgb_uint8': RNG.integers(0, 256, (3, 5, 7, 3)).astype(np.uint8),
    'grey_float': RNG.random((2, 4, 6, 1)).astype(np.float32) * 1.2 - 0.1,  # clipped to [0, 1]
    'rgba_one': RNG.integers(0, 256, (6, 4, 4)).astype(np.uint8),  # [H, W, C]: a batch of one
    'uint16': RNG.integers(0, 65536, (1, 3, 3, 3)).astype(np.uint16),
}
WEIGHTS = RNG.normal(size=1000)
# 2 clips of 50 samples, 2 channels, some beyond [-1, 1] (clipped)
TONE = (np.sin(np.linspace(0, 20, 200)).reshape(2, 50, 2) * 1.1).astype(np.float32)
HPARAMS = {'optimizer': {'name': 'adam', 'learning_rate': 3e-3}, 'batch_size': 32, 'ema': False,
           'augment': None, 'crop': [0.08, 1.0]}


def write_everything(writer):
  """One of each kind of write, at steps 1 and 2."""
  writer.write_hparams(HPARAMS)
  for step in (1, 2):
    writer.write_scalars(step, {'train_loss': 1.0 / step, 'train_accuracy': np.float32(0.25 * step),
                                'learning_rate': np.float64(1e-3) / step})
  writer.write_texts(1, {'parameters': '<pre>| Dense_0/bias | (10,) |</pre>'})
  writer.write_images(1, IMAGES)
  writer.write_histograms(2, {'weights': WEIGHTS, 'constant': np.full(7, 2.5)}, num_buckets={'weights': 12})
  writer.write_audios(2, {'tone': TONE}, sample_rate=8000)
  writer.write_summaries(2, {'raw': np.arange(6, dtype=np.int64).reshape(2, 3), 'pyfloat': 0.5})
  writer.flush()
  writer.close()


def test_importing_the_writers_imports_no_tensorflow():
  script = ('import sys, flaxtpu.io.events, flaxtpu.io.writers; '
            'print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras")))')
  result = subprocess.run([sys.executable, '-c', script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=True)
  assert result.stdout.strip() == '[]'


def test_events_read_back_with_what_was_written(tmp_path):
  write_everything(events.SummaryWriter(str(tmp_path)))
  names = os.listdir(tmp_path)
  host = re.escape(socket.gethostname())
  assert len(names) == 1
  assert re.fullmatch(rf'events\.out\.tfevents\.\d{{10}}\.{host}\.{os.getpid()}\.\d+\.v2', names[0])
  first = read_events(str(tmp_path))[0]
  assert first.file_version == 'brain.Event:2' and not first.HasField('summary')
  got = values(str(tmp_path))
  by_key = {(tag, step): value for tag, step, _, value in got}
  assert len(by_key) == len(got)  # one event per tag and step

  assert [(tag, step) for tag, step, plugin, _ in got if plugin == 'scalars'] == [
      ('train_loss', 1), ('train_accuracy', 1), ('learning_rate', 1),
      ('train_loss', 2), ('train_accuracy', 2), ('learning_rate', 2)]
  for step in (1, 2):  # float32, as tf.summary.scalar keeps them
    assert by_key['train_loss', step] == np.float32(1.0 / step)
    assert by_key['train_accuracy', step] == np.float32(0.25 * step)
    assert by_key['learning_rate', step] == np.float32(1e-3 / step)
  assert by_key['parameters', 1] == '<pre>| Dense_0/bias | (10,) |</pre>'

  width, height, pngs = by_key['rgb_uint8', 1]
  assert (width, height) == (7, 5) and np.array_equal(pngs, IMAGES['rgb_uint8'])
  width, height, pngs = by_key['grey_float', 1]
  # tf.image.convert_image_dtype's float to uint8; a greyscale PNG reads back without a channel axis
  expected = (np.clip(IMAGES['grey_float'], 0, 1) * 255.5).astype(np.uint8)[..., 0]
  assert (width, height) == (6, 4) and np.array_equal(pngs, expected)
  width, height, pngs = by_key['rgba_one', 1]
  assert (width, height) == (4, 6) and np.array_equal(pngs, IMAGES['rgba_one'][None])
  assert np.array_equal(by_key['uint16', 1][2], IMAGES['uint16'] // 256)

  dtype, buckets = by_key['weights', 2]
  buckets = np.asarray(buckets)
  assert dtype == 'float64' and buckets.shape == (12, 3)
  assert (buckets[0, 0], buckets[-1, 1]) == (WEIGHTS.min(), WEIGHTS.max())
  assert np.array_equal(buckets[1:, 0], buckets[:-1, 1])
  width = (WEIGHTS.max() - WEIGHTS.min()) / 12
  counts = np.bincount(np.minimum(np.floor((WEIGHTS - WEIGHTS.min()) / width).astype(int), 11), minlength=12)
  assert buckets[:, 2].tolist() == counts.tolist() and counts.sum() == 1000
  assert np.asarray(by_key['constant', 2][1]).tolist() == [[2.5, 2.5, 0.0]] * 29 + [[2.5, 2.5, 7.0]]

  audio = by_key['tone', 2]
  for (channels, rate, samples), expected in zip(audio[:2], TONE):
    assert (channels, rate) == (2, 8000)
    assert np.array_equal(samples, np.clip(np.round(expected * 32768), -32768, 32767).ravel())
  assert audio[2:] == [b'', b'']

  assert by_key['raw', 2] == ('int64', [[0, 1, 2], [3, 4, 5]])
  assert by_key['pyfloat', 2] == ('float32', 0.5)  # a Python float: float32, as tf.summary.write makes it

  hparams = [(step, plugin) for tag, step, plugin, _ in got if tag == '_hparams_/session_start_info']
  assert hparams == [(0, 'hparams')]
  from tensorboard.plugins.hparams import plugin_data_pb2
  start = plugin_data_pb2.HParamsPluginData.FromString(by_key['_hparams_/session_start_info', 0])
  assert {name: getattr(value, value.WhichOneof('kind'))
          for name, value in start.session_start_info.hparams.items()} == {
      'optimizer.name': 'adam', 'optimizer.learning_rate': 3e-3, 'batch_size': 32, 'ema': False,
      'augment': '', 'crop.0': 0.08, 'crop.1': 1.0}


def test_the_same_events_as_clus_tensorflow_summary_writer(tmp_path):
  """The library it replaces, on the same writes: every (tag, step, plugin, decoded value) equal; the
  tensors' dtypes and shapes too."""
  from clu import metric_writers
  ours, theirs = str(tmp_path / 'flaxtpu'), str(tmp_path / 'clu')
  write_everything(events.SummaryWriter(ours))
  write_everything(metric_writers.SummaryWriter(theirs))
  assert values(ours) == values(theirs)
  scalars = {(tag, step, value) for tag, step, plugin, value in values(ours) if plugin == 'scalars'}
  assert scalars == {(tag, step, value) for tag, step, plugin, value in values(theirs) if plugin == 'scalars'}
  assert len(scalars) == 6

  def shapes(logdir):
    return [(value.tag, value.tensor.dtype, [d.size for d in value.tensor.tensor_shape.dim],
             value.metadata.SerializeToString(deterministic=True) if value.tag[0] != '_' else b'')
            for event in read_events(logdir) for value in event.summary.value]
  assert shapes(ours) == shapes(theirs)


def test_metric_writers_are_the_interface_and_a_multiwriter_calls_each_in_order(tmp_path):
  calls = []

  class Recorder(writers.ScalarWriter):
    def __init__(self, name):
      self.name = name

    def write_scalars(self, step, scalars):
      calls.append((self.name, step, dict(scalars)))

    def write_hparams(self, hparams):
      calls.append((self.name, 'hparams'))

    def close(self):
      calls.append((self.name, 'close'))

  writer = writers.MultiWriter([Recorder('a'), Recorder('b')])
  writer.write_scalars(3, {'loss': 1.5})
  writer.write_hparams({'x': 1})
  writer.write_images(3, {'i': np.zeros((1, 2, 2, 3), np.uint8)})  # a no-op for both
  writer.close()
  assert calls == [('a', 3, {'loss': 1.5}), ('b', 3, {'loss': 1.5}), ('a', 'hparams'), ('b', 'hparams'),
                   ('a', 'close'), ('b', 'close')]
  for writer_class in (events.SummaryWriter, writers.StagedSummaryWriter, writers.JsonlWriter,
                       writers.OptionalWriter, writers.MultiWriter, writers.WandbWriter):
    assert issubclass(writer_class, writers.MetricWriter), writer_class
  with pytest.raises(TypeError):  # abstract: a writer missing a method cannot be made
    type('Incomplete', (writers.MetricWriter,), {'write_scalars': lambda self, step, scalars: None})()


def test_staged_writer_copies_whole_event_files_to_the_workdir_on_each_flush(tmp_path):
  workdir = tmp_path / 'workdir'
  workdir.mkdir()
  writer = writers.StagedSummaryWriter(str(workdir))
  staging = writer._staging  # pylint: disable=protected-access
  writer.write_scalars(1, {'train_loss': 0.5})
  writer.flush()
  assert [(tag, step, value) for tag, step, _, value in values(str(workdir))] == [('train_loss', 1, 0.5)]
  writer.write_scalars(2, {'train_loss': 0.25})
  writer.close()
  assert [(tag, step, value) for tag, step, _, value in values(str(workdir))] == [
      ('train_loss', 1, 0.5), ('train_loss', 2, 0.25)]
  assert not os.path.exists(staging)


# flaxtpu.main as the command runs it; on its way out (exit status included) the TensorFlow modules it
# imported, as one JSON line.
WATCHING_IMPORTS = '''
import json, runpy, sys
sys.argv[0] = 'flaxtpu.main'
try:
  runpy.run_module('flaxtpu.main', run_name='__main__')
finally:
  print('TENSORFLOW_MODULES ' + json.dumps(sorted(m for m in sys.modules
                                                   if m.split('.')[0] in ('tensorflow', 'keras'))))
'''


def test_a_training_run_never_imports_tensorflow_and_writes_its_losses_to_tensorboard(tmp_path):
  workdir = str(tmp_path / 'run')
  env = cli_env()  # the CLI picks the devices
  env['PYTHONPROFILEIMPORTTIME'] = '1'  # every Python process of the run lists its imports on stderr
  result = subprocess.run([sys.executable, '-c', WATCHING_IMPORTS, '--config=configs/digits.py',
                           f'--workdir={workdir}', '--config.num_epochs=1', '--config.log_every_steps=10',
                           '--config.compilation_cache_dir=none'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'TENSORFLOW_MODULES []' in result.stdout.splitlines()
  imports = [line for line in result.stderr.splitlines() if line.startswith('import time:')]
  assert any(line.endswith(' flaxtpu.io.events') for line in imports)  # the import log is on
  assert not [line for line in imports if re.search(r'\|\s+(tensorflow|keras)(\.|$)', line)]

  rows = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8')]
  logged = [(row['step'], row['train_loss']) for row in rows if 'train_loss' in row]
  assert [step for step, _ in logged] == [10, 20, 30, 40, 44]  # 1,438 images in batches of 32: 44 steps
  written = values(workdir)
  losses = [(step, value) for tag, step, _, value in written if tag == 'train_loss']
  assert losses == [(step, float(np.float32(loss))) for step, loss in logged]
  eval_rows = [row for row in rows if 'eval_accuracy' in row]
  assert [(step, value) for tag, step, _, value in written if tag == 'eval_accuracy'] == [
      (row['step'], float(np.float32(row['eval_accuracy']))) for row in eval_rows]
  tags = {tag for tag, *_ in written}
  assert {'train_images', 'parameters', '_hparams_/session_start_info'} <= tags
