"""Issue 41 part 4: repeated augmentation, AugMix, colour jitter, Gaussian blur and the BCE loss,
checked against hand computations, torchvision, scipy and timm's formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.ndimage
from test_levers_runs import _config as levers_run_config

from flaxtpu.augmentation import aug_checks, augmix, photometric
from flaxtpu.data import loaders, pipeline, sampling
from flaxtpu.data.repeated import RepeatedSampler
from flaxtpu.loss import bce
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import ConfigError
from flaxtpu.validation import config as config_lib

IMAGE = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)


# --- augment.repeats ----------------------------------------------------------------------------


def _dataset(num_examples, repeats):
  images = (np.arange(num_examples) % 256).astype(np.uint8).reshape(-1, 1, 1, 1)
  examples = pipeline.Examples(images=images, labels=np.arange(num_examples, dtype=np.int32) % 4)
  return pipeline.Dataset(train=examples, eval=examples, class_names=('a', 'b', 'c', 'd'),
                          image_shape=(1, 1, 1), mean=np.zeros(1), std=np.ones(1),
                          transform=pipeline.Transform(), repeats=repeats)


@pytest.mark.parametrize('sampling_name', ['shuffle', 'balanced'])
def test_repeats_hold_each_example_exactly_repeats_times_spread_over_processes(sampling_name):
  import dataclasses
  dataset = dataclasses.replace(_dataset(120, repeats=3), sampling=sampling_name)
  whole = sampling.sampler(dataset, seed=5, batch_size=24)
  assert isinstance(whole, RepeatedSampler) and whole.steps_per_epoch == 120 // 24  # timm: epoch length kept
  thirds = [sampling.sampler(dataset, seed=5, batch_size=24, process_index=p, process_count=3)
            for p in range(3)]
  plain = sampling.sampler(dataclasses.replace(dataset, repeats=1), seed=5, batch_size=24)
  epoch_examples = []
  for step in range(12):  # across two epoch boundaries
    batch = whole.indices(step)
    distinct, counts = np.unique(batch, return_counts=True)
    if sampling_name == 'shuffle':
      assert len(distinct) == 8 and set(counts) == {3}
    np.testing.assert_array_equal(batch, np.tile(batch[:8], 3))  # copy k in rows 8k..8k+7
    # Each process (rows 8p..8p+7) holds one copy of every example of the step, as timm's replicas do.
    for process, third in enumerate(thirds):
      np.testing.assert_array_equal(third.indices(step), batch[8 * process:8 * process + 8])
    # The distinct examples are the wrapped sampler's epoch order, taken 8 per step.
    epoch, position = divmod(step, 5)
    order = plain._epoch_order(epoch)
    np.testing.assert_array_equal(batch[:8], order[8 * position:8 * position + 8])
    if epoch == 0:
      epoch_examples.extend(batch[:8])
  if sampling_name == 'shuffle':  # an epoch shows 40 distinct examples (1/3 of the split), none twice
    assert len(set(epoch_examples)) == 40
  # Two samplers, and a resumed read from step 7, give the same batches.
  again = sampling.sampler(dataset, seed=5, batch_size=24)
  assert all(np.array_equal(again.indices(s), whole.indices(s)) for s in range(12))
  resumed = [b.images[:, 0, 0, 0] for b in loaders.train_batches(dataset, seed=5, batch_size=24,
                                                                 first_step=7, last_step=12)]
  full = [b.images[:, 0, 0, 0] for b in loaders.train_batches(dataset, seed=5, batch_size=24,
                                                              first_step=0, last_step=12)]
  for got, want in zip(resumed, full[7:], strict=True):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(full[3], whole.indices(3) % 256)
  assert sampling.examples_per_epoch(dataset, 24) == 120


def test_repeats_one_is_the_plain_sampler():
  assert type(sampling.sampler(_dataset(40, 1), seed=0, batch_size=8)) is sampling.ShuffleSampler


# --- colour jitter ------------------------------------------------------------------------------


def _torch():
  """torch and torchvision's functional transforms (not timm: its import alone takes seconds)."""
  import sys
  import types
  name = 'torchvision._meta_registrations'  # as test_pretrained.import_torch: the CPU wheel lacks them
  sys.modules.setdefault(name, types.ModuleType(name))
  torch = pytest.importorskip('torch')
  pytest.importorskip('torchvision')
  from torchvision.transforms import functional
  return torch, functional


