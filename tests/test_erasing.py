"""Random erasing (timm's RandomErasing) and AutoAugment's ImageNet policy (torchvision's)."""

import ast
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxtpu.augmentation import augment
from flaxtpu.augmentation import randaugment as ra
from flaxtpu.settings import defaults

AREA, ASPECT = (0.02, 1 / 3), (0.3, 1 / 0.3)  # timm's defaults


def _erasing(**keys):
  config = defaults.get_config().augment
  config.update({'erase_prob': 1.0, **keys})
  return config


def _boxes(count, size=224, draws=20_000):
  """(top, left, height, width) of `draws` boxes of a size x size image, each one of `count`."""
  uniforms = jax.random.uniform(jax.random.PRNGKey(0), (draws, augment.BOX_DRAWS))
  boxes = jax.vmap(lambda row: augment.erase_box(row, size, size, count, AREA, ASPECT))(uniforms)
  return [np.asarray(x) for x in boxes]


def _conditional_mean_area():
  """E[area fraction | the box fits]: timm redraws a box whose side would reach the image's."""
  area = np.linspace(*AREA, 2001)[:, None]
  log_aspect = np.linspace(*np.log(ASPECT), 2001)[None, :]
  fits = (area * np.exp(log_aspect) < 1) & (area * np.exp(-log_aspect) < 1)
  return float((area * fits).sum() / fits.sum())


def test_erased_area_and_aspect_follow_the_uniform_and_log_uniform_ranges():
  size = 224
  top, left, height, width = _boxes(count=1, size=size)
  assert (height > 0).all() and (width > 0).all()  # ten draws: one fits, always
  assert (top >= 0).all() and (left >= 0).all()
  assert (top + height <= size).all() and (left + width <= size).all()
  fraction = height * width / size**2
  uniform_mean = sum(AREA) / 2  # 0.1767
  assert abs(fraction.mean() - _conditional_mean_area()) < 0.01 * uniform_mean  # 0.4 standard errors ~ 0.4%
  assert abs(fraction.mean() - uniform_mean) < 0.02 * uniform_mean
  assert fraction.min() >= 0.9 * AREA[0] and fraction.max() <= 1.05 * AREA[1]
  log_aspect = np.log(height / width)
  assert abs(log_aspect.mean()) < 0.02  # symmetric about 1: tall as often as wide
  assert abs((log_aspect > 0).mean() - (log_aspect < 0).mean()) < 0.03
  low, high = np.log(ASPECT)
  assert log_aspect.min() >= 1.05 * low and log_aspect.max() <= 1.05 * high
  # Inside the range the log-aspect is flat: each third holds about a third of the boxes.
  thirds = np.histogram(log_aspect, bins=3, range=(low, high))[0] / len(log_aspect)
  assert np.abs(thirds - 1 / 3).max() < 0.03


def test_several_boxes_share_the_area():
  _, _, height, width = _boxes(count=3)
  assert abs((height * width / 224**2).mean() * 3 - _conditional_mean_area()) < 0.02 * sum(AREA) / 2


def _image(seed=0, shape=(32, 32, 3)):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize('mode', ['pixel', 'rand', 'const'])
def test_erasing_fills_a_box_as_the_mode_says_and_is_the_same_for_the_same_key(mode):
  image, config = _image(), _erasing(erase_mode=mode)
  erase = jax.jit(jax.vmap(lambda key: augment.random_erase(key, image, config)))
  keys = jax.random.split(jax.random.PRNGKey(1), 8)
  out = np.asarray(erase(keys))
  np.testing.assert_array_equal(out, erase(keys))
  assert len({row.tobytes() for row in out}) == 8
  noise = []
  for row in out:
    changed = (row != np.asarray(image)).any(-1)
    rows, cols = np.nonzero(changed)
    box = np.zeros_like(changed)
    box[rows.min():rows.max() + 1, cols.min():cols.max() + 1] = True
    np.testing.assert_array_equal(changed, box)  # one rectangle, the rest untouched
    inside = row[box]
    if mode == 'const':
      assert (inside == 0).all()
    elif mode == 'rand':
      assert (inside == inside[0]).all() and inside[0].std() > 0  # one colour, channels apart
    else:
      noise.append(inside.ravel())
  if mode == 'pixel':  # standard normal: normalised data has unit variance, so the noise looks like it
    noise = np.concatenate(noise)
    assert noise.size > 2000 and abs(noise.mean()) < 0.08 and abs(noise.std() - 1) < 0.06


