"""The model registry: `create(name, num_classes=..., ...)` builds any model by name.

`NAMES` is the one list of valid model names. This file imports no JAX or
Flax at module level, so the CLI validates `model.name` (and which options a
model takes) before JAX starts; `create` imports the model code.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from flaxtpu.errors import UserError


@dataclasses.dataclass(frozen=True)
class Spec:
  family: str  # 'cnn' | 'fastnet' | 'cifar_resnet' | 'imagenet_resnet' | 'vit' | 'convnext'
  stage_sizes: tuple[int, ...] = ()  # blocks per stage (ResNet, ConvNeXt); (depth,) for ViT
  bottleneck: bool = False
  widths: tuple[int, ...] = ()  # channels per stage (ConvNeXt); (stem, *blocks) for FastNet; (width,) for ViT
  num_heads: int = 0  # ViT
  mlp_dim: int = 0  # ViT
  patch_size: int = 0  # the published patch (ViT) or stem stride (ConvNeXt); 0 = no patches
  whiten: bool = False  # FastNet: airbench94's data-fitted whitening stem and initialisation

  @property
  def options(self) -> tuple[str, ...]:
    """The `create` options (config.model.* keys) this model reads; the others must keep their defaults."""
    return {'vit': ('patch_size', 'pool', 'dropout', 'drop_path', 'gelu'),
            'convnext': ('patch_size', 'drop_path'),
            'cifar_resnet': ('drop_path', 'padding'),
            'imagenet_resnet': ('drop_path', 'padding')}.get(self.family, ())


_SPECS = {
    'cnn': Spec('cnn'),
    'fastnet_s': Spec('fastnet', widths=(16, 16, 32, 64)),
    'fastnet': Spec('fastnet', widths=(24, 64, 256, 256)),
    'fastnet_whiten': Spec('fastnet', widths=(24, 64, 256, 256), whiten=True),
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
    'vit_ti': Spec('vit', (12,), widths=(192,), num_heads=3, mlp_dim=768, patch_size=16),
    'vit_s': Spec('vit', (12,), widths=(384,), num_heads=6, mlp_dim=1536, patch_size=16),
    'vit_b': Spec('vit', (12,), widths=(768,), num_heads=12, mlp_dim=3072, patch_size=16),
    'convnext_t': Spec('convnext', (3, 3, 9, 3), widths=(96, 192, 384, 768), patch_size=4),
}
NAMES = tuple(_SPECS)
POOLS = ('gap', 'tok')
PADDINGS = ('torch', 'same')  # resnet: symmetric as PyTorch | XLA's SAME (runs saved before model.padding)
GELUS = ('exact', 'tanh')  # vit: erf as timm | tanh as big_vision (runs saved before model.gelu)
# What a run saved before a model option existed computed; config.from_saved fills these in.
LEGACY_OPTIONS = {'padding': 'same', 'gelu': 'tanh'}


def get_spec(name: str) -> Spec:
  """The spec of model `name`, or a UserError listing the valid names."""
  if name not in _SPECS:
    raise UserError(f'unknown model {name!r}; choose one of: {", ".join(NAMES)}')
  return _SPECS[name]


def remat_policy(name: str):
  """'full' recomputes everything (no policy); other names are jax.checkpoint_policies."""
  import jax  # pylint: disable=g-import-not-at-top
  return None if name == 'full' else getattr(jax.checkpoint_policies, name)


def check_image_shape(name: str, image_shape: tuple[int, ...], patch_size: int = 0) -> None:
  """Raises UserError naming config.model.patch_size when the patches do not tile the images,
  or config.dataset.image_size when the images are too small for the model's pooling."""
  spec = get_spec(name)
  patch = patch_size or spec.patch_size
  height, width = image_shape[:2]
  # Each FastNet block halves the side; the whitening stem's unpadded 2x2 kernel takes one pixel.
  smallest = 2 ** (len(spec.widths) - 1) + spec.whiten if spec.family == 'fastnet' else 1
  if min(height, width) < smallest:
    raise UserError(f'{name} pools {height}x{width} images to nothing: '
                    f'it needs at least {smallest}x{smallest}; '
                    f'set --config.dataset.image_size={smallest} (or larger) or pick another model')
  if patch and (height % patch or width % patch):
    divisors = [d for d in range(1, min(height, width) + 1) if height % d == 0 and width % d == 0]
    shown = f'{patch_size}' if patch_size else f'0 (= {patch}, the published size for {name})'
    raise UserError(f'config.model.patch_size={shown} does not divide the {height}x{width} images; '
                    f'choose one of {", ".join(map(str, divisors))} (or change config.dataset.image_size)')


def create(name: str, *, num_classes: int, dtype: str = 'float32', remat: str = 'none',
           bn_axis_name: Optional[str] = None, patch_size: int = 0, pool: str = 'gap',
           dropout: float = 0.0, drop_path: float = 0.0, padding: str = 'torch', gelu: str = 'exact',
           image_shape: Optional[tuple[int, ...]] = None):
  """Builds model `name`; `remat` wraps each block (ResNet, ViT, ConvNeXt) or stage (CNN) in jax.checkpoint.

  `bn_axis_name` makes BatchNorm average its statistics over that pmap axis,
  so that pmap computes the same statistics as one global batch. `patch_size`
  (0 = the published one), `pool`, `dropout`, `drop_path`, `padding` (ResNet)
  and `gelu` (ViT) configure the families that read them (`Spec.options` says
  which); given `image_shape`, the patches are checked to tile it.
  """
  # pylint: disable=g-import-not-at-top
  import flax.linen as nn
  import jax.numpy as jnp

  from flaxtpu.models import cnn, convnext, fastnet, resnet, vit
  spec = get_spec(name)
  if image_shape is not None:
    check_image_shape(name, image_shape, patch_size)
  wrap = (lambda unit: unit) if remat == 'none' else (
      lambda unit: nn.remat(unit, policy=remat_policy(remat)))
  dtype = jnp.dtype(dtype)
  if spec.family == 'cnn':
    return cnn.CNN(num_classes=num_classes, dtype=dtype, stage=wrap(cnn.ConvStage))
  if spec.family == 'fastnet':
    return fastnet.FastNet(num_classes=num_classes, stem_width=spec.widths[0], widths=spec.widths[1:],
                           block=wrap(fastnet.ConvBlock), dtype=dtype, bn_axis_name=bn_axis_name,
                           whiten=spec.whiten)
  if spec.family == 'vit':
    return vit.ViT(num_classes=num_classes, patch_size=patch_size or spec.patch_size,
                   width=spec.widths[0], depth=spec.stage_sizes[0], num_heads=spec.num_heads,
                   mlp_dim=spec.mlp_dim, block=wrap(vit.EncoderBlock), pool=pool, dropout=dropout,
                   drop_path=drop_path, gelu=gelu, dtype=dtype)
  if spec.family == 'convnext':
    return convnext.ConvNeXt(num_classes=num_classes, stage_sizes=spec.stage_sizes,
                             stage_widths=spec.widths, block=wrap(convnext.ConvNeXtBlock),
                             patch_size=patch_size or spec.patch_size, drop_path=drop_path, dtype=dtype)
  block = resnet.BottleneckBlock if spec.bottleneck else resnet.BasicBlock
  stem, width = ('cifar', 16) if spec.family == 'cifar_resnet' else ('imagenet', 64)
  return resnet.ResNet(stage_sizes=spec.stage_sizes, block=wrap(block), stem=stem, width=width,
                       num_classes=num_classes, dtype=dtype, bn_axis_name=bn_axis_name, drop_path=drop_path,
                       padding=padding)
