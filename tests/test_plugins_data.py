"""A source kind is a plug-in: one defined here, registered with one line, trains end to end."""

import math
import os
import zlib

import numpy as np
import pytest

from configs import cifar10
from flaxtpu.data import pipeline, sources
from flaxtpu.data.sources import base, embedded
from flaxtpu.loop import train
from flaxtpu.validation import config as config_lib
from flaxtpu.validation.config import ConfigError

CLASSES = ('dark', 'middle', 'light')


class SeededBands(base.Source):
  """Images made from a seed, no files: `dataset.seeded_bands` 8x8 RGB images per class, class c
  in the brightness band 80c..80c+60 (separable), each split drawn from its own name's seed."""
  kind = key = 'seeded_bands'
  keys = {'seeded_bands': 0}  # images per class; 0 = not this kind
  in_memory = True

  @classmethod
  def check(cls, config):
    if config.dataset.seeded_bands < 0:
      raise ConfigError(f'config.dataset.seeded_bands={config.dataset.seeded_bands} must be >= 0')

  def __init__(self, dataset, task):
    del task
    self.per_class = dataset.seeded_bands

  def splits(self, train_spec, eval_spec, class_names):
    made = {spec: make_split(spec, self.per_class) for spec in (train_spec, eval_spec) if spec is not None}
    return made.get(train_spec), made[eval_spec], CLASSES

  def native_sizes(self, splits):
    return {(8, 8)}

  def arrays(self, split, fits_in_memory):
    return split.records.images, split.labels


def make_split(spec: str, per_class: int) -> base.Split:
  rng = np.random.default_rng(zlib.crc32(spec.encode()))
  labels = np.repeat(np.arange(len(CLASSES), dtype=np.int32), per_class)
  images = (rng.integers(0, 60, (len(labels), 8, 8, 3)) + 80 * labels[:, None, None, None]).astype(np.uint8)
  return base.Split(name=spec, records=embedded.ArrayRecords(images, spec), labels=labels)


@pytest.fixture(scope='module', autouse=True)
def _registered():
  sources.register(SeededBands)  # all a new kind needs
  yield
  sources.KINDS.remove(SeededBands)  # other test modules see the built-in kinds (and their messages)


def _config(**overrides):
  config = cifar10.get_config()  # the Keras CNN; dataset.name stays 'cifar10', never read
  sources.declare_keys(config)  # the keys registered kinds declare
  config.dataset.seeded_bands = 16
  config.dataset.image_size = 0
  config.batch_size = 16
  config.num_train_steps = 40
  config.log_every_steps = 10
  config.eval_every_steps = 40
  config.checkpoint_every_steps = 40
  config.schedule.warmup_epochs = 0.0
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


def test_the_registry_asks_a_registered_kind_before_the_name_and_folder_fallbacks():
  config = _config()
  assert sources.kind_of(config.dataset) is SeededBands
  assert [kind.kind for kind in sources.ordered()] == [
      'labels', 'shards', 'parquet', 'seeded_bands', 'folder', 'embedded', 'tfds']
  config.dataset.seeded_bands = 0  # not selected: the run's TFDS name is read as before
  assert sources.kind_of(config.dataset).kind == 'tfds'


def test_its_keys_are_checked_by_config_validation():
  with pytest.raises(ConfigError, match='config.dataset.seeded_bands=-1 must be >= 0'):
    config_lib.validate(_config(**{'dataset.seeded_bands': -1}))
  with pytest.raises(ConfigError, match='config.dataset.labels and config.dataset.seeded_bands are both set'):
    config_lib.validate(_config(**{'dataset.labels': 'labels.csv'}))


def test_it_loads_exactly_its_arrays():
  dataset = pipeline.load(_config())
  expected_train, expected_eval = make_split('train', 16), make_split('test', 16)
  assert dataset.class_names == CLASSES and dataset.image_shape == (8, 8, 3)
  np.testing.assert_array_equal(dataset.train.images, expected_train.records.images)
  np.testing.assert_array_equal(dataset.train.labels, expected_train.labels)
  np.testing.assert_array_equal(dataset.eval.images, expected_eval.records.images)


def _validated(config):
  config_lib.validate(config)  # as the CLI does before training
  return config


def test_a_run_on_it_equals_the_same_images_served_by_the_embedded_kind(tmp_path, monkeypatch):
  toy = train.train_and_evaluate(_validated(_config()), str(tmp_path / 'toy'))
  splits = {name: make_split(name, 16) for name in ('train', 'test')}
  os.makedirs(tmp_path / 'package' / 'datasets')
  np.savez(tmp_path / 'package' / 'datasets' / 'bands.npz', class_names=np.asarray(CLASSES),
           **{f'{name}_{part}': split.labels if part == 'labels' else split.records.images
              for name, split in splits.items() for part in ('images', 'labels')})
  monkeypatch.setattr(embedded, '_PACKAGE', str(tmp_path / 'package'))
  monkeypatch.setitem(embedded.EMBEDDED, 'bands', 'bands.npz')
  served = train.train_and_evaluate(
      _validated(_config(**{'dataset.seeded_bands': 0, 'dataset.name': 'bands'})), str(tmp_path / 'embedded'))
  assert toy['step'] == served['step'] == 40
  for key in ('eval_accuracy', 'eval_loss', 'train_loss', 'train_accuracy'):
    assert toy[key] == served[key], key  # bit for bit: the same examples in the same order
  assert toy['eval_accuracy'] > 0.6 and toy['train_loss'] < math.log(3)  # it learns (chance: 1/3, ln 3)
