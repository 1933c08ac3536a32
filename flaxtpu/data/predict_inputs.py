"""Prediction inputs (`--mode=predict`): an image file or a folder of them, preprocessed as for
evaluation."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

from flaxtpu.data import preprocess
from flaxtpu.data.preprocess import IMAGE_EXTENSIONS, Transform
from flaxtpu.data.sources.base import DataError, unreadable
from flaxtpu.data.sources.folder import image_files


def prepare(path: str, image_shape: tuple[int, int, int], transform: Transform) -> np.ndarray:
  """One image file as the model sees it in evaluation: uint8 [H, W, C]."""
  height, width, channels = image_shape
  image = preprocess.open_image(path)
  if transform.size:
    return preprocess.eval_image(image, dataclasses.replace(transform, channels=channels))
  # a model trained at native size: resize to it, as Keras' predict pipelines do
  decoded = preprocess.decode(image, channels)
  return preprocess.to_array(decoded.resize((width, height)) if decoded.size != (width, height) else decoded,
                             channels)


def read_images(path: str, image_shape: tuple[int, int, int], transform: Transform,
                skip_corrupt: bool = False) -> tuple[list[str], np.ndarray]:
  """An image file, or every image under a folder (sorted), preprocessed as for evaluation.

  A file that cannot be read is a DataError naming it, or with `skip_corrupt`
  a warning naming it, and it is left out of the paths returned.
  """
  if os.path.isdir(path):
    paths = sorted(image_files(path))
    if not paths:
      raise DataError(f'config.predict.input={path!r} holds no images ({", ".join(IMAGE_EXTENSIONS)})')
  elif os.path.isfile(path):
    paths = [path]
  else:
    raise DataError(f'config.predict.input={path!r} does not exist; give an image file or a folder')
  kept, images = [], []
  for image_path in paths:
    try:
      array = prepare(image_path, image_shape, transform)
    except Exception as e:  # pylint: disable=broad-except
      reason = unreadable(image_path, e)
      if not skip_corrupt:
        raise DataError(f'{reason}, or set --config.dataset.skip_corrupt=true to skip such files') from e
      print(f'warning: {reason}; skipped (dataset.skip_corrupt)', file=sys.stderr, flush=True)
      continue
    kept.append(image_path)
    images.append(array)
  if not images:
    raise DataError(f'none of the {len(paths)} images in config.predict.input={path!r} can be read; '
                    'give readable images')
  return kept, np.stack(images)