def test_erase_count_draws_one_to_count_boxes():
  config = _erasing(erase_count=3, erase_mode='const', erase_area=(0.01, 0.01), erase_aspect=(1.0, 1.0))
  image = jnp.ones((96, 96, 1))
  out = jax.jit(jax.vmap(lambda key: augment.random_erase(key, image, config)))(
      jax.random.split(jax.random.PRNGKey(0), 300))
  # Boxes of 96 x 96 x 0.01 / count pixels: one of 10 x 10, two of 7 x 7 or three of 6 x 6 (fewer
  # pixels where they overlap).
  erased = (np.asarray(out) == 0).sum(axis=(1, 2, 3))
  assert ((erased >= 36) & (erased <= 108)).all()
  assert 0.2 < (erased == 100).mean() < 0.47  # a third of the images get one box
  assert (erased == 98).any() and (erased == 108).any()  # two, three apart


def test_the_batch_erases_each_example_by_its_position_with_erase_prob():
  images = jnp.stack([_image(seed) for seed in range(64)])
  config = _erasing(erase_prob=0.5, erase_mode='const')
  key, positions = jax.random.PRNGKey(3), jnp.arange(64)
  erase = jax.jit(lambda key, images, positions: augment.erase_batch(key, images, positions, config))
  out = erase(key, images, positions)
  erased = np.asarray((out != images).any(axis=(1, 2, 3)))
  assert 0.3 < erased.mean() < 0.7
  # An example's pixels depend on its position in the global batch, not on where it sits in this array
  # (another device's share of the batch gets the same).
  np.testing.assert_array_equal(erase(key, images[::-1], positions[::-1]), out[::-1])
  assert not np.array_equal(erase(jax.random.PRNGKey(4), images, positions), out)
  off = defaults.get_config().augment
  assert augment.erase_batch(key, images, positions, off) is images


# --- AutoAugment ------------------------------------------------------------------------------------


def _torchvision_imagenet_policy():
  """torchvision's AutoAugmentPolicy.IMAGENET list, read from its source (importing it is not needed)."""
  spec = importlib.util.find_spec('torchvision')
  if spec is None:
    pytest.skip('torchvision is not installed')
  source = pathlib.Path(spec.submodule_search_locations[0], 'transforms', 'autoaugment.py').read_text()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.If) and 'AutoAugmentPolicy.IMAGENET' in ast.unparse(node.test):
      return ast.literal_eval(node.body[0].value)
  raise AssertionError('no IMAGENET policy in torchvision/transforms/autoaugment.py')


def test_the_imagenet_policy_is_the_papers_as_torchvision_has_it():
  policy = ra.AUTOAUGMENT_IMAGENET
  assert [list(map(tuple, sub_policy)) for sub_policy in _torchvision_imagenet_policy()] == [
      list(sub_policy) for sub_policy in policy]
  assert len(policy) == 25 and all(len(sub_policy) == 2 for sub_policy in policy)
  ops = {op for sub_policy in policy for op, _, _ in sub_policy}
  assert ops == {'Posterize', 'Rotate', 'Solarize', 'AutoContrast', 'Equalize', 'Color', 'Contrast',
                 'Invert', 'Sharpness', 'ShearX'}
  # The first and last sub-policies of the paper's Table 9 (Cubuk et al. 2018).
  assert policy[0] == (('Posterize', 0.4, 8), ('Rotate', 0.6, 9))
  assert policy[-1] == (('Equalize', 0.8, None), ('Equalize', 0.6, None))


