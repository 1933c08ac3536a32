"""Issue 41's resolution levers: augment.train_sizes (progressive resizing: the switch steps, one compile
per size, resume across a switch bit for bit, --mode=plan at the largest size) and eval.image_size (eval,
predict and the in-training eval read images at that size, as a manual resize makes them)."""

import json
import os

import cv2
import jax
import numpy as np
import pytest

from conftest import (
  assert_same_state,
  make_image_folder,
  make_mixed_folder,
  metric_rows,
  restore_checkpoint,
  signal_at_step,
)
from flaxtpu.augmentation import image_sizes
from flaxtpu.data import loaders, pipeline, preprocess
from flaxtpu.loop import train
from flaxtpu.modes import eval as eval_mode
from flaxtpu.modes import predict as predict_mode
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import ConfigError, printable
from flaxtpu.step import compile_plan
from flaxtpu.validation import config as config_lib

SCHEDULE = ((0.0, 8), (0.5, 12), (0.75, 16))  # 16 px data: 8 px for steps 1-6, 12 for 7-9, 16 after


def _config(folder, validate=True, **overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({
      'dataset.folder': folder, 'model.name': 'cnn', 'batch_size': 16, 'num_train_steps': 12,
      'log_every_steps': 3, 'eval_every_steps': 6, 'checkpoint_every_steps': 3,
      'compilation_cache_dir': 'none', 'schedule.name': 'constant', **overrides})
  if validate:
    config_lib.validate(config)
  return config


@pytest.fixture(scope='module')
def folder16(tmp_path_factory):
  return make_image_folder(tmp_path_factory.mktemp('images16'), size=16)


# --- the schedule ---------------------------------------------------------------------------------


def test_switch_steps_are_fractions_of_the_run_rounded_to_whole_updates():
  config = defaults.get_config()
  config.augment.train_sizes = ((0.0, 24), (0.5, 28), (0.75, 32))
  assert image_sizes.switches(config, 100) == ((0, 24), (50, 28), (75, 32))
  schedule = image_sizes.switches(config, 100)
  sizes = [image_sizes.size_at(schedule, step) for step in (1, 50, 51, 75, 76, 100)]
  assert sizes == [24, 24, 28, 28, 32, 32]
  config.optimizer.accumulate_steps = 4  # an update never mixes sizes: 0.5 x 30 = 15 -> 12, 22.5 -> 20
  assert image_sizes.switches(config, 30) == ((0, 24), (12, 28), (20, 32))
  assert image_sizes.size_at((), 5) == 0


@pytest.mark.parametrize('overrides, words', [
    ({'augment.train_sizes': ((0.5, 24), (0.75, 32))}, 'must start at fraction 0'),
    ({'augment.train_sizes': ((0.0, 24), (0.75, 28), (0.5, 32))}, 'must increase'),
    ({'augment.train_sizes': ((0.0, 4), (0.5, 32))}, '>= 8'),
    ({'augment.train_sizes': ((0.0, 24), (1.0, 32))}, 'in [0, 1)'),
    ({'augment.train_sizes': (24, 32)}, 'pairs'),
    ({'augment.train_sizes': ((0.0, 16), (0.5, 24)), 'time_budget': '5m'}, 'time_budget'),
    ({'augment.train_sizes': ((0.0, 16), (0.5, 32)), 'model.name': 'vit_ti'}, 'position embeddings'),
    ({'eval.image_size': 40, 'model.name': 'vit_ti'}, 'position embeddings'),
    ({'eval.image_size': 4}, 'eval.image_size=4'),
    ({'eval.crop_fraction': 0.9}, 'applies with eval.image_size'),
    ({'eval.image_size': 40, 'eval.crop_fraction': 1.5}, 'crop_fraction=1.5'),
])
def test_bad_resolution_settings_are_one_line_errors(overrides, words):
  config = _config('/data', validate=False, **overrides)
  with pytest.raises(ConfigError) as raised:
    config_lib.validate(config)
  assert words in str(raised.value) and '\n' not in printable(str(raised.value))


def test_a_size_above_the_pipeline_size_is_refused_naming_the_fix():
  config = _config('/data', **{'augment.train_sizes': ((0.0, 16), (0.5, 40))})
  with pytest.raises(ConfigError, match=r'asks for 40 px, above the 32x32 .*dataset.image_size=40'):
    config_lib.check_against_data(config, (32, 32, 3), 10)


def test_resize_batch_is_the_antialiased_resize_and_leaves_its_own_size_alone():
  images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3)).astype(np.uint8)
  resized = np.asarray(image_sizes.resize_batch(images, 8))
  # Antialiased linear halving of a 16 px image is the mean of each 2x2 block's 4x4 tent: close to the
  # block mean, far from sampling every other pixel.
  block_means = images.reshape(2, 8, 2, 8, 2, 3).mean(axis=(2, 4))
  assert resized.shape == (2, 8, 8, 3) and resized.dtype == np.float32
  sampled = images[:, ::2, ::2].astype(np.float32)
  assert np.abs(resized - block_means).mean() < np.abs(sampled - block_means).mean()
  np.testing.assert_array_equal(resized, jax.image.resize(images.astype(np.float32), (2, 8, 8, 3), 'linear'))
  assert image_sizes.resize_batch(images, 16) is images and image_sizes.resize_batch(images, 0) is images


