"""What the EfficientNet and MobileNetV3 plug-ins share (network: nets/mbconv.py): their blocks, decoded
from the source's own stage tables with its channel rounding, the spec, the layer map, and the tables
between flaxtpu's arrays and timm's and torchvision's layouts of the same blocks.

Both are stacks of MBConv blocks (Sandler et al. 2018, Howard et al. 2019, Tan & Le 2019) written as
timm writes them: 'ds' (depthwise-separable: depthwise conv, SE, 1x1 project), 'ir' (inverted
residual: 1x1 expand first) and 'cn' (one conv + BN + activation). `padding='torch'` pads as PyTorch
(timm's efficientnet_*/mobilenetv3_*, torchvision) with BatchNorm eps 1e-5; `padding='same'` is
TensorFlow's port (timm's tf_*): SAME padding and TF's BatchNorm eps 1e-3. torchvision's BatchNorm eps
(1e-3 in MobileNetV3 and EfficientNet-B5-B7) is folded into the running variance it imports.
Numpy only: no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from flaxtpu.models import layouts
from flaxtpu.models.family import Spec
from flaxtpu.models.layouts import Rule, batch_norm, conv, dense, linear, one, vector

OPTIONS = ('dropout', 'drop_path', 'padding')


def make_divisible(value: float, divisor: int = 8) -> int:
  """timm's make_divisible (torchvision's _make_divisible): the nearest multiple of `divisor`, never
  below `divisor` nor 10% below `value`."""
  rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
  return rounded + divisor if rounded < 0.9 * value else rounded


@dataclasses.dataclass(frozen=True)
class Block:
  """One block, its widths resolved."""
  kind: str  # 'ds' (depthwise-separable) | 'ir' (inverted residual: 1x1 expand first) | 'cn' (conv+BN+act)
  kernel: int
  stride: int
  in_chs: int
  mid_chs: int  # the depthwise conv's width (ir: expanded; ds: in_chs; cn: out_chs)
  out_chs: int
  se_chs: int  # squeeze-excitation's reduced width; 0 = no SE
  act: str  # 'silu' | 'relu' | 'hard_swish'

  @property
  def skip(self) -> bool:
    """A residual connection: where the shape stays (timm's has_skip and torchvision's use_res_connect)."""
    return self.kind != 'cn' and self.stride == 1 and self.in_chs == self.out_chs


# A row of a stage table: (kind, repeats, kernel, stride, expansion, out channels, SE ratio, activation or
# '' for the model's), timm's 'ir_r2_k3_s2_e6_c24_se0.25' as (ir, 2, 3, 2, 6, 24, 0.25, '').
Row = tuple[str, int, int, int, float, int, float, str]


def decode(stages: tuple[tuple[Row, ...], ...], *, stem: int, act: str, width: float = 1.0,
           depth: float = 1.0, se_of_expanded: bool,
           se_round: Callable[[float], int] = round) -> tuple[tuple[Block, ...], ...]:
  """The blocks of a stage table as timm's EfficientNetBuilder makes them: widths `make_divisible(c *
  width)`, a stage's repeats ceil(r * depth) (EfficientNet's stages hold one row), only a stage's first
  block strided; the SE width a ratio of the expanded width (`se_of_expanded`, MobileNetV3) or of the
  block's input (EfficientNet: timm divides the ratio by the expansion), rounded by `se_round`."""
  in_chs, decoded = stem, []
  for stage in stages:
    assert depth == 1.0 or len(stage) == 1, 'depth scaling of multi-row stages is not timm\'s'
    blocks = []
    for kind, repeats, kernel, stride, expansion, out, se, block_act in stage:
      for index in range(int(math.ceil(repeats * depth))):
        out_chs = make_divisible(out * width)
        mid_chs = {'ds': in_chs, 'cn': out_chs}.get(kind) or make_divisible(in_chs * expansion)
        ratio = se if se_of_expanded else se / expansion
        blocks.append(Block(kind, kernel, stride if not blocks else 1, in_chs, mid_chs, out_chs,
                            se_round(mid_chs * ratio) if se else 0, block_act or act))
        in_chs = out_chs
    decoded.append(tuple(blocks))
  return tuple(decoded)


@dataclasses.dataclass(frozen=True)
class MBConvSpec(Spec):
  """An MBConv network: `Spec.stage_sizes`/`widths` (blocks and out channels per stage, which files are
  matched by) and its blocks."""
  blocks: tuple[tuple[Block, ...], ...] = ()  # per stage
  stem: int = 0  # the stem conv's width
  features: int = 0  # conv_head's width
  act: str = 'silu'  # the stem's and head's activation
  gate: str = 'sigmoid'  # SE's gate: 'sigmoid' | 'hard_sigmoid'
  se_act: str = ''  # SE's activation: '' = the block's
  head_norm: bool = True  # EfficientNet: conv_head + BN + act, then pooling; MobileNetV3: pooling, conv_head
  image_size: int = 224  # the published resolution and crop (timm's defaults, where a file says nothing)
  crop: float = 0.875
  torchvision_eps: float = 1e-5  # torchvision's BatchNorm eps for this model


def stage_fields(blocks) -> dict:
  """`Spec.stage_sizes` and `Spec.widths` (out channels per stage) : what a file is matched by."""
  return {'stage_sizes': tuple(len(stage) for stage in blocks),
          'widths': tuple(stage[-1].out_chs for stage in blocks)}


def build(spec, *, num_classes, dtype, wrap, bn_axis_name, dropout, drop_path, padding):
  from flaxtpu.models.nets import mbconv  # pylint: disable=g-import-not-at-top
  return mbconv.MBConvNet(num_classes=num_classes, stages=spec.blocks, stem=spec.stem,
                          features=spec.features, act=spec.act, gate=spec.gate, se_act=spec.se_act,
                          head_norm=spec.head_norm, block=wrap(mbconv.MBConvBlock), padding=padding,
                          dropout=dropout, drop_path=drop_path, dtype=dtype, bn_axis_name=bn_axis_name)


def block_names(spec) -> list[tuple[str, Block]]:
  """('stage{S}_block{B}', block) from the input up."""
  return [(f'stage{stage}_block{index}', block) for stage, blocks in enumerate(spec.blocks, 1)
          for index, block in enumerate(blocks, 1)]


def layers(spec) -> list[tuple[str, ...]]:
  """As timm's group_matcher: the stem, one layer per block (EfficientNet's conv_head + bn2 join the last:
  timm's MATCH_PREV_GROUP), the classifier (MobileNetV3's conv_head with it: timm leaves it unmatched)."""
  blocks = [(name,) for name, _ in block_names(spec)]
  if spec.head_norm:
    return [('stem', 'stem_bn'), *blocks[:-1], (*blocks[-1], 'head_conv', 'head_bn'), ('head',)]
  return [('stem', 'stem_bn'), *blocks, ('head_conv', 'head')]


def smallest_image(spec) -> int:
  del spec
  return 1  # strided convs pad: a 1x1 map stays 1x1


def input_kernel() -> str:
  return 'params/stem/kernel'


# --- timm -----------------------------------------------------------------------------------------


def timm_block_rules(source: str, target: str, block: Block) -> list[Rule]:
  """timm's DepthwiseSeparableConv (conv_dw, bn1, se, conv_pw, bn2), InvertedResidual (conv_pw, bn1,
  conv_dw, bn2, se, conv_pwl, bn3) or ConvBnAct (conv, bn1)."""
  if block.kind == 'cn':
    return [conv(f'{source}.conv.weight', f'params/{target}/conv/kernel'),
            *batch_norm(f'{source}.bn1', f'{target}/bn')]
  convs = (['conv_pw', 'conv_dw', 'conv_pwl'] if block.kind == 'ir' else ['conv_dw', 'conv_pw'])
  names = (['expand', 'dwconv', 'project'] if block.kind == 'ir' else ['dwconv', 'project'])
  rules = []
  for index, (layer, name) in enumerate(zip(convs, names), 1):
    rules += [conv(f'{source}.{layer}.weight', f'params/{target}/{name}/kernel'),
              *batch_norm(f'{source}.bn{index}', f'{target}/{name}_bn')]
  if block.se_chs:
    rules += [*dense(f'{source}.se.conv_reduce', f'{target}/se/reduce', conv),
              *dense(f'{source}.se.conv_expand', f'{target}/se/expand', conv)]
  return rules


def timm_rules(spec) -> list[Rule]:
  """timm's EfficientNet / MobileNetV3 (conv_stem, bn1, blocks.S.B, conv_head[, bn2], classifier)."""
  rules = [conv('conv_stem.weight', 'params/stem/kernel'), *batch_norm('bn1', 'stem_bn')]
  for (name, block), (stage, index) in zip(block_names(spec), _positions(spec)):
    rules += timm_block_rules(f'blocks.{stage}.{index}', name, block)
  if spec.head_norm:
    rules += [conv('conv_head.weight', 'params/head_conv/kernel'), *batch_norm('bn2', 'head_bn')]
  else:  # a 1x1 conv (with bias) of the pooled features: a dense layer
    rules += [one('conv_head.weight', 'params/head_conv/kernel', lambda w: w[:, :, 0, 0].T,
                  lambda k: k.T[:, :, None, None]),
              vector('conv_head.bias', 'params/head_conv/bias')]
  return rules + dense('classifier', 'head')


def _positions(spec) -> list[tuple[int, int]]:
  return [(stage, index) for stage, blocks in enumerate(spec.blocks) for index in range(len(blocks))]


def timm_shape(tensors) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(blocks per stage, out channels per stage) of a timm EfficientNet/MobileNetV3 state dict."""
  keys = set(tensors)
  stages = layouts.count(keys, r'blocks\.(\d+)\..+')
  sizes = tuple(layouts.count(keys, rf'blocks\.{stage}\.(\d+)\..+') for stage in range(stages))
  last = [max(key for key in keys if key.startswith(f'blocks.{stage}.{size - 1}.') and
              key.endswith('.running_mean')) for stage, size in enumerate(sizes)]
  return sizes, tuple(int(tensors[key].shape[0]) for key in last)


# --- torchvision ----------------------------------------------------------------------------------


def _folded_batch_norm(source: str, target: str, eps: float, model_eps: float = 1e-5) -> list[Rule]:
  """A BatchNorm of eps `eps` read into one of `model_eps`: the difference joins the running variance,
  so that var + eps is the source's (the function at inference is the source's)."""
  shift = eps - model_eps
  norm = batch_norm(source, target)
  return [*norm[:3], one(f'{source}.running_var', f'batch_stats/{target}/var', lambda v: v + shift,
                         lambda v: v - shift)]


def torchvision_block_rules(source: str, target: str, block: Block, eps: float) -> list[Rule]:
  """torchvision's MBConv / InvertedResidual: `block.N` Conv2dNormActivation (.0 conv, .1 BN) for the
  expansion (where it widens), the depthwise conv, SqueezeExcitation (fc1, fc2), the projection."""
  norm = lambda where, name: _folded_batch_norm(where, name, eps)
  if block.kind == 'cn':
    return [conv(f'{source}.0.weight', f'params/{target}/conv/kernel'), *norm(f'{source}.1', f'{target}/bn')]
  layers_ = (['expand'] if block.kind == 'ir' else []) + ['dwconv', 'se' if block.se_chs else '', 'project']
  rules = []
  for index, name in enumerate(filter(None, layers_)):
    where = f'{source}.block.{index}'
    if name == 'se':
      rules += [*dense(f'{where}.fc1', f'{target}/se/reduce', conv),
                *dense(f'{where}.fc2', f'{target}/se/expand', conv)]
    else:
      rules += [conv(f'{where}.0.weight', f'params/{target}/{name}/kernel'),
                *norm(f'{where}.1', f'{target}/{name}_bn')]
  return rules


def torchvision_rules(spec, positions: list[str]) -> list[Rule]:
  """torchvision's EfficientNet / MobileNetV3: features.0 (stem), the blocks at `positions` (their
  prefixes), the last features.N (head conv + BN) and classifier.1 (EfficientNet) or classifier.0/3
  (MobileNetV3, whose last conv is the 'cn' block)."""
  eps = spec.torchvision_eps
  rules = [conv('features.0.0.weight', 'params/stem/kernel'),
           *_folded_batch_norm('features.0.1', 'stem_bn', eps)]
  for (name, block), source in zip(block_names(spec), positions):
    rules += torchvision_block_rules(source, name, block, eps)
  if spec.head_norm:
    last = len(spec.blocks) + 1
    return [*rules, conv(f'features.{last}.0.weight', 'params/head_conv/kernel'),
            *_folded_batch_norm(f'features.{last}.1', 'head_bn', eps), *dense('classifier.1', 'head')]
  return [*rules, *dense('classifier.0', 'head_conv', linear), *dense('classifier.3', 'head')]