def test_jitter_ops_match_torchvision_on_uint8_and_brightness_by_hand():
  torch, functional = _torch()
  tensor = torch.from_numpy(IMAGE).permute(2, 0, 1)
  hand = np.clip(IMAGE.astype(np.float32) * 1.3, 0, 255).astype(np.uint8)  # brightness: trunc(clip(x * f))
  np.testing.assert_array_equal(np.asarray(photometric.brightness(jnp.asarray(IMAGE), 1.3)), hand)
  for ours, theirs, factor in ((photometric.brightness, functional.adjust_brightness, 0.6),
                               (photometric.contrast, functional.adjust_contrast, 1.4),
                               (photometric.saturation, functional.adjust_saturation, 0.3),
                               (photometric.hue, functional.adjust_hue, 0.2),
                               (photometric.hue, functional.adjust_hue, -0.45)):
    want = theirs(tensor, factor).permute(1, 2, 0).numpy().astype(int)
    got = np.asarray(jax.jit(ours)(jnp.asarray(IMAGE), jnp.float32(factor))).astype(int)
    assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 0.02, ours.__name__


def test_jitter_is_identity_at_zero_strength_and_applies_its_ops_in_the_drawn_order():
  image = jnp.asarray(IMAGE)
  uniforms = jnp.array([0.9, 0.2, 0.7, 0.1, 0.8, 0.1, 0.5, 0.3])
  np.testing.assert_array_equal(photometric.color_jitter(image, uniforms, (0.0,) * 4), IMAGE)
  # A draw in the middle of the range is factor 1: identity too.
  middle = photometric.color_jitter(image, jnp.full(8, 0.5), (0.4, 0.4, 0.4, 0.0))
  np.testing.assert_array_equal(middle, IMAGE)
  uniforms = jnp.array([0.75, 0.25, 0.875, 0.25, 0.8, 0.1, 0.5, 0.3])
  strengths = (0.5, 0.5, 0.5, 0.25)  # factors 0.5 + draw: 1.25, 0.75, 1.375; hue -0.25 + 0.5 * draw = -0.125
  # order = argsort(0.8, 0.1, 0.5, 0.3): contrast, hue, saturation, brightness
  want = photometric.brightness(photometric.saturation(photometric.hue(photometric.contrast(
      image, 0.75), -0.125), 1.375), 1.25)
  np.testing.assert_array_equal(photometric.color_jitter(image, uniforms, strengths), want)
  config = defaults.get_config().augment
  assert not photometric.active(config)
  config.color_jitter, config.blur = 0.4, 0.5
  apply = jax.jit(lambda key, x: photometric.apply(key, x, config))
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  first = np.asarray(apply(keys[0], image))
  np.testing.assert_array_equal(apply(keys[0], image), first)  # the same key: the same image
  assert not np.array_equal(apply(keys[1], image), first)


# --- blur ---------------------------------------------------------------------------------------


