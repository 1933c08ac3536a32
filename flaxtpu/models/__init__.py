"""The model registry: `create(name, num_classes=..., ...)` builds any model by name.

Each family is a plug-in, `flaxtpu/models/<family>.py` (a `family.Family`:
its models, the options they read, the layer-depth map, the published weight
layouts it reads and writes, its hooks), registered here with one line; its
Flax network lives in `flaxtpu/models/nets/`. `NAMES` is the one list of
valid model names. This file imports no JAX or Flax at module level, so the
CLI validates `model.name` (and which options a model takes) before JAX
starts; `create` imports the model code.

The registry itself is `registry.py` (`register`, `NAMES`, `create`, ...), which imports
no family; its names are this package's. `NAMES` is read from it on every access, since
each `register` rebinds it.
"""

from __future__ import annotations

from flaxtpu.models import (
  cnn,
  convnext,
  efficientnet,
  fastnet,
  mobilenetv3,
  registry,
  regnet,
  resnet,
  swin,
  vit,
)
from flaxtpu.models.family import Family, Layout, Spec
from flaxtpu.models.registry import (
  DOWNSAMPLES,
  GELUS,
  LEGACY_OPTIONS,
  OPTIONS,
  PADDINGS,
  POOLS,
  check_image_shape,
  create,
  data_fit,
  families,
  get_family,
  get_spec,
  layer_depths,
  layout,
  no_timm_twin,
  register,
  remat_policy,
  unregister,
)

for _family in (cnn.FAMILY, fastnet.FAMILY, resnet.CIFAR, resnet.IMAGENET, vit.FAMILY, convnext.FAMILY,
                swin.FAMILY, efficientnet.FAMILY, mobilenetv3.FAMILY, regnet.FAMILY):
  register(_family)

__all__ = [
    'DOWNSAMPLES', 'Family', 'GELUS', 'LEGACY_OPTIONS', 'Layout', 'NAMES', 'OPTIONS', 'PADDINGS', 'POOLS',
    'Spec', 'check_image_shape', 'create', 'data_fit', 'families', 'get_family', 'get_spec',
    'layer_depths', 'layout', 'no_timm_twin', 'register', 'remat_policy', 'unregister',
]


def __getattr__(name: str):
  """`NAMES` (each `register` rebinds it) and the registry's other names, read from the registry."""
  try:
    return getattr(registry, name)
  except AttributeError:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}') from None
