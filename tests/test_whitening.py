"""airbench94's network parts: the data-fitted whitening stem, partial identity kernels, and how a run
fits the stem once, freezes it, and keeps it across a resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_image_folder, make_mixed_folder, restore_checkpoint
from flaxtpu import models
from flaxtpu.augmentation import augment
from flaxtpu.data import loaders, pipeline
from flaxtpu.loop import train
from flaxtpu.models.nets import fastnet
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import UserError
from flaxtpu.step import steps
from flaxtpu.validation import config as config_lib


def _patches(images, side=2):
  n, height, width, channels = images.shape
  rows = [images[:, i:height - side + 1 + i, j:width - side + 1 + j]
          for i in range(side) for j in range(side)]
  return np.stack(rows, axis=3).reshape(-1, side * side * channels)


def _conv(images, kernel):
  return np.asarray(jax.lax.conv_general_dilated(images, kernel, (1, 1), 'VALID',
                                                 dimension_numbers=('NHWC', 'HWIO', 'NHWC')))


def test_the_whitening_kernel_decorrelates_2x2_patches():
  rng = np.random.default_rng(0)
  images = rng.normal(size=(300, 12, 12, 3)).astype(np.float32)
  images[..., 1] += 0.8 * images[..., 0]  # correlated channels and neighbours, uneven scales
  images = 3.0 * (images + 0.6 * np.roll(images, 1, axis=2)) + 0.5
  kernel = fastnet.whitening_kernel(images)
  assert kernel.shape == (2, 2, 3, 24)
  outputs = _conv(images, kernel).reshape(-1, 24)
  covariance = outputs[:, :12].T @ outputs[:, :12] / len(outputs)
  eigenvalues = np.linalg.eigvalsh(_patches(images.astype(np.float64)).T @ _patches(images) / len(outputs))
  expected = np.sort(eigenvalues / (eigenvalues + fastnet.WHITEN_EPSILON))[::-1]  # ~1, largest first
  np.testing.assert_allclose(np.diag(covariance), expected, rtol=1e-4)
  np.testing.assert_allclose(covariance - np.diag(np.diag(covariance)), 0, atol=1e-4)
  np.testing.assert_array_equal(kernel[..., 12:], -kernel[..., :12])  # both signs survive the GELU


def test_partial_dirac_passes_the_first_channels_through():
  for inputs, outputs in ((4, 6), (6, 4)):
    kernel = fastnet.partial_dirac()(jax.random.PRNGKey(0), (3, 3, inputs, outputs))
    images = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 5, inputs))
    result = jax.lax.conv_general_dilated(images, kernel, (1, 1), 'SAME',
                                          dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    identity = min(inputs, outputs)
    np.testing.assert_allclose(result[..., :identity], images[..., :identity], atol=1e-6)
    if outputs > inputs:  # the rest is random, not zero
      assert float(jnp.abs(kernel[..., identity:]).mean()) > 0.05


def test_fastnet_whiten_layers_and_smallest_image():
  model = models.create('fastnet_whiten', num_classes=10)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)['params']
  assert params['stem']['kernel'].shape == (2, 2, 3, 24) and params['stem']['bias'].shape == (24,)
  assert set(params['block1']['BatchNorm_0']) == {'bias'}  # no scale
  np.testing.assert_array_equal(params['block3']['Conv_1']['kernel'][1, 1], np.eye(256))
  models.check_image_shape('fastnet_whiten', (9, 9, 3))  # 9 -> 8 -> 4 -> 2 -> 1
  with pytest.raises(UserError, match='needs at least 9x9'):
    models.check_image_shape('fastnet_whiten', (8, 8, 3))


@pytest.fixture(scope='module')
def photos(tmp_path_factory):
  return make_mixed_folder(tmp_path_factory.mktemp('photos'))


def _config(folder, **overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({
      'dataset.folder': folder, 'dataset.image_size': 16, 'dataset.normalize': 'standardize',
      'model.name': 'fastnet_whiten', 'optimizer.name': 'sgd', 'optimizer.learning_rate': 0.2,
      'optimizer.momentum': 0.85, 'optimizer.nesterov': True, 'optimizer.freeze': ('^stem/kernel$',),
      'optimizer.lr_multipliers': ('/bias$=64',), 'batch_size': 16, 'eval_every_steps': 100,
      'checkpoint_every_steps': 3, 'compilation_cache_dir': 'none', **overrides})
  config_lib.validate(config)
  return config


def test_cached_and_streamed_splits_give_the_same_fitting_sample(tmp_path):
  folder = make_image_folder(tmp_path, size=12, train_per_class=10)
  native = {'dataset.image_size': 0}
  cached = loaders.train_sample(pipeline.load(_config(folder, **native, **{'dataset.cache': 'memory'})), 20)
  streamed = loaders.train_sample(pipeline.load(_config(folder, **native, **{'dataset.cache': 'none'})), 20)
  assert len(cached) == len(streamed) == 20
  np.testing.assert_array_equal(np.stack(cached), np.stack(streamed))


def test_a_fresh_run_fits_the_stem_freezes_it_and_a_resume_keeps_it(photos, tmp_path, monkeypatch):
  config = _config(photos, num_train_steps=3)
  workdir = str(tmp_path)
  train.train_and_evaluate(config, workdir)
  dataset = pipeline.load(config)
  sample = np.stack(loaders.train_sample(dataset, steps.DATA_FIT_IMAGES))
  assert len(sample) == len(dataset.train) == 54  # fewer train images than the sample size: all of them
  pixels = np.asarray(augment.normalize(jnp.asarray(sample), dataset.mean, dataset.std))
  expected = fastnet.whitening_kernel(pixels)
  saved = restore_checkpoint(workdir, 3)
  # XLA's division by std rounds its own way; the whitening amplifies that in the flattest directions.
  np.testing.assert_allclose(saved['params']['stem']['kernel'], expected, rtol=1e-3, atol=1e-3)
  assert np.abs(saved['params']['stem']['bias']).max() > 0  # the stem's bias trains (from 0)

  # A resumed run continues from its checkpoint: nothing is fitted again.
  monkeypatch.setattr(steps, 'fit_to_data', lambda *args: pytest.fail('fitted on resume'))
  results = train.train_and_evaluate(_config(photos, num_train_steps=6), workdir)
  assert results['step'] == 6
  np.testing.assert_array_equal(restore_checkpoint(workdir, 6)['params']['stem']['kernel'],
                                saved['params']['stem']['kernel'])
