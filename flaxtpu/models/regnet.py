"""The RegNet family (network: nets/regnet.py): RegNetX and RegNetY, with timm's weights (stem.conv/bn,
sS.bB.conv1-3.conv/bn, se.fc1/fc2, downsample.conv/bn, head.fc) and torchvision's (stem.0/1,
trunk_output.blockS.blockS-B.f.a/b/c.0/1, f.se.fc1/fc2, proj.0/1, fc).

Models carry timm's names. Their stages are the published ones, as timm's `generate_regnet` and
`adjust_widths_groups_comp` derive them from (depth, w0, wa, wm, group width) (tests check each against
timm's and torchvision's own derivation). torchvision rounds the bottleneck widths to the group width
otherwise than timm for three models: timm's `regnetx_004_tv`, `regnety_008_tv` and `regnety_080_tv`
are torchvision's regnet_x_400mf, regnet_y_800mf and regnet_y_8gf. The larger published models
(regnetx_040 and up, regnety_064/120/320/1280) are one table row each away.
"""

from __future__ import annotations

import dataclasses

from flaxtpu.models import layouts
from flaxtpu.models.family import Family, Layout, Spec
from flaxtpu.models.layouts import Rule, batch_norm, conv, dense


@dataclasses.dataclass(frozen=True)
class RegNetSpec(Spec):
  group_widths: tuple[int, ...] = ()  # channels per group of each stage's 3x3 convolutions
  se_ratio: float = 0.0  # RegNetY: squeeze-excitation to 1/4 of the block's input channels


def _x(stages, widths, group_width) -> RegNetSpec:
  group_widths = group_width if isinstance(group_width, tuple) else (group_width,) * 4
  return RegNetSpec('regnet', stages, widths=widths, group_widths=group_widths)


def _y(stages, widths, group_width) -> RegNetSpec:
  return dataclasses.replace(_x(stages, widths, group_width), se_ratio=0.25)


# model -> (blocks per stage, widths per stage, group width(s)); torchvision's name where it has the model
_SPECS = {
    'regnetx_002': _x((1, 1, 4, 7), (24, 56, 152, 368), 8),
    'regnetx_004': _x((1, 2, 7, 12), (32, 64, 160, 384), 16),
    'regnetx_004_tv': _x((1, 2, 7, 12), (32, 64, 160, 400), 16),  # regnet_x_400mf
    'regnetx_006': _x((1, 3, 5, 7), (48, 96, 240, 528), 24),
    'regnetx_008': _x((1, 3, 7, 5), (64, 128, 288, 672), 16),  # regnet_x_800mf
    'regnetx_016': _x((2, 4, 10, 2), (72, 168, 408, 912), 24),  # regnet_x_1_6gf
    'regnetx_032': _x((2, 6, 15, 2), (96, 192, 432, 1008), 48),  # regnet_x_3_2gf
    'regnety_002': _y((1, 1, 4, 7), (24, 56, 152, 368), 8),
    'regnety_004': _y((1, 3, 6, 6), (48, 104, 208, 440), 8),  # regnet_y_400mf
    'regnety_006': _y((1, 3, 7, 4), (48, 112, 256, 608), 16),
    'regnety_008': _y((1, 3, 8, 2), (64, 128, 320, 768), 16),
    'regnety_008_tv': _y((1, 3, 8, 2), (64, 144, 320, 784), 16),  # regnet_y_800mf
    'regnety_016': _y((2, 6, 17, 2), (48, 120, 336, 888), 24),  # regnet_y_1_6gf
    'regnety_032': _y((2, 5, 13, 1), (72, 216, 576, 1512), 24),  # regnet_y_3_2gf
    'regnety_040': _y((2, 6, 12, 2), (128, 192, 512, 1088), 64),
    'regnety_080': _y((2, 4, 10, 1), (168, 448, 896, 2016), 56),
    'regnety_080_tv': _y((2, 4, 10, 1), (224, 448, 896, 2016), 56),  # regnet_y_8gf
    'regnety_160': _y((2, 4, 11, 1), (224, 448, 1232, 3024), 112),  # regnet_y_16gf
}


def _build(spec: RegNetSpec, *, num_classes, dtype, wrap, bn_axis_name, drop_path):
  from flaxtpu.models.nets import regnet, resnet  # pylint: disable=g-import-not-at-top
  return regnet.RegNet(stage_sizes=spec.stage_sizes, widths=spec.widths, group_widths=spec.group_widths,
                       se_ratio=spec.se_ratio, block=wrap(resnet.BottleneckBlock), num_classes=num_classes,
                       dtype=dtype, bn_axis_name=bn_axis_name, drop_path=drop_path)


