"""The ViT family (network: nets/vit.py): vit_ti, vit_s, vit_b, with the weights of timm and of
big_vision / `vision_transformer` (AugReg).

- timm: patch_embed.proj, cls_token, pos_embed, blocks.N, norm, head. timm
  fuses query/key/value into one `qkv` matrix; flax's attention keeps
  [width, heads, head_dim] each.
- big_vision: the .npz of big_vision and of `vision_transformer` (AugReg),
  already in flax's layout: only the names differ, and big_vision may stack
  the blocks along a leading axis (`encoderblock/...`, scan).

Its position embeddings fix the image size it was trained at.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from flaxtpu.errors import UserError
from flaxtpu.models import layouts
from flaxtpu.models.family import INCEPTION_MEAN, INCEPTION_STD, Family, Layout, Preprocessing, Spec
from flaxtpu.models.layouts import Rule, conv, dense, layer_norm, one, vector

_TIMM_SIZES = {'vit_ti': 'tiny', 'vit_s': 'small', 'vit_b': 'base'}


def _build(spec: Spec, *, num_classes, dtype, wrap, bn_axis_name, patch_size, pool, dropout, drop_path, gelu):
  del bn_axis_name
  from flaxtpu.models.nets import vit  # pylint: disable=g-import-not-at-top
  return vit.ViT(num_classes=num_classes, patch_size=patch_size or spec.patch_size,
                 width=spec.widths[0], depth=spec.stage_sizes[0], num_heads=spec.num_heads,
                 mlp_dim=spec.mlp_dim, block=wrap(vit.EncoderBlock), pool=pool, dropout=dropout,
                 drop_path=drop_path, gelu=gelu, dtype=dtype)


def _layers(spec: Spec) -> list[tuple[str, ...]]:
  """The embeddings, one layer per block, the final norm, the head."""
  blocks = [(f'block{index}',) for index in range(1, spec.stage_sizes[0] + 1)]
  return [('embedding', 'cls', 'pos_embedding'), *blocks, ('encoder_norm',), ('head',)]


# --- timm -----------------------------------------------------------------------------------------


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
              one(f'{source}.attn.proj.weight', f'params/{target}/attention/out/kernel',
                  lambda w: w.T.reshape(heads, head_dim, width), lambda k: k.reshape(width, width).T),
              vector(f'{source}.attn.proj.bias', f'params/{target}/attention/out/bias'),
              *layer_norm(f'{source}.norm2', f'{target}/norm2'),
              *dense(f'{source}.mlp.fc1', f'{target}/mlp1'), *dense(f'{source}.mlp.fc2', f'{target}/mlp2')]
  return rules + layer_norm('norm', 'encoder_norm') + dense('head', 'head')


def _recognise_timm(tensors, where: str):
  keys = set(tensors)
  if 'patch_embed.proj.weight' not in keys or not any(key.startswith('blocks.') for key in keys):
    return None  # not a ViT (a Swin Transformer has patch_embed too)
  for unsupported, what in (('fc_norm.weight', 'a norm after pooling (fc_norm)'),
                            ('reg_token', 'register tokens'), ('attn_pool.latent', 'attention pooling'),
                            ('norm_pre.weight', 'a pre-norm')):
    if unsupported in keys:
      raise UserError(f'{where} is a ViT with {what}, which flaxtpu\'s ViT lacks; supported: timm '
                      'ViTs with a class token or plain average pooling (e.g. augreg)')
  kernel = tensors['patch_embed.proj.weight']
  depth = layouts.count(keys, r'blocks\.(\d+)\..+')  # by any tensor: the coverage check names one missing
  name = FAMILY.twin(where, f'a ViT of width {kernel.shape[0]} and depth {depth}',
                     widths=(kernel.shape[0],), stage_sizes=(depth,))
  pool = 'tok' if 'cls_token' in keys else 'gap'
  return name, {'patch_size': int(kernel.shape[-1]), 'pool': pool, 'gelu': 'exact'}


def _timm_architecture(model: str, spec: Spec, options: dict, image_shape, model_args: dict):
  patch = options.get('patch_size') or spec.patch_size
  model_args['img_size'] = list(image_shape[:2])
  if options.get('pool') == 'gap':  # big_vision's gap: the final norm, then the mean of the tokens
    model_args.update(class_token=False, global_pool='avg', fc_norm=False)
  if options.get('gelu') == 'tanh':
    model_args['act_layer'] = 'gelu_tanh'
  return f'vit_{_TIMM_SIZES[model]}_patch{patch}_224', model_args


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
          rules.append(one(f'{prefix}Transformer/encoderblock/{there}/{leaf}',
                           f'params/block{index + 1}/{here}/{leaf}',
                           lambda w, i=index: w[i], lambda k: k))
        else:
          rules.append(same(f'Transformer/encoderblock_{index}/{there}/{leaf}',
                            f'block{index + 1}/{here}/{leaf}'))
  return rules


def _recognise_big_vision(tensors, where: str):
  keys = set(tensors)
  if not any(key.endswith('embedding/kernel') for key in keys):  # flax names: a big_vision / AugReg ViT
    return None
  rules = big_vision_rules(keys, 0, False)  # finds the prefix (or says there is none)
  prefix = rules[0].source[:-len('embedding/kernel')]
  kernel = tensors[f'{prefix}embedding/kernel']
  stacked = f'{prefix}Transformer/encoderblock/LayerNorm_0/scale'
  depth = (tensors[stacked].shape[0] if stacked in keys
           else layouts.count(keys, re.escape(prefix) + r'Transformer/encoderblock_(\d+)/.+'))
  name = FAMILY.twin(where, f'a ViT of width {kernel.shape[-1]} and depth {depth}',
                     widths=(kernel.shape[-1],), stage_sizes=(depth,))
  pool = 'tok' if f'{prefix}cls' in keys else 'gap'
  if f'{prefix}MAPHead_0/probe' in keys:
    raise UserError(f'{where} is a ViT with a MAP head (attention pooling), which flaxtpu\'s ViT lacks')
  return name, {'patch_size': int(kernel.shape[0]), 'pool': pool, 'gelu': 'tanh'}


def _preprocessing(tensors, layout: str, options: dict) -> Preprocessing:
  """AugReg's: pixels to [-1, 1], crop 0.9, the size the position embeddings were trained at."""
  positions = next(np.asarray(tensors[key]).shape for key in tensors
                   if key.endswith(('pos_embed', 'pos_embedding')))[-2] - (
      1 if options['pool'] == 'tok' and layout == 'timm' else 0)
  size = int(round(positions ** 0.5)) * options['patch_size']
  return Preprocessing(INCEPTION_MEAN, INCEPTION_STD, 0.9, size)


