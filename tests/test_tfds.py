"""TFDS datasets: streamed from ArrayRecord, sliced, cached; TFRecord-only datasets explained.

Two tiny TFDS datasets are generated and prepared locally (no download):
mixed image sizes as ArrayRecord, fixed-size images as TFRecord.
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import cifar10
from flaxtpu.data import loaders, pipeline


def _examples(count, seed, fixed_size):
  rng = np.random.default_rng(seed)
  for i in range(count):
    label = i % 2
    height, width = (8, 8) if fixed_size else rng.integers(8, 30, 2)
    pixels = rng.integers(0, 60, (height, width, 3)) + 120 * label
    yield i, {'image': pixels.astype(np.uint8), 'label': label}


class FlaxtpuToyMixed(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(None, None, 3)),
        'label': tfds.features.ClassLabel(names=['dark', 'light'])}), supervised_keys=('image', 'label'))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(40, 0), 'test': self._generate_examples(12, 1)}

  def _generate_examples(self, count, seed):
    yield from _examples(count, seed, fixed_size=False)


class FlaxtpuToyFixed(FlaxtpuToyMixed):

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(8, 8, 3)),
        'label': tfds.features.ClassLabel(names=['dark', 'light'])}), supervised_keys=('image', 'label'))

  def _generate_examples(self, count, seed):
    yield from _examples(count, seed, fixed_size=True)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('tfds'))
  tfds.builder('flaxtpu_toy_mixed', data_dir=directory).download_and_prepare(file_format='array_record')
  tfds.builder('flaxtpu_toy_fixed', data_dir=directory).download_and_prepare(file_format='tfrecord')
  return directory


def _config(name, data_dir, **overrides):
  config = cifar10.get_config()
  config.dataset.name = name
  config.dataset.data_dir = data_dir
  config.input.workers = 0
  config.update_from_flattened_dict(overrides)
  return config


def test_array_record_streams_slices_and_matches_the_cache(data_dir):
  config = _config('flaxtpu_toy_mixed', data_dir, **{
      'dataset.image_size': 16, 'dataset.cache': 'none', 'dataset.train_split': 'train[:75%]',
      'dataset.eval_split': 'train[75%:]+test'})
  streamed = pipeline.load(config)
  assert streamed.class_names == ('dark', 'light') and streamed.image_shape == (16, 16, 3)
  assert (len(streamed.train), len(streamed.eval)) == (30, 22) and not streamed.train.cached
  batch = next(loaders.train_batches(streamed, seed=0, batch_size=8, first_step=0, last_step=1))
  assert batch.images.shape == (8, 16, 16, 3)
  brightness = batch.images.reshape(8, -1).mean(axis=1)
  np.testing.assert_array_less(np.abs(brightness - (30 + 120 * batch.labels)), 20)
  config.dataset.cache = 'memory'
  cached = pipeline.load(config)
  assert cached.train.cached
  for a, b in zip(loaders.eval_batches(streamed, batch_size=8), loaders.eval_batches(cached, batch_size=8)):
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.mask, b.mask)


def test_varying_tfds_sizes_need_image_size(data_dir):
  with pytest.raises(pipeline.DataError, match='the images vary in size; set --config.dataset.image_size'):
    pipeline.load(_config('flaxtpu_toy_mixed', data_dir))


def test_tfrecord_loads_into_memory_or_explains_array_record(data_dir):
  dataset = pipeline.load(_config('flaxtpu_toy_fixed', data_dir))
  assert dataset.train.cached and dataset.train.images.shape == (40, 8, 8, 3)
  assert np.bincount(dataset.train.labels).tolist() == [20, 20]
  with pytest.raises(pipeline.DataError, match="prepared as TFRecord.*file_format='array_record'"):
    pipeline.load(_config('flaxtpu_toy_fixed', data_dir, **{'dataset.cache': 'none'}))


def test_unknown_name_and_split_are_named(data_dir):
  with pytest.raises(pipeline.DataError,
                     match="config.dataset.name='no_such_dataset_xyz' is not a TFDS dataset"):
    pipeline.load(_config('no_such_dataset_xyz', data_dir))
  with pytest.raises(pipeline.DataError, match="has no split 'validation'; it has: test, train"):
    pipeline.load(_config('flaxtpu_toy_mixed', data_dir, **{'dataset.eval_split': 'validation',
                                                            'dataset.image_size': 16}))


def test_offline_tfds_fails_within_seconds_with_one_line(tmp_path, monkeypatch):
  import socket
  import time

  from flaxtpu.data import sources
  from flaxtpu.data.sources import tfds as tfds_source
  with socket.socket() as closed:  # a port nothing listens on: what an offline machine answers
    closed.bind(('127.0.0.1', 0))
    port = closed.getsockname()[1]
  monkeypatch.setattr(tfds_source, 'DOWNLOAD_HOST', ('127.0.0.1', port))
  for proxy in ('HTTPS_PROXY', 'https_proxy'):
    monkeypatch.delenv(proxy, raising=False)
  started = time.time()
  with pytest.raises(sources.DataError, match=r"'flaxtpu_toy_fixed' is not in .* cannot download it "
                     r'\(connecting to 127\.0\.0\.1:\d+ failed.*--config\.dataset\.folder'):
    pipeline.load(_config('flaxtpu_toy_fixed', str(tmp_path / 'empty')))
  assert time.time() - started < 10
  assert not (tmp_path / 'empty' / 'downloads').exists()
