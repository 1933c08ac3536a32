"""Explanations: Grad-CAM heatmaps of what a model looked at (`--mode=predict --config.predict.explain`),
mapped back onto each image's own pixels, and the overlays that predict and the eval report's mistakes
picture show.

Grad-CAM (Selvaraju et al. 2017) weighs a feature map's channels by the mean gradient of a class's
logit and keeps the positive part. The feature map is the output of the module the model's family
names (`Family.feature_map`; by default the last module returning a [batch, H, W, C] map, so every
convolutional family, Swin's last stage included, needs nothing declared); a ViT names the norm of its
last block, whose patch tokens are laid back on their grid. The map is reached without editing any
network: `flax.linen.intercept_methods` adds a zero to that module's output and `jax.vjp` takes the
logit's gradient with respect to it. One jitted function explains a whole batch.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Optional, Sequence

import cv2
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from PIL import Image

from flaxtpu import models
from flaxtpu.augmentation import augment, image_sizes
from flaxtpu.data import preprocess
from flaxtpu.data.preprocess import Transform
from flaxtpu.io import files
from flaxtpu.settings.errors import UserError
from flaxtpu.step import steps

MAX_PREFIX_TOKENS = 8  # class, distillation and register tokens before a ViT's patches


def _module_outputs(model, variables, images, record: Callable[[tuple[str, ...], Any], Any]):
  """The model's logits, each module's `__call__` output passed through `record(path, output)`."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  def interceptor(next_fun, args, kwargs, context):
    output = next_fun(*args, **kwargs)
    if context.method_name == '__call__' and isinstance(output, jax.Array):
      output = record(tuple(context.module.path), output)
    return output

  with nn.intercept_methods(interceptor):
    return model.apply(variables, images, train=False)


def find_feature_map(model, variables, image_shape: tuple[int, int, int],
                     declared: tuple[str, ...] = ()) -> tuple[str, ...]:
  """The path of the module Grad-CAM explains: `declared`, or the last one returning [batch, H, W, C]."""
  seen = []

  def record(path, output):
    seen.append((path, output.shape))
    return output

  jax.eval_shape(lambda v, x: _module_outputs(model, v, x, record), variables,
                 jax.ShapeDtypeStruct((1, *image_shape), jnp.float32))
  if declared:
    if not any(path == declared for path, _ in seen):
      raise UserError(f'the model has no module {"/".join(declared)} for Grad-CAM (its family\'s '
                      'feature_map); name one of its modules')
    return declared
  spatial = [path for path, shape in seen if len(shape) == 4 and shape[1] * shape[2] > 1]
  if not spatial:
    raise UserError('the model returns no [batch, H, W, C] feature map to explain; its family must name '
                    'one (Family.feature_map)')
  return spatial[-1]


def _token_grid(tokens: int, height: int, width: int) -> tuple[int, int]:
  """(rows, cols) of the patch tokens among `tokens` of a height x width image: the patch size that
  leaves at most MAX_PREFIX_TOKENS before them."""
  for patch in range(1, min(height, width) + 1):
    rows, cols = height // patch, width // patch
    if 0 <= tokens - rows * cols <= MAX_PREFIX_TOKENS:
      return rows, cols
  raise UserError(f'cannot lay {tokens} tokens on the patch grid of a {height}x{width} image')


