"""The model registry: `create(name, num_classes=..., ...)` builds any model by name.

`NAMES` is the one list of valid model names. This file imports no JAX or
Flax at module level, so the CLI validates `model.name` against it before
JAX starts; `create` imports the model code.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from flaxtpu.errors import UserError


@dataclasses.dataclass(frozen=True)
class Spec:
  family: str  # 'cnn' | 'cifar_resnet' | 'imagenet_resnet'
  stage_sizes: tuple[int, ...] = ()
  bottleneck: bool = False


_SPECS = {
    'cnn': Spec('cnn'),
    'resnet20': Spec('cifar_resnet', (3, 3, 3)),
    'resnet32': Spec('cifar_resnet', (5, 5, 5)),
    'resnet44': Spec('cifar_resnet', (7, 7, 7)),
    'resnet56': Spec('cifar_resnet', (9, 9, 9)),
    'resnet110': Spec('cifar_resnet', (18, 18, 18)),
    'resnet18': Spec('imagenet_resnet', (2, 2, 2, 2)),
    'resnet34': Spec('imagenet_resnet', (3, 4, 6, 3)),
    'resnet50': Spec('imagenet_resnet', (3, 4, 6, 3), bottleneck=True),
    'resnet101': Spec('imagenet_resnet', (3, 4, 23, 3), bottleneck=True),
    'resnet152': Spec('imagenet_resnet', (3, 8, 36, 3), bottleneck=True),
}
NAMES = tuple(_SPECS)


def remat_policy(name: str):
  """'full' recomputes everything (no policy); other names are jax.checkpoint_policies."""
  import jax  # pylint: disable=g-import-not-at-top
  return None if name == 'full' else getattr(jax.checkpoint_policies, name)


def create(name: str, *, num_classes: int, dtype: str = 'float32', remat: str = 'none',
           bn_axis_name: Optional[str] = None):
  """Builds model `name`; `remat` wraps each block (ResNet) or stage (CNN) in jax.checkpoint.

  `bn_axis_name` makes BatchNorm average its statistics over that pmap axis,
  so that pmap computes the same statistics as one global batch.
  """
  # pylint: disable=g-import-not-at-top
  import flax.linen as nn
  import jax.numpy as jnp

  from flaxtpu.models import cnn, resnet
  if name not in _SPECS:
    raise UserError(f'unknown model {name!r}; choose one of: {", ".join(NAMES)}')
  spec = _SPECS[name]
  wrap = (lambda unit: unit) if remat == 'none' else (
      lambda unit: nn.remat(unit, policy=remat_policy(remat)))
  if spec.family == 'cnn':
    return cnn.CNN(num_classes=num_classes, dtype=jnp.dtype(dtype), stage=wrap(cnn.ConvStage))
  block = resnet.BottleneckBlock if spec.bottleneck else resnet.BasicBlock
  stem, width = ('cifar', 16) if spec.family == 'cifar_resnet' else ('imagenet', 64)
  return resnet.ResNet(stage_sizes=spec.stage_sizes, block=wrap(block), stem=stem, width=width,
                       num_classes=num_classes, dtype=jnp.dtype(dtype), bn_axis_name=bn_axis_name)