# --- whole runs ---------------------------------------------------------------------------------------

RUN = {'augment.train_sizes': SCHEDULE, 'parallelism': 'pmap', 'optimizer.accumulate_steps': 2,
       'augment.flip': True, 'eval.image_size': 20}


@pytest.fixture(scope='module')
def scheduled_run(folder16, tmp_path_factory):
  """12 steps under pmap with accumulation, sizes 8 -> 12 -> 16, eval at 20: (workdir, results, compiled)."""
  workdir = str(tmp_path_factory.mktemp('scheduled'))
  compiled = []
  real = train._Loop.compile

  def recording(self, state, batch, size=0):
    compiled.append(size)
    return real(self, state, batch, size)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train._Loop, 'compile', recording)
    results = train.train_and_evaluate(_config(folder16, **RUN), workdir)
  return workdir, results, compiled


def test_each_size_compiles_once_and_the_switches_are_recorded(scheduled_run):
  workdir, results, compiled = scheduled_run
  assert compiled == [8, 12, 0]  # 0: the pipeline's own 16 px, the step without a resize
  assert results['train_image_sizes'] == [{'from_step': 1, 'size': 8}, {'from_step': 7, 'size': 12},
                                          {'from_step': 9, 'size': 16}]  # 0.75 x 12 = 9 -> 8 (2 per update)
  assert results['eval_image_size'] == 20
  logged = {row['step']: row['train_image_size'] for row in metric_rows(workdir) if 'train_loss' in row}
  assert logged == {3: 8, 6: 8, 9: 16, 12: 16}


def test_resume_across_a_size_switch_is_bit_for_bit(scheduled_run, folder16, tmp_path, monkeypatch):
  reference_dir, reference, _ = scheduled_run
  signal_at_step(monkeypatch, 8)  # the loader runs ahead: the run stops at a log step before the first switch
  stopped = train.train_and_evaluate(_config(folder16, **RUN), str(tmp_path))
  assert 3 <= stopped['stopped_at_step'] < 7  # the resumed run compiles 12 and 16 px and switches at 7 and 9
  monkeypatch.undo()
  results = train.train_and_evaluate(_config(folder16, **RUN), str(tmp_path))
  assert_same_state(restore_checkpoint(str(tmp_path), 12), restore_checkpoint(reference_dir, 12))
  assert metric_rows(str(tmp_path)) == metric_rows(reference_dir)
  assert results['eval_accuracy'] == reference['eval_accuracy']


def test_plan_compiles_the_largest_scheduled_size_under_fsdp(folder16):
  config = _config(folder16, **{'mesh.fsdp': 2, 'augment.train_sizes': ((0.0, 8), (0.5, 12))})
  planned = compile_plan.plan_memory(config, image_shape=(16, 16, 3), num_classes=3)
  full = compile_plan.plan_memory(_config(folder16, **{'mesh.fsdp': 2}), image_shape=(16, 16, 3),
                                  num_classes=3)
  assert planned['train_image_size'] == 12 and 'train_image_size' not in full
  # Activations shrink with the side: the 12 px step plans fewer temporaries than the 16 px one.
  assert planned['temp_bytes'] < full['temp_bytes']


# --- evaluation at eval.image_size ----------------------------------------------------------------