@pytest.mark.parametrize('sigma,kernel', [(0.8, 5), (1.7, 23)])
def test_blur_matches_scipy_and_torchvision_and_keeps_constants(sigma, kernel):
  torch, functional = _torch()
  radius = photometric.blur_radius(kernel, 16, 16)
  assert radius == min(kernel // 2, 15)
  got = np.asarray(photometric.gaussian_blur(jnp.asarray(IMAGE), jnp.float32(sigma), kernel)).astype(float)
  # scipy's 'mirror' is torch's 'reflect'; its kernel is the same normalised, truncated Gaussian.
  want = scipy.ndimage.gaussian_filter(IMAGE.astype(float), sigma, mode='mirror', radius=radius, axes=(0, 1))
  assert np.abs(got - want).max() <= 0.5 + 1e-3
  assert abs(got.mean() - IMAGE.mean()) < 0.5  # the mean kept (up to the reflected border)
  if kernel // 2 < 16:  # torchvision needs the padding to fit the image
    tensor = torch.from_numpy(IMAGE).permute(2, 0, 1)
    theirs = functional.gaussian_blur(tensor, [kernel, kernel], [sigma, sigma])
    assert np.abs(got - theirs.permute(1, 2, 0).numpy()).max() <= 1
  flat = jnp.full((16, 16, 3), 77, jnp.uint8)
  np.testing.assert_array_equal(photometric.gaussian_blur(flat, jnp.float32(sigma), kernel), flat)


# --- AugMix -------------------------------------------------------------------------------------


def test_augmix_is_a_convex_mix_of_its_chains_deterministic_per_key():
  image = jnp.asarray(IMAGE)
  run = jax.jit(lambda key: (augmix.apply(key, image), augmix.parts(key, image, severity=3, width=3, depth=-1,
                                                                    alpha=1.0)))
  key, other = jax.random.split(jax.random.PRNGKey(0))
  out, (chains, weights, m) = run(key)
  out, chains, weights, m = (np.asarray(out).astype(int), np.asarray(chains).astype(float),
                             np.asarray(weights), float(m))
  assert chains.shape == (3, 16, 16, 3) and abs(weights.sum() - 1) < 1e-6 and (weights > 0).all()
  assert 0 < m < 1
  assert not all(np.array_equal(chain, IMAGE) for chain in chains)  # the chains changed something
  # timm's arithmetic by hand: the chains' mix truncated, blended with the image by m, truncated.
  mixed = np.floor(np.clip(np.tensordot(weights, chains, 1), 0, 255) + 1e-3)
  np.testing.assert_array_equal(out, np.floor((1 - m) * IMAGE + m * mixed + 1e-3))
  low = np.minimum(IMAGE, chains.min(0))
  high = np.maximum(IMAGE, chains.max(0))
  assert (out >= low).all() and (out <= high).all()
  np.testing.assert_array_equal(run(key)[0], out)
  assert not np.array_equal(run(other)[0], out)


# --- loss=bce -----------------------------------------------------------------------------------


def test_bce_is_timms_mean_or_sum_and_the_threshold_binarises_mixed_smoothed_targets():
  logits = np.array([[2.0, -1.0, 0.5, 0.0], [-0.3, 1.2, 0.1, -2.0]], np.float32)
  hard = np.array([[0.6, 0.4, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]], np.float32)  # a mixed pair, a one-hot
  targets = np.asarray(optax.smooth_labels(hard, 0.1))  # 0.1 / 4 = 0.025 off, 0.925 on
  np.testing.assert_allclose(targets[1], [0.025, 0.925, 0.025, 0.025], rtol=1e-6)
  p = 1 / (1 + np.exp(-logits))
  by_hand = -(targets * np.log(p) + (1 - targets) * np.log(1 - p))
  mean = bce.loss_per_example(jnp.asarray(logits), jnp.asarray(targets), bce.Bce())
  np.testing.assert_allclose(mean, by_hand.mean(-1), rtol=1e-5)
  total = bce.loss_per_example(jnp.asarray(logits), jnp.asarray(targets), bce.Bce(sum_classes=True))
  np.testing.assert_allclose(total, by_hand.sum(-1), rtol=1e-5)
  np.testing.assert_array_equal(bce.binarized(jnp.asarray(targets), 0.2), [[1, 1, 0, 0], [0, 1, 0, 0]])
  weights = np.array([1.0, 2.0, 1.0, 0.5], np.float32)
  binary = np.array([[1, 1, 0, 0], [0, 1, 0, 0]], np.float32)
  hand = -(binary * np.log(p) + (1 - binary) * np.log(1 - p))
  thresholded = bce.loss_per_example(jnp.asarray(logits), jnp.asarray(targets), bce.Bce(threshold=0.2),
                                     weights)
  np.testing.assert_allclose(thresholded, (hand * weights).mean(-1), rtol=1e-5)


def test_bce_comes_from_the_config_for_single_label_only():
  config = defaults.get_config()
  assert bce.from_config(config) is None
  config.loss, config.bce_target_threshold, config.bce_sum = 'bce', 0.2, True
  assert bce.from_config(config) == bce.Bce(threshold=0.2, sum_classes=True)


# --- config checks ------------------------------------------------------------------------------


@pytest.mark.parametrize('overrides,words', [
    ({'augment.repeats': 0}, 'augment.repeats=0'),
    ({'augment.repeats': 3, 'batch_size': 32}, 'multiple of augment.repeats=3'),
    ({'augment.repeats': 2, 'augment.flip': True, 'augment.alternate_flip': True}, 'alternate_flip'),
    ({'augment.policy': 'augmix', 'augment.augmix_severity': 11}, 'augmix_severity=11'),
    ({'augment.policy': 'augmix', 'augment.augmix_depth': 0}, 'augmix_depth=0'),
    ({'augment.policy': 'augmix', 'augment.augmix_alpha': 0.0}, 'augmix_alpha=0.0'),
    ({'augment.color_jitter_hue': 0.6}, 'color_jitter_hue=0.6'),
    ({'augment.blur': 1.5}, 'augment.blur=1.5'),
    ({'augment.blur_kernel': 4}, 'blur_kernel=4'),
    ({'augment.blur_sigma': (2.0, 1.0)}, 'blur_sigma'),
    ({'loss': 'focal'}, "loss='focal'"),
    ({'loss': 'bce', 'task': 'multilabel'}, 'single-label'),
    ({'bce_target_threshold': 1.0}, 'bce_target_threshold=1.0'),
])
def test_bad_values_are_one_line_errors(overrides, words):
  config = defaults.get_config()
  config.update_from_flattened_dict(overrides)
  with pytest.raises(ConfigError) as raised:  # multilabel needs tagged data: its own check alone
    (aug_checks.check if config.task == 'multilabel' else config_lib.validate)(config)
  message = str(raised.value)
  assert words in message and '\n' not in message


# --- every lever in a run: it trains, and resumes bit for bit -----------------------------------

LEVERS = {'augment.repeats': 2, 'augment.policy': 'augmix', 'augment.color_jitter': 0.4,
          'augment.color_jitter_hue': 0.1, 'augment.blur': 0.5, 'augment.blur_kernel': 5,
          'augment.mixup_alpha': 0.2, 'label_smoothing': 0.1, 'loss': 'bce', 'bce_target_threshold': 0.2}


def _run_config(folder, **overrides):
  return levers_run_config(folder, **{
      'num_train_steps': 8, 'eval_every_steps': 8, 'checkpoint_every_steps': 2,
      'optimizer.learning_rate': 0.01, **LEVERS, **overrides})


@pytest.mark.slow  # three 8-step runs, 3 min on 2 shared cores (the augmix step compiles in ~35 s)
def test_a_run_with_every_lever_trains_with_bce_and_resumes_bit_for_bit(image_folder, tmp_path, monkeypatch):
  from conftest import assert_same_state, metric_rows, restore_checkpoint, signal_at_step
  from flaxtpu.loop import train
  reference = train.train_and_evaluate(_run_config(image_folder), str(tmp_path / 'whole'))
  signal_at_step(monkeypatch, 3)
  stopped = train.train_and_evaluate(_run_config(image_folder), str(tmp_path / 'resumed'))
  assert stopped['stopped_at_step'] < 8
  monkeypatch.undo()
  results = train.train_and_evaluate(_run_config(image_folder), str(tmp_path / 'resumed'))
  assert_same_state(restore_checkpoint(str(tmp_path / 'resumed'), 8),
                    restore_checkpoint(str(tmp_path / 'whole'), 8))
  assert metric_rows(str(tmp_path / 'resumed')) == metric_rows(str(tmp_path / 'whole'))
  assert results['eval_accuracy'] == reference['eval_accuracy']
  rows = [row for row in metric_rows(str(tmp_path / 'whole')) if 'train_loss' in row]
  assert rows[-1]['train_loss'] < rows[0]['train_loss'] < 0.9  # BCE's scale: ln 2 per class at the start
  assert reference['eval_accuracy'] > 0.5  # 3 classes: chance is 1/3
