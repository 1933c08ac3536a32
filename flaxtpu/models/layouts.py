"""Published weight layouts <-> flaxtpu's parameter trees, in both directions, from one table per model.

A `Rule` ties one array of the source layout (a timm/torchvision state-dict
key, or a big_vision/`vision_transformer` .npz key) to the flaxtpu arrays it
becomes ('params/...' or 'batch_stats/...' names), with the function that
converts it and its inverse. Importing reads every rule's source array;
exporting (to timm's layout) runs the inverses. Layouts:

- `timm`: timm's ResNet (identical to torchvision's), VisionTransformer and
  ConvNeXt state dicts. PyTorch keeps convolutions as OIHW and linear layers
  as [out, in]; flax as HWIO and [in, out]. timm fuses query/key/value into
  one `qkv` matrix; flax's attention keeps [width, heads, head_dim] each.
- `big_vision`: the ViT .npz of big_vision and of `vision_transformer`
  (AugReg), already in flax's layout: only the names differ, and big_vision
  may stack the blocks along a leading axis (`encoderblock/...`, scan).

Numpy only: no JAX, no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from flaxtpu.errors import UserError

LAYOUTS = ('timm', 'big_vision')


@dataclasses.dataclass(frozen=True)
class Rule:
  source: str  # key in the published file
  targets: tuple[str, ...]  # flaxtpu names: 'params/Conv_0/kernel', 'batch_stats/BatchNorm_0/mean'
  load: Callable[[np.ndarray], tuple[np.ndarray, ...]]  # source array -> target arrays
  save: Callable[..., np.ndarray]  # target arrays -> source array


def _one(source: str, target: str, load=lambda w: w, save=lambda w: w) -> Rule:
  return Rule(source, (target,), lambda w: (load(w),), save)


def conv(source: str, target: str) -> Rule:
  """PyTorch OIHW <-> flax HWIO (depthwise: O1HW <-> HW1O)."""
  return _one(source, target, lambda w: w.transpose(2, 3, 1, 0), lambda k: k.transpose(3, 2, 0, 1))


def linear(source: str, target: str) -> Rule:
  return _one(source, target, lambda w: w.T, lambda k: k.T)


def vector(source: str, target: str) -> Rule:
  return _one(source, target)


def batch_norm(source: str, target: str) -> list[Rule]:
  return [vector(f'{source}.weight', f'params/{target}/scale'),
          vector(f'{source}.bias', f'params/{target}/bias'),
          vector(f'{source}.running_mean', f'batch_stats/{target}/mean'),
          vector(f'{source}.running_var', f'batch_stats/{target}/var')]


def layer_norm(source: str, target: str) -> list[Rule]:
  return [vector(f'{source}.weight', f'params/{target}/scale'),
          vector(f'{source}.bias', f'params/{target}/bias')]


def dense(source: str, target: str, kind=linear) -> list[Rule]:
  return [kind(f'{source}.weight', f'params/{target}/kernel'),
          vector(f'{source}.bias', f'params/{target}/bias')]


# --- timm / torchvision --------------------------------------------------------------------------


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


def _qkv(width: int, heads: int) -> tuple[Callable, Callable, Callable, Callable]:
  """timm's fused qkv [3 * width, width] (+ bias [3 * width]) <-> flax's q, k, v [width, heads, head_dim]."""
  head_dim = width // heads
  load_kernel = lambda w: tuple(part.transpose(2, 0, 1) for part in w.reshape(3, heads, head_dim, width))
  save_kernel = lambda *kernels: np.concatenate([k.transpose(1, 2, 0).reshape(width, width) for k in kernels])
  load_bias = lambda b: tuple(b.reshape(3, heads, head_dim))
  save_bias = lambda *biases: np.concatenate([b.reshape(width) for b in biases])
  return load_kernel, save_kernel, load_bias, save_bias


def vit_rules(depth: int, width: int, heads: int, class_token: bool) -> list[Rule]:
  """timm's VisionTransformer (patch_embed.proj, cls_token, pos_embed, blocks.N, norm, head)."""
  head_dim = width // heads
  load_kernel, save_kernel, load_bias, save_bias = _qkv(width, heads)
  rules = [conv('patch_embed.proj.weight', 'params/embedding/kernel'),
           vector('patch_embed.proj.bias', 'params/embedding/bias'),
           vector('pos_embed', 'params/pos_embedding')]
  if class_token:
    rules.append(vector('cls_token', 'params/cls'))
  for index in range(depth):
    source, target = f'blocks.{index}', f'block{index + 1}'
    attention = [f'params/{target}/attention/{name}' for name in ('query', 'key', 'value')]
    rules += [*layer_norm(f'{source}.norm1', f'{target}/norm1'),
              Rule(f'{source}.attn.qkv.weight', tuple(f'{a}/kernel' for a in attention),
                   load_kernel, save_kernel),
              Rule(f'{source}.attn.qkv.bias', tuple(f'{a}/bias' for a in attention),
                   load_bias, save_bias),
              _one(f'{source}.attn.proj.weight', f'params/{target}/attention/out/kernel',
                   lambda w: w.T.reshape(heads, head_dim, width), lambda k: k.reshape(width, width).T),
              vector(f'{source}.attn.proj.bias', f'params/{target}/attention/out/bias'),
              *layer_norm(f'{source}.norm2', f'{target}/norm2'),
              *dense(f'{source}.mlp.fc1', f'{target}/mlp1'), *dense(f'{source}.mlp.fc2', f'{target}/mlp2')]
  return rules + layer_norm('norm', 'encoder_norm') + dense('head', 'head')