def test_native_size_eval_batches_are_the_whole_image_resized(folder16):
  config = _config(folder16, **{'eval.image_size': 20})
  dataset = pipeline.load(config)
  batch = next(loaders.eval_batches(dataset, batch_size=8))
  assert dataset.image_shape == (16, 16, 3) and dataset.eval_image_shape == (20, 20, 3)
  raw = pipeline.load(_config(folder16)).eval.images[:8]
  manual = np.stack([cv2.resize(image, (20, 20), interpolation=cv2.INTER_LINEAR) for image in raw])
  np.testing.assert_array_equal(batch.images, manual)
  train_batch = next(loaders.train_batches(dataset, seed=0, batch_size=8, first_step=0, last_step=1))
  assert train_batch.images.shape == (8, 16, 16, 3)  # training keeps the pipeline's size


def test_fixres_eval_crop_of_photos_matches_preprocess(tmp_path):
  folder = make_mixed_folder(tmp_path / 'photos')
  config = _config(folder, **{'dataset.image_size': 16, 'eval.image_size': 24, 'eval.crop_fraction': 0.9,
                              'dataset.cache': 'none', 'input.workers': 0})
  dataset = pipeline.load(config)
  images = next(loaders.eval_batches(dataset, batch_size=8)).images
  transform = preprocess.Transform(size=24, crop_fraction=0.9)
  assert images.shape == (8, 24, 24, 3) and dataset.image_shape == (16, 16, 3)
  for row in (0, 3, 7):  # JPEG, CMYK, 16-bit PNG...: each as preprocess makes it from its file
    item, _ = dataset.eval.source.load(row)
    np.testing.assert_array_equal(images[row], preprocess.eval_image(item, transform))
  cached = pipeline.load(_config(folder, **{'dataset.image_size': 16, 'eval.image_size': 24,
                                            'eval.crop_fraction': 0.9, 'dataset.cache': 'memory'}))
  # The cache keeps a shorter side of at most the eval resize: the eval split's at 24 / 0.9, the train
  # split's at 16 / 0.875 (never enlarged).
  assert max(min(image.shape[:2]) for image in cached.eval.images) == 27
  assert max(min(image.shape[:2]) for image in cached.train.images) == 19


def test_eval_and_predict_agree_at_the_eval_size(scheduled_run, folder16):
  workdir, results, _ = scheduled_run
  config = _config(folder16, **RUN)
  evaluated = eval_mode.evaluate_checkpoint(config, workdir)
  assert evaluated['image_size'] == 20 and evaluated['eval_accuracy'] == results['eval_accuracy']
  at_16 = eval_mode.evaluate_checkpoint(_config(folder16, **{**RUN, 'eval.image_size': 16}), workdir)
  assert at_16['image_size'] == 16
  splits = json.load(open(os.path.join(workdir, 'eval.json')))['splits']
  assert {'test', 'test:size=16'} <= set(splits)  # each size keeps its own entry
  # predict reads a file at the eval size: its probabilities are the eval step's softmax of that image
  image = os.path.join(folder16, 'test', 'dog', '003.png')
  rows = predict_mode.predict(_config(folder16, **{**RUN, 'predict.input': image}), workdir)
  placement, state, _, _ = predict_mode.restore(config, workdir)
  manual = cv2.resize(np.asarray(preprocess.open_image(image).convert('RGB')), (20, 20),
                      interpolation=cv2.INTER_LINEAR)
  logits = predict_mode.predict_logits(placement, state, manual[None], 8)
  probabilities = np.asarray(jax.nn.softmax(logits, axis=-1))[0]
  assert rows[0]['class_1'] == ('cat', 'dog', 'frog')[int(probabilities.argmax())]
  np.testing.assert_allclose(rows[0]['probability_1'], probabilities.max(), rtol=1e-5)


@pytest.mark.slow  # TensorFlow's SavedModel, TFLite and ONNX conversions: ~1 min
def test_export_serves_at_the_eval_size_and_agrees_with_predict(scheduled_run, folder16):
  import tensorflow as tf

  from flaxtpu.exporters import export
  workdir, _, _ = scheduled_run
  config = _config(folder16, **RUN)
  summary = export.export_checkpoint(config, workdir)  # its own check: SavedModel/TFLite vs predict
  assert summary['image_size'] == 20
  assert summary['signature']['inputs']['images']['shape'] == [None, 20, 20, 3]
  assert '20x20' in summary['preprocessing']
  images = next(loaders.eval_batches(pipeline.load(config), batch_size=8)).images
  serve = tf.saved_model.load(os.path.join(workdir, 'export', 'saved_model')).signatures['serving_default']
  placement, state, _, _ = predict_mode.restore(config, workdir)
  np.testing.assert_allclose(serve(images=tf.constant(images))['logits'].numpy(),
                             predict_mode.predict_logits(placement, state, images, 8), rtol=1e-4, atol=1e-4)