class GradCam:
  """Grad-CAM of a model: uint8 images [B, S, S, C] -> heatmaps in [0, 1] at the input's size.

  `variables` are the model's ({'params', 'batch_stats'}); `mean`/`std` standardise as the run did
  (None keeps [0, 1]). The class explained is each image's top class unless one is given.
  """

  def __init__(self, model, variables: dict, image_shape: tuple[int, int, int], mean=None, std=None,
               declared: tuple[str, ...] = ()):
    self.model, self.image_shape, self.mean, self.std = model, tuple(image_shape), mean, std
    self.variables = variables
    self.path = find_feature_map(model, variables, self.image_shape, declared)
    self._jitted = jax.jit(self._heatmaps)

  def _heatmaps(self, variables, images, classes):
    path = self.path
    pixels = augment.normalize(images, self.mean, self.std)
    height, width = self.image_shape[:2]

    def forward(delta):
      kept = []

      def record(module_path, output):
        if module_path == path:
          output = output + delta.astype(output.dtype)
          kept.append(output)
        return output

      logits = _module_outputs(self.model, variables, pixels, record)
      return logits.astype(jnp.float32), kept[-1].astype(jnp.float32)

    shape = jax.eval_shape(forward, jnp.zeros(()))[1].shape
    logits, backward, features = jax.vjp(forward, jnp.zeros(shape, jnp.float32), has_aux=True)
    target = jnp.where(classes < 0, jnp.argmax(logits, axis=-1), classes)
    (gradients,) = backward(jax.nn.one_hot(target, logits.shape[-1], dtype=jnp.float32))
    if features.ndim == 3:  # ViT tokens [batch, tokens, width]: the patches on their grid
      rows, cols = _token_grid(features.shape[1], height, width)
      on_grid = lambda x: x[:, x.shape[1] - rows * cols:].reshape(x.shape[0], rows, cols, x.shape[-1])
      features, gradients = on_grid(features), on_grid(gradients)
    weights = jnp.mean(gradients, axis=(1, 2), keepdims=True)
    cam = jax.nn.relu(jnp.sum(weights * features, axis=-1))
    cam = jax.nn.relu(jax.image.resize(cam, (cam.shape[0], height, width), 'bilinear'))
    return cam / jnp.maximum(jnp.max(cam, axis=(1, 2), keepdims=True), 1e-12), target

  def __call__(self, images: np.ndarray, classes: Optional[np.ndarray] = None,
               batch_size: int = 64, variables: Optional[dict] = None) -> tuple[np.ndarray, np.ndarray]:
    """(float32 heatmaps [N, S, S], the classes explained [N]) in fixed-size padded batches."""
    variables = self.variables if variables is None else variables
    classes = np.full(len(images), -1, np.int32) if classes is None else np.asarray(classes, np.int32)
    batch_size = max(1, min(batch_size, len(images)))
    maps, explained = [], []
    for start in range(0, len(images), batch_size):
      chunk, wanted = images[start:start + batch_size], classes[start:start + batch_size]
      pad = batch_size - len(chunk)
      chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
      wanted = np.concatenate([wanted, np.full(pad, -1, np.int32)])
      cam, target = self._jitted(variables, jnp.asarray(chunk), jnp.asarray(wanted))
      maps.append(np.asarray(cam, np.float32)[:batch_size - pad])
      explained.append(np.asarray(target)[:batch_size - pad])
    return np.concatenate(maps), np.concatenate(explained)


def for_restored(config: ml_collections.ConfigDict, record: dict, state) -> GradCam:
  """Grad-CAM of a restored checkpoint (`modes.restore`): its model built without remat, which
  computes the same function with the same parameters."""
  if config.model.remat != 'none':
    config = config.copy_and_resolve_references()  # a copy: the run's config is never edited
    with config.unlocked():
      config.model.remat = 'none'
  norm = record['normalization']
  task = steps.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']), mean=norm['mean'], std=norm['std'])
  # Under pmap the state holds one copy per device: the first will do.
  first = config.parallelism == 'pmap'
  gather = lambda x: np.asarray(jax.device_get(x[0] if first else x))
  variables = {'params': jax.tree.map(gather, state.params),
               'batch_stats': jax.tree.map(gather, state.batch_stats)}
  family = models.get_family(config.model.name)
  # Heatmaps of the images eval and predict read: at eval.image_size when it is set.
  return GradCam(task.model, variables, image_sizes.eval_shape(config, task.image_shape), task.mean, task.std,
                 declared=family.feature_map(models.get_spec(config.model.name)))


def to_original(heatmap: np.ndarray, width: int, height: int, transform: Transform) -> np.ndarray:
  """A heatmap of the model's input laid on the image's own height x width pixels, through the eval
  preprocessing (resize the shorter side, take the centre crop: `preprocess.centre_crop_box`); pixels
  outside the crop are 0. A model at native size (transform.size 0) saw the whole image resized."""
  box = (preprocess.centre_crop_box(width, height, transform.size, transform.crop_fraction)
         if transform.size else (0, 0, width, height))
  left, top = max(0, round(box[0])), max(0, round(box[1]))
  right, bottom = min(width, max(left + 1, round(box[2]))), min(height, max(top + 1, round(box[3])))
  original = np.zeros((height, width), np.float32)
  original[top:bottom, left:right] = cv2.resize(np.asarray(heatmap, np.float32), (right - left, bottom - top),
                                                interpolation=cv2.INTER_LINEAR)
  return np.clip(original, 0.0, 1.0)