def convnext_rules(stage_sizes) -> list[Rule]:
  """timm's ConvNeXt (stem.0/1, stages.S.downsample.0/1, stages.S.blocks.B, head.norm, head.fc)."""
  rules = [*dense('stem.0', 'stem', conv), *layer_norm('stem.1', 'stem_norm')]
  for stage, blocks in enumerate(stage_sizes):
    if stage > 0:
      rules += [*layer_norm(f'stages.{stage}.downsample.0', f'stage{stage + 1}_norm'),
                *dense(f'stages.{stage}.downsample.1', f'stage{stage + 1}_downsample', conv)]
    for block in range(blocks):
      source, target = f'stages.{stage}.blocks.{block}', f'stage{stage + 1}_block{block + 1}'
      rules += [*dense(f'{source}.conv_dw', f'{target}/dwconv', conv),
                *layer_norm(f'{source}.norm', f'{target}/norm'),
                *dense(f'{source}.mlp.fc1', f'{target}/pwconv1'),
                *dense(f'{source}.mlp.fc2', f'{target}/pwconv2'),
                vector(f'{source}.gamma', f'params/{target}/layer_scale')]
  return rules + layer_norm('head.norm', 'head_norm') + dense('head.fc', 'head')


def timm_rules(model_name: str, pool: str = 'tok') -> list[Rule]:
  """The timm-layout table of a flaxtpu model (ResNet, ViT, ConvNeXt)."""
  from flaxtpu import models  # pylint: disable=g-import-not-at-top
  spec = models.get_spec(model_name)
  if spec.family == 'imagenet_resnet':
    return resnet_rules(spec.stage_sizes, spec.bottleneck)
  if spec.family == 'vit':
    return vit_rules(spec.stage_sizes[0], spec.widths[0], spec.num_heads, pool == 'tok')
  if spec.family == 'convnext':
    return convnext_rules(spec.stage_sizes)
  raise UserError(f'{model_name} has no timm twin; '
                  'timm\'s layout exists for resnet18-152, vit_ti/s/b and convnext_t')


# --- big_vision / vision_transformer .npz ---------------------------------------------------------