def test_sub_policy_levels_are_torchvisions_bins():
  # torchvision: linspace(0, max, 10)[bin]; Posterize keeps 8 - round(bin / 2.25) bits; Solarize
  # inverts at linspace(255, 0, 10)[bin].
  image_shape = (32, 32, 3)
  assert ra.autoaugment_step(0, 0, image_shape) == ('Posterize', 0.4, pytest.approx(4 * 8 / 9))
  assert round(ra.autoaugment_step(3, 0, image_shape)[2]) == 8 - (8 - round(7 / 2.25))
  assert ra.autoaugment_step(0, 1, image_shape)[2] == pytest.approx(30.0)
  assert 255 - ra.autoaugment_step(1, 0, image_shape)[2] == pytest.approx(np.linspace(255, 0, 10)[5])
  assert ra.autoaugment_step(18, 0, image_shape) == ('ShearX', 0.6, pytest.approx(0.3 * 5 / 9))
  assert ra.autoaugment_step(10, 1, image_shape) == ('Color', 0.4, 0.0)
  assert ra.autoaugment_step(1, 1, image_shape) == ('AutoContrast', 0.6, 0.0)


def test_autoaugment_applies_the_drawn_sub_policy_per_key():
  image = jnp.asarray(np.random.default_rng(0).integers(0, 256, (24, 24, 3)), jnp.uint8)
  keys = jax.random.split(jax.random.PRNGKey(0), 64)
  apply = jax.jit(jax.vmap(lambda key: ra.apply(key, image, policy='autoaugment', num_layers=2, magnitude=9)))
  out = np.asarray(apply(keys))
  assert out.dtype == np.uint8 and out.shape == (64, 24, 24, 3)
  np.testing.assert_array_equal(out, apply(keys))
  apply_op = jax.jit(ra.apply_op, static_argnums=1)
  for key, row in zip(keys[:16], out[:16]):
    # The draws as _autoaugment makes them, the ops applied one by one.
    sub_policy, draws, negate = ra.autoaugment_draws(key)
    sub_policy, expected = int(sub_policy), image
    for step in range(2):
      op, probability, level = ra.autoaugment_step(sub_policy, step, image.shape)
      if draws[step] <= probability:
        expected = apply_op(expected, op, -level if op in ra._SIGNED and negate[step] else level)
    np.testing.assert_array_equal(row, expected, err_msg=str(ra.AUTOAUGMENT_IMAGENET[sub_policy]))
  assert 20 <= sum(not np.array_equal(row, image) for row in out) < 64  # Equalize 0.0 / 0.8 and such


def test_the_train_step_erases_the_normalised_images_when_asked():
  """augment.erase_prob reaches the train step: the same state and batch give another loss with
  erasing on, and the same loss with it off (erase_batch is identity at erase_prob=0)."""
  from flaxtpu import models  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import steps  # pylint: disable=g-import-not-at-top

  def loss(erase_prob: float) -> float:
    augment_config = _erasing(erase_prob=erase_prob)
    task = steps.Task(model=models.create('cnn', num_classes=4), num_classes=4, image_shape=(16, 16, 3),
                      augment=augment_config, label_smoothing=0.0, mean=None, std=None,
                      optimizer=optax.sgd(0.1))
    params = task.model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)), train=False)['params']
    state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params, batch_stats={}, ema={},
                             opt_state=task.optimizer.init(params), rng=jax.random.PRNGKey(0))
    images = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3)), jnp.uint8)
    return float(steps.train_step(state, (images, jnp.arange(8) % 4), task=task)[1].loss.compute())

  assert loss(0.0) == loss(0.0)
  assert loss(1.0) != loss(0.0)