def overlay(image: np.ndarray, heatmap: np.ndarray, alpha: float = 0.5) -> np.ndarray:
  """uint8 RGB [H, W, 3]: the image (gray or RGB, uint8) under the heatmap in the 'jet' colours."""
  image = np.asarray(image)
  if image.ndim == 2 or image.shape[-1] == 1:
    image = np.repeat(image.reshape(*image.shape[:2], 1), 3, axis=-1)
  heat = np.uint8(np.round(255 * np.clip(heatmap, 0, 1)))
  colours = cv2.cvtColor(cv2.applyColorMap(heat, cv2.COLORMAP_JET), cv2.COLOR_BGR2RGB)
  return np.uint8(np.round((1 - alpha) * image.astype(np.float32) + alpha * colours.astype(np.float32)))


def output_names(paths: Sequence[str], root: str) -> list[str]:
  """Each image's file name without extension, relative to `root` (a folder input's subfolders kept,
  so a.jpg in two class folders never share a name); two files of one folder with the same stem
  (a.jpg, a.png) keep their extension instead ('a.jpg', 'a.png')."""
  relative = [os.path.relpath(p, root) if os.path.isdir(root) else os.path.basename(p) for p in paths]
  stems = [os.path.splitext(r)[0] for r in relative]
  counts: dict[str, int] = {}
  for stem in stems:
    counts[stem] = counts.get(stem, 0) + 1
  return [stem if counts[stem] == 1 else name for stem, name in zip(stems, relative)]


def write_explanations(paths: Sequence[str], heatmaps: np.ndarray, transform: Transform, channels: int,
                       directory: str, root: str) -> list[str]:
  """`directory`/NAME.npy (float32 H x W at each image's own size) and NAME.overlay.png per image
  (`output_names`); returns the .npy paths. Each file is written whole (temporary name, rename)."""
  written = []
  for path, heatmap, name in zip(paths, heatmaps, output_names(paths, root)):
    image = preprocess.to_array(preprocess.decode(preprocess.open_image(path), channels), channels)
    original = to_original(heatmap, image.shape[1], image.shape[0], transform)
    target = os.path.join(directory, name)
    files.makedirs(os.path.dirname(target))
    files.atomic_write(target + '.npy', functools.partial(_save_npy, original))
    picture = overlay(image, original)
    files.atomic_write(target + '.overlay.png',
                       lambda temporary, p=picture: Image.fromarray(p).save(temporary, format='PNG'))
    written.append(target + '.npy')
  return written


def _save_npy(array: np.ndarray, temporary: str) -> None:
  with open(temporary, 'wb') as f:
    np.save(f, array)


def pointing_hit(heatmap: np.ndarray, box: tuple[int, int, int, int], tolerance: int = 0) -> bool:
  """The pointing game (Zhang et al. 2016): whether the hottest pixel lies in `box` (left, top, right,
  bottom, exclusive), widened by `tolerance` pixels."""
  row, col = np.unravel_index(int(np.argmax(heatmap)), heatmap.shape)
  left, top, right, bottom = box
  return (left - tolerance <= col < right + tolerance) and (top - tolerance <= row < bottom + tolerance)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
  """Spearman's rank correlation of two heatmaps (scipy), 0 when either is constant."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  a, b = np.ravel(a), np.ravel(b)
  if np.ptp(a) == 0 or np.ptp(b) == 0:
    return 0.0
  value = stats.spearmanr(a, b).statistic
  return 0.0 if math.isnan(value) else float(value)


def overlaid(explainer: GradCam) -> Callable[[np.ndarray], np.ndarray]:
  """image -> the image under its Grad-CAM heatmap of its top class (the eval report's mistakes)."""
  return lambda image: overlay(image, explainer(np.asarray(image)[None], batch_size=1)[0][0])