def big_vision_rules(keys, depth: int, class_token: bool) -> list[Rule]:
  """The ViT of a big_vision (params/[img/]..., pos_embedding at the top, MlpBlock_0) or AugReg
  (`vision_transformer`: Transformer/posembed_input, MlpBlock_3) .npz, blocks stacked (scan) or not."""
  prefix = next((p for p in ('params/img/', 'params/', 'opt/target/', '')
                 if f'{p}embedding/kernel' in keys), None)
  if prefix is None:
    raise UserError('the .npz holds no ViT: no embedding/kernel (nor params/embedding/kernel, '
                    'params/img/embedding/kernel); give a big_vision or vision_transformer ViT checkpoint')
  big_vision = (f'{prefix}pos_embedding' in keys
                or f'{prefix}Transformer/encoderblock/LayerNorm_0/scale' in keys)
  attention, mlp, norm2 = ('MultiHeadDotProductAttention_0', 'MlpBlock_0', 'LayerNorm_1') if big_vision else (
      'MultiHeadDotProductAttention_1', 'MlpBlock_3', 'LayerNorm_2')
  same = lambda source, target: vector(prefix + source, f'params/{target}')
  rules = [same('embedding/kernel', 'embedding/kernel'), same('embedding/bias', 'embedding/bias'),
           same('pos_embedding' if big_vision else 'Transformer/posembed_input/pos_embedding',
                'pos_embedding'),
           same('Transformer/encoder_norm/scale', 'encoder_norm/scale'),
           same('Transformer/encoder_norm/bias', 'encoder_norm/bias'),
           same('head/kernel', 'head/kernel'), same('head/bias', 'head/bias')]
  if class_token:
    rules.append(same('cls', 'cls'))
  stacked = f'{prefix}Transformer/encoderblock/LayerNorm_0/scale' in keys
  for index in range(depth):
    names = {'LayerNorm_0': 'norm1', norm2: 'norm2', f'{mlp}/Dense_0': 'mlp1', f'{mlp}/Dense_1': 'mlp2',
             **{f'{attention}/{part}': f'attention/{part}' for part in ('query', 'key', 'value', 'out')}}
    for there, here in names.items():
      for leaf in (('scale', 'bias') if 'norm' in here else ('kernel', 'bias')):
        if stacked:  # one array per parameter with the blocks along axis 0
          rules.append(_one(f'{prefix}Transformer/encoderblock/{there}/{leaf}',
                            f'params/block{index + 1}/{here}/{leaf}',
                            lambda w, i=index: w[i], lambda k: k))
        else:
          rules.append(same(f'Transformer/encoderblock_{index}/{there}/{leaf}',
                            f'block{index + 1}/{here}/{leaf}'))
  return rules


# --- applying a table ----------------------------------------------------------------------------


def load(rules: list[Rule], tensors: Mapping[str, np.ndarray], wanted: Mapping[str, tuple[int, ...]],
         where: str, adapt: Mapping[str, Callable] = {}) -> dict[str, np.ndarray]:  # noqa: B006
  """{flaxtpu name: float32 array} for every `wanted` name (name -> shape) that a rule makes.

  `adapt` maps a flaxtpu name to a function (array, wanted shape) -> array
  for arrays that legitimately change shape (the position embeddings at
  another image size). A missing source key or a shape that does not fit is
  one UserError naming the tensor and both shapes.
  """
  loaded = {}
  for rule in rules:
    if not any(target in wanted for target in rule.targets):
      continue
    if rule.source not in tensors:
      near = [key for key in tensors if key.rsplit('.', 1)[-1] == rule.source.rsplit('.', 1)[-1]][:3]
      raise UserError(f'{where} has no tensor {rule.source!r}, which {rule.targets[0]} needs '
                      f'(it holds {len(tensors)} tensors, e.g. {", ".join(near or list(tensors)[:3])}); '
                      'is it a checkpoint of this model? set config.model.name to its architecture')
    source = np.asarray(tensors[rule.source], np.float32)
    for target, array in zip(rule.targets, rule.load(source)):
      if target not in wanted:
        continue
      if tuple(array.shape) != tuple(wanted[target]) and target in adapt:
        array = adapt[target](array, tuple(wanted[target]))
      if tuple(array.shape) != tuple(wanted[target]):
        raise UserError(f'{where} does not fit config.model: tensor {rule.source!r} has shape '
                        f'{tuple(source.shape)}, which makes {target} {tuple(array.shape)}, '
                        f'but the model needs {tuple(wanted[target])}; set config.model.name '
                        '(and patch_size/pool) to the architecture the file holds')
      loaded[target] = np.ascontiguousarray(array)
  return loaded


def save(rules: list[Rule], arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The source layout's tensors {key: float32 array} from flaxtpu's arrays {name: array}."""
  out = {}
  for rule in rules:
    out[rule.source] = np.ascontiguousarray(
        rule.save(*[np.asarray(arrays[target], np.float32) for target in rule.targets]), np.float32)
  return out
