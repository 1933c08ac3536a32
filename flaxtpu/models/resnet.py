"""The ResNet families (network: nets/resnet.py): CIFAR's resnet20-110 and ImageNet's resnet18-152,
whose weights timm and torchvision publish in one layout.

The layout: conv1, bn1, layerS.B.convN/bnN, downsample.0/1, fc.
"""

from __future__ import annotations

from flaxtpu.errors import UserError
from flaxtpu.models import layouts
from flaxtpu.models.family import Family, Layout, Spec
from flaxtpu.models.layouts import Rule, batch_norm, conv, dense

OPTIONS = ('drop_path', 'padding')


def _build(spec: Spec, *, num_classes, dtype, wrap, bn_axis_name, drop_path, padding):
  from flaxtpu.models.nets import resnet  # pylint: disable=g-import-not-at-top
  block = resnet.BottleneckBlock if spec.bottleneck else resnet.BasicBlock
  stem, width = ('cifar', 16) if spec.family == CIFAR.name else ('imagenet', 64)
  return resnet.ResNet(stage_sizes=spec.stage_sizes, block=wrap(block), stem=stem, width=width,
                       num_classes=num_classes, dtype=dtype, bn_axis_name=bn_axis_name, drop_path=drop_path,
                       padding=padding)


def _layers(spec: Spec) -> list[tuple[str, ...]]:
  """The stem, one layer per block, the classifier."""
  return [('Conv_0', 'BatchNorm_0'),
          *[(f'stage{stage}_block{block}',) for stage, size in enumerate(spec.stage_sizes, 1)
            for block in range(1, size + 1)],
          ('Dense_0',)]


# --- timm / torchvision ---------------------------------------------------------------------------


def resnet_rules(stage_sizes, bottleneck: bool) -> list[Rule]:
  """timm's and torchvision's ResNet (conv1, bn1, layerS.B.convN/bnN, downsample.0/1, fc)."""
  rules = [conv('conv1.weight', 'params/Conv_0/kernel'), *batch_norm('bn1', 'BatchNorm_0')]
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
        rules.append(conv(f'{source}.downsample.0.weight', f'{target}/Conv_{convs}/kernel'))
        rules += batch_norm(f'{source}.downsample.1', f'stage{stage + 1}_block{block + 1}/BatchNorm_{convs}')
      in_width = out_width
  return rules + dense('fc', 'Dense_0')


def _recognise(tensors, where: str):
  keys = set(tensors)
  if not ('conv1.weight' in keys and 'layer1.0.conv1.weight' in keys):
    return None
  stages = tuple(layouts.count(keys, rf'layer{stage}\.(\d+)\..+') for stage in range(1, 5))
  bottleneck = 'layer1.0.conv3.weight' in keys
  if tensors['conv1.weight'].shape[-1] != 7 or tensors['layer1.0.conv1.weight'].shape[0] != 64:
    raise UserError(f'{where} is a ResNet variant (stem or widths differ from resnet18-152), which no '
                    f'flaxtpu model matches; supported: {", ".join(IMAGENET.specs)}')
  name = IMAGENET.twin(where, f'a ResNet with {stages} blocks per stage'
                       f'{" (bottleneck)" if bottleneck else ""}', stage_sizes=stages, bottleneck=bottleneck)
  return name, {'padding': 'torch'}


def _timm_architecture(model: str, spec: Spec, options: dict, image_shape, model_args: dict):
  del spec, image_shape
  if options.get('padding', 'torch') != 'torch':
    raise UserError(f'{model} with model.padding={options["padding"]!r} computes another function than '
                    'timm\'s ResNet (XLA SAME padding); '
                    'train with model.padding=torch to export it to timm')
  return model, model_args


TIMM = Layout('timm', ('timm', 'torchvision'), _recognise,
              rules=lambda spec, options, keys: resnet_rules(spec.stage_sizes, spec.bottleneck),
              head=lambda keys: 'fc.bias')

CIFAR = Family('cifar_resnet', {
    'resnet20': Spec('cifar_resnet', (3, 3, 3)),
    'resnet32': Spec('cifar_resnet', (5, 5, 5)),
    'resnet44': Spec('cifar_resnet', (7, 7, 7)),
    'resnet56': Spec('cifar_resnet', (9, 9, 9)),
    'resnet110': Spec('cifar_resnet', (18, 18, 18)),
}, _build, _layers, OPTIONS, title='CIFAR ResNet', short_names='resnet20/32/44/56/110',
    input_kernel='params/Conv_0/kernel')

IMAGENET = Family('imagenet_resnet', {
    'resnet18': Spec('imagenet_resnet', (2, 2, 2, 2)),
    'resnet34': Spec('imagenet_resnet', (3, 4, 6, 3)),
    'resnet50': Spec('imagenet_resnet', (3, 4, 6, 3), bottleneck=True),
    'resnet101': Spec('imagenet_resnet', (3, 4, 23, 3), bottleneck=True),
    'resnet152': Spec('imagenet_resnet', (3, 8, 36, 3), bottleneck=True),
}, _build, _layers, OPTIONS, title='ResNet', short_names='resnet18-152', layouts=(TIMM,),
    timm_architecture=_timm_architecture, input_kernel='params/Conv_0/kernel')
