"""An outside probe of every model family at tiny image sizes (issue 70). The default model, the Keras
CNN, left no pixel to average below 8x8 (unpadded 3x3, 2x2 pooling, unpadded 3x3): it trained on empty
feature maps, its loss NaN at step 1, and the run stopped blaming the learning rate. Now such sizes are
refused in one line naming the smallest, as every other family's are."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import ROOT, make_image_folder
from flaxtpu.models import registry
from flaxtpu.settings.errors import UserError


@pytest.mark.parametrize('side', range(1, 11))
def test_the_cnn_is_refused_exactly_where_it_pools_an_image_to_nothing(side):
  model = registry.create('cnn', num_classes=3)
  images = jnp.zeros((1, side, side, 3))
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), images, train=False))
  _, state = jax.eval_shape(lambda v: model.apply(v, images, train=False, capture_intermediates=True,
                                                  mutable=['intermediates']), variables)
  empty = any(0 in leaf.shape for leaf in jax.tree_util.tree_leaves(state))
  if empty:
    with pytest.raises(UserError, match=f'cnn pools {side}x{side} images to nothing: it needs at least 8x8'):
      registry.check_image_shape('cnn', (side, side, 3))
  else:
    registry.check_image_shape('cnn', (side, side, 3))
  assert empty == (side < 8)


def test_training_the_cnn_on_images_too_small_for_it_is_one_line(tmp_path):
  folder = make_image_folder(tmp_path / 'images', size=8)
  process = subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10.py', f'--workdir={tmp_path / "run"}',
       f'--config.dataset.folder={folder}', '--config.dataset.image_size=7', '--config.batch_size=8',
       '--config.num_train_steps=2', '--config.cpu_devices=1'],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert process.returncode == 2 and 'Traceback' not in process.stderr, process.stderr[-2000:]
  assert [line for line in process.stderr.splitlines() if line.startswith('error')] == [
      'error: cnn pools 7x7 images to nothing: it needs at least 8x8; set --config.dataset.image_size=8 (or '
      'larger) or pick another model']


@pytest.mark.parametrize('dtype, cause', [('float32', ''),
                                          ('bfloat16', ' or a bfloat16 overflow (try dtype=float32)')])
def test_the_divergence_line_names_an_overflow_only_where_a_narrower_type_can_overflow(dtype, cause):
  """A float32 run was told 'a float32 overflow (try dtype=float32)'."""
  from configs import digits
  from flaxtpu.loop import divergence

  class Saved:
    directory = '/runs/x/checkpoints'

    def all_steps(self):
      return [4]

  config = digits.get_config()
  config.dtype = dtype
  assert divergence.message(config, 5, Saved()) == (
      'the training loss became NaN/Inf at step 5; likely causes: a learning rate too high '
      f'(optimizer.learning_rate={config.optimizer.learning_rate}: lower it, add warmup or '
      f'optimizer.grad_clip_norm){cause}; nothing from that step on was saved; the last good checkpoint, '
      'step 4 in /runs/x/checkpoints, is intact: change the config and run the same command to resume from '
      'it')
