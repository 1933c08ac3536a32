"""The model registry: `create(name, num_classes=..., ...)` builds any model by name."""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxtpu.errors import UserError
from flaxtpu.models.cnn import CNN, ConvStage
from flaxtpu.models.resnet import BasicBlock, BottleneckBlock, ResNet

_cifar = functools.partial(ResNet, block=BasicBlock, stem='cifar', width=16)
_imagenet = functools.partial(ResNet, stem='imagenet', width=64)

# name -> (constructor, the unit that remat wraps)
_MODELS = {
    'cnn': (CNN, 'stage', ConvStage),
    'resnet20': (functools.partial(_cifar, stage_sizes=(3, 3, 3)), 'block', BasicBlock),
    'resnet32': (functools.partial(_cifar, stage_sizes=(5, 5, 5)), 'block', BasicBlock),
    'resnet44': (functools.partial(_cifar, stage_sizes=(7, 7, 7)), 'block', BasicBlock),
    'resnet56': (functools.partial(_cifar, stage_sizes=(9, 9, 9)), 'block', BasicBlock),
    'resnet110': (functools.partial(_cifar, stage_sizes=(18, 18, 18)), 'block', BasicBlock),
    'resnet18': (functools.partial(_imagenet, stage_sizes=(2, 2, 2, 2)), 'block', BasicBlock),
    'resnet34': (functools.partial(_imagenet, stage_sizes=(3, 4, 6, 3)), 'block', BasicBlock),
    'resnet50': (functools.partial(_imagenet, stage_sizes=(3, 4, 6, 3)), 'block', BottleneckBlock),
    'resnet101': (functools.partial(_imagenet, stage_sizes=(3, 4, 23, 3)), 'block', BottleneckBlock),
    'resnet152': (functools.partial(_imagenet, stage_sizes=(3, 8, 36, 3)), 'block', BottleneckBlock),
}
NAMES = tuple(_MODELS)


def remat_policy(name: str):
  """'full' recomputes everything (no policy); other names are jax.checkpoint_policies."""
  return None if name == 'full' else getattr(jax.checkpoint_policies, name)


def create(name: str, *, num_classes: int, dtype: str = 'float32', remat: str = 'none',
           bn_axis_name: Optional[str] = None) -> nn.Module:
  """Builds model `name`; `remat` wraps each block (ResNet) or stage (CNN) in jax.checkpoint.

  `bn_axis_name` makes BatchNorm average its statistics over that pmap axis,
  so that pmap computes the same statistics as one global batch.
  """
  if name not in _MODELS:
    raise UserError(f'unknown model {name!r}; choose one of: {", ".join(NAMES)}')
  constructor, unit_field, unit = _MODELS[name]
  kwargs = dict(num_classes=num_classes, dtype=jnp.dtype(dtype))
  if remat != 'none':
    kwargs[unit_field] = nn.remat(unit, policy=remat_policy(remat))
  elif unit_field == 'block':
    kwargs[unit_field] = unit
  if name != 'cnn':
    kwargs['bn_axis_name'] = bn_axis_name
  return constructor(**kwargs)