def _layers(spec: RegNetSpec) -> list[tuple[str, ...]]:
  """The stem, one layer per block, the classifier (timm's group_matcher: stem, sS.bB, head)."""
  return [('stem', 'stem_bn'),
          *[(f'stage{stage}_block{block}',) for stage, size in enumerate(spec.stage_sizes, 1)
            for block in range(1, size + 1)],
          ('head',)]


def regnet_rules(spec: RegNetSpec, torchvision: bool) -> list[Rule]:
  """timm's or torchvision's RegNet: the stem, each block's three convolutions (and the first block's
  projection shortcut) with their BatchNorms, RegNetY's squeeze-excitation, the classifier."""
  stem, stem_bn, head = ('stem.0', 'stem.1', 'fc') if torchvision else ('stem.conv', 'stem.bn', 'head.fc')
  rules = [conv(f'{stem}.weight', 'params/stem/kernel'), *batch_norm(stem_bn, 'stem_bn')]
  for stage, size in enumerate(spec.stage_sizes, 1):
    for block in range(1, size + 1):
      source = f'trunk_output.block{stage}.block{stage}-{block - 1}' if torchvision else f's{stage}.b{block}'
      target = f'stage{stage}_block{block}'
      # (torchvision's, timm's) name of each convolution + BatchNorm, in the order flaxtpu numbers them
      parts = [('f.a', 'conv1'), ('f.b', 'conv2'), ('f.c', 'conv3')] + [('proj', 'downsample')] * (block == 1)
      for index, (theirs, timms) in enumerate(parts):
        weights, norm = (f'{theirs}.0', f'{theirs}.1') if torchvision else (f'{timms}.conv', f'{timms}.bn')
        rules += [conv(f'{source}.{weights}.weight', f'params/{target}/Conv_{index}/kernel'),
                  *batch_norm(f'{source}.{norm}', f'{target}/BatchNorm_{index}')]
      if spec.se_ratio:
        se = f'{source}.f.se' if torchvision else f'{source}.se'
        rules += [*dense(f'{se}.fc1', f'{target}/se/fc1', conv),
                  *dense(f'{se}.fc2', f'{target}/se/fc2', conv)]
  return rules + dense(head, 'head')


def _recognise(tensors, where: str, torchvision: bool):
  keys = set(tensors)
  first = 'trunk_output.block{0}.block{0}-0.f.{1}.0.weight' if torchvision else 's{0}.b1.conv{1}.conv.weight'
  if not ({'stem.0.weight', first.format(1, 'a')} <= keys if torchvision else
          {'stem.conv.weight', first.format(1, 1)} <= keys):
    return None
  pattern = r'trunk_output\.block{0}\.block{0}-(\d+)\..+' if torchvision else r's{0}\.b(\d+)\..+'
  stages = tuple(layouts.count(keys, pattern.format(stage)) for stage in range(1, 5))
  grouped = [tensors[first.format(stage, 'b' if torchvision else 2)].shape for stage in range(1, 5)]
  widths = tuple(int(shape[0]) for shape in grouped)  # [width, width / groups, 3, 3]
  group_widths = tuple(int(shape[1]) for shape in grouped)
  se = any('.se.' in key for key in keys)
  name = FAMILY.twin(where, f'a RegNet{"Y" if se else "X"} with {stages} blocks of widths {widths} in groups '
                     f'of {group_widths}', stage_sizes=stages, widths=widths, group_widths=group_widths,
                     se_ratio=0.25 if se else 0.0)
  return name, {}


def _timm_architecture(model: str, spec: RegNetSpec, options: dict, image_shape, model_args: dict):
  del spec, options, image_shape
  return model, model_args


TIMM = Layout('timm', ('timm',), lambda tensors, where: _recognise(tensors, where, torchvision=False),
              rules=lambda spec, options, keys: regnet_rules(spec, torchvision=False),
              head=lambda keys: 'head.fc.bias')
TORCHVISION = Layout('torchvision', ('torchvision',),
                     lambda tensors, where: _recognise(tensors, where, torchvision=True),
                     rules=lambda spec, options, keys: regnet_rules(spec, torchvision=True),
                     head=lambda keys: 'fc.bias')

FAMILY = Family('regnet', _SPECS, _build, _layers, ('drop_path',), title='RegNet',
                short_names='regnetx_*/regnety_*',
                layouts=(TIMM, TORCHVISION), timm_architecture=_timm_architecture,
                input_kernel='params/stem/kernel')
