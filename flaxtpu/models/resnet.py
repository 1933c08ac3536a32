"""The ResNet families (network: nets/resnet.py): CIFAR's resnet20-110 and ImageNet's resnet18-152 with
their variants (ResNet-D, ResNeXt, wide ResNets), whose weights timm and torchvision publish in one layout.

The layout: conv1 (ResNet-D: conv1.0/1/3/4/6), bn1, layerS.B.convN/bnN, downsample.0/1 (ResNet-D:
downsample.1/2 after the pooling), fc.
"""

from __future__ import annotations

import dataclasses
import re

from flaxtpu.models import layouts
from flaxtpu.models.family import Family, Layout, Spec
from flaxtpu.models.layouts import Rule, batch_norm, conv, dense
from flaxtpu.settings.errors import UserError

OPTIONS = ('drop_path', 'padding')
IMAGENET_OPTIONS = (*OPTIONS, 'space_to_depth')  # the 7x7 stem's form (nets/resnet.ImageNetStem)


@dataclasses.dataclass(frozen=True)
class ResNetSpec(Spec):
  groups: int = 1  # ResNeXt: groups of the bottleneck's 3x3 convolution (timm's cardinality)
  base_width: int = 64  # channels per group of the first stage's 3x3 (wide: 128; ResNeXt: 4 or 8)
  deep: bool = False  # ResNet-D: a 3x3 stem of widths 32, 32, 64 and average-pooled shortcuts


def _build(spec: ResNetSpec, *, num_classes, dtype, wrap, bn_axis_name, drop_path, padding,
           space_to_depth=False):
  from flaxtpu.models.nets import resnet  # pylint: disable=g-import-not-at-top
  block = resnet.BottleneckBlock if spec.bottleneck else resnet.BasicBlock
  stem, width = ('cifar', 16) if spec.family == CIFAR.name else ('deep' if spec.deep else 'imagenet', 64)
  if space_to_depth and stem != 'imagenet':
    raise UserError('config.model.space_to_depth=True computes the 7x7 stem of resnet18-152 another way; '
                    'ResNet-D\'s deep stem has none: leave it False for this model')
  return resnet.ResNet(stage_sizes=spec.stage_sizes, block=wrap(block), stem=stem, width=width,
                       groups=spec.groups, base_width=spec.base_width, num_classes=num_classes, dtype=dtype,
                       bn_axis_name=bn_axis_name, drop_path=drop_path, padding=padding,
                       space_to_depth=space_to_depth)


def _layers(spec: ResNetSpec) -> list[tuple[str, ...]]:
  """The stem (ResNet-D's three convolutions), one layer per block, the classifier."""
  return [tuple(f'{module}_{index}' for index in range(3 if spec.deep else 1)
                for module in ('Conv', 'BatchNorm')),
          *[(f'stage{stage}_block{block}',) for stage, size in enumerate(spec.stage_sizes, 1)
            for block in range(1, size + 1)],
          ('Dense_0',)]


# --- timm / torchvision ---------------------------------------------------------------------------


def resnet_rules(stage_sizes, bottleneck: bool, deep: bool = False) -> list[Rule]:
  """timm's and torchvision's ResNet (conv1, bn1, layerS.B.convN/bnN, downsample.0/1, fc); ResNet-D's
  stem is conv1.0/1/3/4/6 and its shortcut downsample.1/2 (downsample.0 is the pooling)."""
  if deep:
    rules = [conv('conv1.0.weight', 'params/Conv_0/kernel'), *batch_norm('conv1.1', 'BatchNorm_0'),
             conv('conv1.3.weight', 'params/Conv_1/kernel'), *batch_norm('conv1.4', 'BatchNorm_1'),
             conv('conv1.6.weight', 'params/Conv_2/kernel'), *batch_norm('bn1', 'BatchNorm_2')]
  else:
    rules = [conv('conv1.weight', 'params/Conv_0/kernel'), *batch_norm('bn1', 'BatchNorm_0')]
  shortcut = (1, 2) if deep else (0, 1)
  convs = 3 if bottleneck else 2
  in_width = 64
  for stage, blocks in enumerate(stage_sizes):
    for block in range(blocks):
      source, target = f'layer{stage + 1}.{block}', f'params/stage{stage + 1}_block{block + 1}'
      for index in range(convs):
        rules.append(conv(f'{source}.conv{index + 1}.weight', f'{target}/Conv_{index}/kernel'))
        rules += batch_norm(f'{source}.bn{index + 1}', f'stage{stage + 1}_block{block + 1}/BatchNorm_{index}')
      out_width = 64 * 2**stage * (4 if bottleneck else 1)
      if block == 0 and (stage > 0 or in_width != out_width):  # where flaxtpu's block projects too
        rules.append(conv(f'{source}.downsample.{shortcut[0]}.weight', f'{target}/Conv_{convs}/kernel'))
        rules += batch_norm(f'{source}.downsample.{shortcut[1]}',
                            f'stage{stage + 1}_block{block + 1}/BatchNorm_{convs}')
      in_width = out_width
  return rules + dense('fc', 'Dense_0')