def _big_vision_unread(keys) -> set[str]:
  """What a big_vision checkpoint holds besides the ViT: the optimizer's state, a text tower (params/txt)."""
  prefix = big_vision_rules(set(keys), 0, False)[0].source[:-len('embedding/kernel')]
  return {key for key in keys if not key.startswith(prefix)}


# Recognised before timm's layout: flax names.
BIG_VISION = Layout('big_vision', ('big_vision',), _recognise_big_vision,
                    rules=lambda spec, options, keys: big_vision_rules(set(keys), spec.stage_sizes[0],
                                                                       options['pool'] == 'tok'),
                    head=lambda keys: big_vision_rules(set(keys), 0, False)[-1].source,
                    unread=_big_vision_unread)
TIMM = Layout('timm', ('timm',), _recognise_timm,
              rules=lambda spec, options, keys: vit_rules(spec.stage_sizes[0], spec.widths[0], spec.num_heads,
                                                          options.get('pool', 'tok') == 'tok'),
              head=lambda keys: 'head.bias')

FAMILY = Family('vit', {
    'vit_ti': Spec('vit', (12,), widths=(192,), num_heads=3, mlp_dim=768, patch_size=16),
    'vit_s': Spec('vit', (12,), widths=(384,), num_heads=6, mlp_dim=1536, patch_size=16),
    'vit_b': Spec('vit', (12,), widths=(768,), num_heads=12, mlp_dim=3072, patch_size=16),
}, _build, _layers, ('patch_size', 'pool', 'dropout', 'drop_path', 'gelu'), title='ViT',
    short_names='vit_ti/s/b', layouts=(BIG_VISION, TIMM), timm_architecture=_timm_architecture,
    preprocessing=_preprocessing, input_kernel='params/embedding/kernel', fixed_image_size=True)