def _recognise(tensors, where: str):
  keys = set(tensors)
  deep = 'conv1.0.weight' in keys
  if not ((deep or 'conv1.weight' in keys) and 'layer1.0.conv1.weight' in keys):
    return None
  if any(re.fullmatch(r'layer\d+\.\d+\.se\..+', key) for key in keys):
    return None  # an SE-ResNet: foreign.identify names it, rather than a ResNet read without its SE
  stages = tuple(layouts.count(keys, rf'layer{stage}\.(\d+)\..+') for stage in range(1, 5))
  bottleneck = 'layer1.0.conv3.weight' in keys
  stem = tensors['conv1.0.weight' if deep else 'conv1.weight']
  pooled = any(key.endswith('.downsample.2.weight') for key in keys)
  if deep != pooled or stem.shape[-1] != (3 if deep else 7) or stem.shape[0] != (32 if deep else 64):
    raise UserError(f'{where} is a ResNet variant (its stem or shortcuts differ from resnet18-152 and '
                    f'resnet*d), which no flaxtpu model matches; supported: {IMAGENET.listed()}')
  grouped = tensors['layer1.0.conv2.weight'].shape  # [width, width / groups, 3, 3]
  groups = grouped[0] // grouped[1]
  base_width = grouped[1] if bottleneck else 64
  described = (f'a ResNet with {stages} blocks per stage{" (bottleneck)" if bottleneck else ""}, '
               f'{groups} groups of {base_width} channels in the first stage{", deep stem" if deep else ""}')
  name = IMAGENET.twin(where, described, stage_sizes=stages, bottleneck=bottleneck, groups=groups,
                       base_width=base_width, deep=deep)
  return name, {'padding': 'torch'}


def _timm_architecture(model: str, spec: Spec, options: dict, image_shape, model_args: dict):
  del spec, image_shape
  if options.get('padding', 'torch') != 'torch':
    raise UserError(f'{model} with model.padding={options["padding"]!r} computes another function than '
                    'timm\'s ResNet (XLA SAME padding); '
                    'train with model.padding=torch to export it to timm')
  return model, model_args


TIMM = Layout('timm', ('timm', 'torchvision'), _recognise,
              rules=lambda spec, options, keys: resnet_rules(spec.stage_sizes, spec.bottleneck, spec.deep),
              head=lambda keys: 'fc.bias')

CIFAR = Family('cifar_resnet', {
    'resnet20': ResNetSpec('cifar_resnet', (3, 3, 3)),
    'resnet32': ResNetSpec('cifar_resnet', (5, 5, 5)),
    'resnet44': ResNetSpec('cifar_resnet', (7, 7, 7)),
    'resnet56': ResNetSpec('cifar_resnet', (9, 9, 9)),
    'resnet110': ResNetSpec('cifar_resnet', (18, 18, 18)),
}, _build, _layers, OPTIONS, title='CIFAR ResNet', short_names='resnet20/32/44/56/110',
    input_kernel='params/Conv_0/kernel')

_R = 'imagenet_resnet'
IMAGENET = Family(_R, {
    'resnet18': ResNetSpec(_R, (2, 2, 2, 2)),
    'resnet34': ResNetSpec(_R, (3, 4, 6, 3)),
    'resnet50': ResNetSpec(_R, (3, 4, 6, 3), bottleneck=True),
    'resnet101': ResNetSpec(_R, (3, 4, 23, 3), bottleneck=True),
    'resnet152': ResNetSpec(_R, (3, 8, 36, 3), bottleneck=True),
    # ResNet-D (timm's resnet*d): the deep stem and average-pooled shortcuts
    'resnet18d': ResNetSpec(_R, (2, 2, 2, 2), deep=True),
    'resnet34d': ResNetSpec(_R, (3, 4, 6, 3), deep=True),
    'resnet50d': ResNetSpec(_R, (3, 4, 6, 3), bottleneck=True, deep=True),
    'resnet101d': ResNetSpec(_R, (3, 4, 23, 3), bottleneck=True, deep=True),
    'resnet152d': ResNetSpec(_R, (3, 8, 36, 3), bottleneck=True, deep=True),
    # ResNeXt: resnextD_GxWd has G groups of W channels in the first stage's 3x3 convolutions
    'resnext50_32x4d': ResNetSpec(_R, (3, 4, 6, 3), bottleneck=True, groups=32, base_width=4),
    'resnext101_32x4d': ResNetSpec(_R, (3, 4, 23, 3), bottleneck=True, groups=32, base_width=4),
    'resnext101_32x8d': ResNetSpec(_R, (3, 4, 23, 3), bottleneck=True, groups=32, base_width=8),
    'resnext101_64x4d': ResNetSpec(_R, (3, 4, 23, 3), bottleneck=True, groups=64, base_width=4),
    # wide ResNets: twice the channels inside each bottleneck
    'wide_resnet50_2': ResNetSpec(_R, (3, 4, 6, 3), bottleneck=True, base_width=128),
    'wide_resnet101_2': ResNetSpec(_R, (3, 4, 23, 3), bottleneck=True, base_width=128),
}, _build, _layers, IMAGENET_OPTIONS, title='ResNet',
    short_names='resnet18-152/18d-152d/resnext*/wide_resnet*', layouts=(TIMM,),
    timm_architecture=_timm_architecture, input_kernel='params/Conv_0/kernel')
