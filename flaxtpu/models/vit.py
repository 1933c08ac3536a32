"""The ViT family (network: nets/vit.py): vit_ti/s/b/l, DeiT with its distillation token
(deit_*_distilled), DINOv2 with and without registers (dinov2_*), CLIP image towers (clip_b/l), with the
weights of timm and of big_vision / `vision_transformer` (AugReg).

The pooling is an option (model.pool): 'tok' (a class token), 'gap', 'map'
(SigLIP's attention pooling: vit_b with pool='map' is timm's
vit_base_patch16_siglip_224) and 'avg' (MAE/BEiT-style fc_norm); what the
rest of the network is, the model's name says (`ViTSpec`).

- timm: patch_embed.proj, cls_token, dist_token, reg_token, pos_embed,
  norm_pre, blocks.N (ls1/ls2), norm or fc_norm, attn_pool, head, head_dist.
  timm fuses query/key/value into one `qkv` matrix; flax's attention keeps
  [width, heads, head_dim] each.
- big_vision: the .npz of big_vision and of `vision_transformer` (AugReg),
  already in flax's layout: only the names differ, and big_vision may stack
  the blocks along a leading axis (`encoderblock/...`, scan). SigLIP's image
  tower (params/img/...) pools with big_vision's MAPHead (MAPHead_0).

Its position embeddings fix the image size it was trained at.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from flaxtpu.models import family, layouts
from flaxtpu.models.family import Family, Layout, Preprocessing, Spec
from flaxtpu.models.layouts import Rule, conv, dense, layer_norm, one, vector
from flaxtpu.settings.errors import UserError

INCEPTION = (family.INCEPTION_MEAN, family.INCEPTION_STD)  # pixels to [-1, 1]: AugReg, big_vision, SigLIP
IMAGENET = (family.IMAGENET_MEAN, family.IMAGENET_STD)
CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))  # OpenAI's


@dataclasses.dataclass(frozen=True)
class ViTSpec(Spec):
  timm: str = ''  # timm's architecture; '{patch}' where timm names one per patch size
  distilled: bool = False  # DeiT: a distillation token (dist_token) and a second head (head_dist), averaged
  registers: int = 0  # DINOv2: register tokens; the position embeddings then cover the patches alone
  layer_scale: bool = False  # DINOv2: learned per-channel scales of each residual branch (ls1, ls2)
  pre_norm: bool = False  # CLIP: a LayerNorm after the embeddings (norm_pre); no patch embedding bias
  norm_eps: float = 1e-6  # LayerNorm's epsilon: timm's ViTs 1e-6, its CLIP towers PyTorch's 1e-5
  mean_std: tuple[tuple[float, ...], tuple[float, ...]] = INCEPTION  # the published weights'
  crop_fraction: float = 0.9

  def prefix_tokens(self, pool: str) -> int:
    """How many tokens before the patches have position embeddings (timm's num_prefix_tokens, or 0
    where no_embed_class)."""
    return 0 if self.registers else int(pool in ('tok', 'avg')) + int(self.distilled)


def _build(spec: ViTSpec, *, num_classes, dtype, wrap, bn_axis_name, patch_size, pool, dropout, drop_path,
           gelu):
  del bn_axis_name
  if spec.distilled and pool != 'tok':
    raise UserError(f'config.model.pool={pool!r}: DeiT\'s distilled models read their class and '
                    'distillation tokens; set config.model.pool=tok')
  from flaxtpu.models.nets import vit  # pylint: disable=g-import-not-at-top
  return vit.ViT(num_classes=num_classes, patch_size=patch_size or spec.patch_size,
                 width=spec.widths[0], depth=spec.stage_sizes[0], num_heads=spec.num_heads,
                 mlp_dim=spec.mlp_dim, block=wrap(vit.EncoderBlock), pool=pool, dropout=dropout,
                 drop_path=drop_path, gelu=gelu, distilled=spec.distilled, registers=spec.registers,
                 layer_scale=spec.layer_scale, pre_norm=spec.pre_norm, norm_eps=spec.norm_eps, dtype=dtype)


def _layers(spec: Spec) -> list[tuple[str, ...]]:
  """The embeddings (and the tokens, norm_pre), one layer per block, the final norm, the head (and what
  timm's group_matcher leaves unmatched: fc_norm, the MAP head, head_dist)."""
  blocks = [(f'block{index}',) for index in range(1, spec.stage_sizes[0] + 1)]
  return [('embedding', 'cls', 'dist', 'registers', 'pos_embedding', 'norm_pre'), *blocks, ('encoder_norm',),
          ('head', 'head_dist', 'fc_norm', 'map_head')]


# --- timm -----------------------------------------------------------------------------------------


def _projections(source: str, targets: list[str], width: int, heads: int) -> list[Rule]:
  """timm's projections fused along the output (qkv [3 * width, width], kv, q; + bias) <-> flax's
  attention `targets` (query/key/value: kernel [width, heads, head_dim], bias [heads, head_dim])."""
  head_dim, parts = width // heads, len(targets)
  load_kernel = lambda w: tuple(part.transpose(2, 0, 1) for part in w.reshape(parts, heads, head_dim, width))
  save_kernel = lambda *kernels: np.concatenate([k.transpose(1, 2, 0).reshape(width, width) for k in kernels])
  load_bias = lambda b: tuple(b.reshape(parts, heads, head_dim))
  save_bias = lambda *biases: np.concatenate([b.reshape(width) for b in biases])
  return [Rule(f'{source}.weight', tuple(f'params/{t}/kernel' for t in targets), load_kernel, save_kernel),
          Rule(f'{source}.bias', tuple(f'params/{t}/bias' for t in targets), load_bias, save_bias)]


def _attention(source: str, target: str, width: int, heads: int, fused: tuple[str, ...]) -> list[Rule]:
  """timm's attention (`fused` projections, proj) <-> flax's (query, key, value, out [heads, head_dim,
  width]); `fused` names the projections' modules, each of some of 'query', 'key', 'value' in order."""
  names = iter(('query', 'key', 'value'))
  rules = []
  for projection in fused:
    parts = {'qkv': 3, 'kv': 2, 'q': 1}[projection]
    rules += _projections(f'{source}.{projection}', [f'{target}/{next(names)}' for _ in range(parts)],
                          width, heads)
  head_dim = width // heads
  return rules + [one(f'{source}.proj.weight', f'params/{target}/out/kernel',
                      lambda w: w.T.reshape(heads, head_dim, width), lambda k: k.reshape(width, width).T),
                  vector(f'{source}.proj.bias', f'params/{target}/out/bias')]


def _map_head_rules(width: int, heads: int) -> list[Rule]:
  """timm's AttentionPoolLatent (attn_pool: latent, q, kv, proj, norm, mlp) <-> map_head."""
  return [vector('attn_pool.latent', 'params/map_head/probe'),
          *_attention('attn_pool', 'map_head/attention', width, heads, ('q', 'kv')),
          *layer_norm('attn_pool.norm', 'map_head/norm'),
          *dense('attn_pool.mlp.fc1', 'map_head/mlp1'), *dense('attn_pool.mlp.fc2', 'map_head/mlp2')]


def vit_rules(spec: ViTSpec, pool: str) -> list[Rule]:
  """timm's VisionTransformer (patch_embed.proj, cls_token, dist_token, reg_token, pos_embed, norm_pre,
  blocks.N, norm/fc_norm, attn_pool, head, head_dist) of `spec` pooling by `pool`."""
  depth, width, heads = spec.stage_sizes[0], spec.widths[0], spec.num_heads
  rules = [conv('patch_embed.proj.weight', 'params/embedding/kernel'),
           vector('pos_embed', 'params/pos_embedding')]
  if not spec.pre_norm:
    rules.append(vector('patch_embed.proj.bias', 'params/embedding/bias'))
  for token, name, present in (('cls_token', 'cls', pool in ('tok', 'avg')),
                               ('dist_token', 'dist', spec.distilled),
                               ('reg_token', 'registers', spec.registers)):
    if present:
      rules.append(vector(token, f'params/{name}'))
  if spec.pre_norm:
    rules += layer_norm('norm_pre', 'norm_pre')
  for index in range(depth):
    source, target = f'blocks.{index}', f'block{index + 1}'
    rules += [*layer_norm(f'{source}.norm1', f'{target}/norm1'),
              *_attention(f'{source}.attn', f'{target}/attention', width, heads, ('qkv',)),
              *layer_norm(f'{source}.norm2', f'{target}/norm2'),
              *dense(f'{source}.mlp.fc1', f'{target}/mlp1'), *dense(f'{source}.mlp.fc2', f'{target}/mlp2')]
    if spec.layer_scale:
      rules += [vector(f'{source}.ls{branch}.gamma', f'params/{target}/ls{branch}') for branch in (1, 2)]
  rules += layer_norm('fc_norm', 'fc_norm') if pool == 'avg' else layer_norm('norm', 'encoder_norm')
  if pool == 'map':
    rules += _map_head_rules(width, heads)
  if spec.distilled:
    rules += dense('head_dist', 'head_dist')
  return rules + dense('head', 'head')


def _described(fields: dict) -> str:
  """'a ViT of width 384 and depth 12 with layer scale and 4 registers'."""
  extras = [what for what, present in (('a distillation token', fields['distilled']),
                                       ('layer scale', fields['layer_scale']),
                                       (f'{fields["registers"]} registers', fields['registers']),
                                       ('a pre-norm', fields['pre_norm'])) if present]
  return (f'a ViT of width {fields["widths"][0]} and depth {fields["stage_sizes"][0]}'
          + (f' with {" and ".join(extras)}' if extras else ''))


def _recognise_timm(tensors, where: str):
  keys = set(tensors)
  if 'patch_embed.proj.weight' not in keys or not any(key.startswith('blocks.') for key in keys):
    return None  # not a ViT (a Swin Transformer has patch_embed too)
  kernel = tensors['patch_embed.proj.weight']
  depth = layouts.count(keys, r'blocks\.(\d+)\..+')  # by any tensor: the coverage check names one missing
  fields = {'widths': (kernel.shape[0],), 'stage_sizes': (depth,),
            'distilled': 'dist_token' in keys, 'layer_scale': 'blocks.0.ls1.gamma' in keys,
            'registers': int(tensors['reg_token'].shape[1]) if 'reg_token' in keys else 0,
            'pre_norm': 'norm_pre.weight' in keys}
  name = FAMILY.twin(where, _described(fields), **fields)
  pool = ('map' if 'attn_pool.latent' in keys else 'avg' if 'fc_norm.weight' in keys
          else 'tok' if 'cls_token' in keys else 'gap')
  if pool in ('map', 'avg') and ('cls_token' in keys) != (pool == 'avg'):
    raise UserError(f'{where} is a ViT with {"attention pooling" if pool == "map" else "fc_norm"} '
                    f'{"and" if pool == "map" else "but no"} class token, which flaxtpu\'s ViT lacks; '
                    'supported: attention pooling without a class token (SigLIP), fc_norm with one (MAE)')
  prefix = FAMILY.specs[name].prefix_tokens(pool)
  if round((tensors['pos_embed'].shape[1] - prefix) ** 0.5) ** 2 != tensors['pos_embed'].shape[1] - prefix:
    raise UserError(f'{where} is a ViT whose position embeddings ({tensors["pos_embed"].shape[1]}) do not '
                    f'cover its {prefix} prefix tokens and a square grid of patches as {name}\'s do (e.g. a '
                    'DeiT III: no position embedding for the class token), which flaxtpu has no model for')
  return name, {'patch_size': int(kernel.shape[-1]), 'pool': pool, 'gelu': 'exact'}


def _timm_architecture(model: str, spec: ViTSpec, options: dict, image_shape, model_args: dict):
  patch = options.get('patch_size') or spec.patch_size
  model_args['img_size'] = list(image_shape[:2])
  if '{patch}' not in spec.timm and patch != spec.patch_size:
    model_args['patch_size'] = patch
  pool = options.get('pool')
  if pool == 'gap':  # big_vision's gap: the final norm, then the mean of the tokens
    model_args.update(class_token=False, global_pool='avg', fc_norm=False)
  elif pool == 'avg':
    model_args.update(global_pool='avg', fc_norm=True)
  elif pool == 'map':
    model_args.update(class_token=False, global_pool='map')
  if options.get('gelu') in ('tanh', 'quick'):
    model_args['act_layer'] = {'tanh': 'gelu_tanh', 'quick': 'quick_gelu'}[options['gelu']]
  return spec.timm.format(patch=patch), model_args


# --- big_vision / vision_transformer .npz ---------------------------------------------------------


def _big_vision_prefix(keys) -> str:
  """Where the ViT's arrays lie in a big_vision/AugReg .npz: '', 'params/', 'params/img/' (a SigLIP or
  LiT image tower), 'opt/target/'."""
  prefix = next((p for p in ('params/img/', 'params/', 'opt/target/', '')
                 if f'{p}embedding/kernel' in keys), None)
  if prefix is None:
    raise UserError('the .npz holds no ViT: no embedding/kernel (nor params/embedding/kernel, '
                    'params/img/embedding/kernel); give a big_vision or vision_transformer ViT checkpoint')
  return prefix


def _big_vision_map_head(prefix: str) -> list[Rule]:
  """big_vision's MAPHead (SigLIP's attention pooling), auto-named MAPHead_0 in its ViT: probe,
  MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0/Dense_0-1; flax's names, so one to one."""
  head = f'{prefix}MAPHead_0/'
  names = {'LayerNorm_0': 'norm', 'MlpBlock_0/Dense_0': 'mlp1', 'MlpBlock_0/Dense_1': 'mlp2',
           **{f'MultiHeadDotProductAttention_0/{part}': f'attention/{part}'
              for part in ('query', 'key', 'value', 'out')}}
  return [vector(f'{head}probe', 'params/map_head/probe')] + [
      vector(f'{head}{there}/{leaf}', f'params/map_head/{here}/{leaf}') for there, here in names.items()
      for leaf in (('scale', 'bias') if here == 'norm' else ('kernel', 'bias'))]


def big_vision_rules(keys, depth: int, pool: str) -> list[Rule]:
  """The ViT of a big_vision (params/[img/]..., pos_embedding at the top, MlpBlock_0, a MAPHead_0 with
  pool='map') or AugReg (`vision_transformer`: Transformer/posembed_input, MlpBlock_3) .npz, blocks
  stacked (scan) or not."""
  prefix = _big_vision_prefix(keys)
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
  if pool == 'tok':
    rules.append(same('cls', 'cls'))
  if pool == 'map':
    rules += _big_vision_map_head(prefix)
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
  prefix = _big_vision_prefix(keys)  # (or says there is none)
  kernel = tensors[f'{prefix}embedding/kernel']
  stacked = f'{prefix}Transformer/encoderblock/LayerNorm_0/scale'
  depth = (tensors[stacked].shape[0] if stacked in keys
           else layouts.count(keys, re.escape(prefix) + r'Transformer/encoderblock_(\d+)/.+'))
  name = FAMILY.twin(where, f'a ViT of width {kernel.shape[-1]} and depth {depth}',
                     widths=(kernel.shape[-1],), stage_sizes=(depth,))
  pool = 'map' if f'{prefix}MAPHead_0/probe' in keys else 'tok' if f'{prefix}cls' in keys else 'gap'
  if pool == 'map' and f'{prefix}cls' in keys:
    raise UserError(f'{where} is a ViT with attention pooling and a class token, which flaxtpu\'s ViT '
                    'lacks; supported: attention pooling without a class token (SigLIP)')
  return name, {'patch_size': int(kernel.shape[0]), 'pool': pool, 'gelu': 'tanh'}


def _preprocessing(tensors, layout: str, options: dict) -> Preprocessing:
  """timm's for the model (AugReg's: pixels to [-1, 1], crop 0.9; DeiT's, DINOv2's and CLIP's own; MAE's
  ImageNet mean/std with fc_norm), at the size the position embeddings were trained at."""
  model = (_recognise_timm if layout == 'timm' else _recognise_big_vision)(tensors, 'the weights')[0]
  spec = FAMILY.specs[model]
  positions = next(np.asarray(tensors[key]).shape for key in tensors
                   if key.endswith(('pos_embed', 'pos_embedding')))[-2] - (
      spec.prefix_tokens(options['pool']) if layout == 'timm' else 0)
  size = int(round(positions ** 0.5)) * options['patch_size']
  mean, std = IMAGENET if options['pool'] == 'avg' else spec.mean_std
  return Preprocessing(mean, std, spec.crop_fraction, size)


def _big_vision_unread(keys) -> set[str]:
  """What a big_vision checkpoint holds besides the ViT: the optimizer's state, a text tower (params/txt)."""
  prefix = _big_vision_prefix(set(keys))
  return {key for key in keys if not key.startswith(prefix)}


# Recognised before timm's layout: flax names.
BIG_VISION = Layout('big_vision', ('big_vision',), _recognise_big_vision,
                    rules=lambda spec, options, keys: big_vision_rules(set(keys), spec.stage_sizes[0],
                                                                       options['pool']),
                    head=lambda keys: f'{_big_vision_prefix(set(keys))}head/bias',
                    unread=_big_vision_unread)
TIMM = Layout('timm', ('timm',), _recognise_timm,
              rules=lambda spec, options, keys: vit_rules(spec, options.get('pool', 'tok')),
              head=lambda keys: 'head.bias')

_SIZES = {  # name: depth, width, heads (timm's: the MLP is 4 times as wide), timm's name of the size
    'ti': (12, 192, 3, 'tiny'), 's': (12, 384, 6, 'small'), 'b': (12, 768, 12, 'base'),
    'l': (24, 1024, 16, 'large')}


def _vit(size: str, patch_size: int, timm: str, **fields) -> ViTSpec:
  depth, width, heads, _ = _SIZES[size]
  return ViTSpec('vit', (depth,), widths=(width,), num_heads=heads, mlp_dim=4 * width, patch_size=patch_size,
                 timm=timm, **fields)


FAMILY = Family('vit', {
    **{f'vit_{size}': _vit(size, 16, f'vit_{_SIZES[size][3]}_patch{{patch}}_224') for size in _SIZES},
    **{f'deit_{size}_distilled': _vit(size, 16, f'deit_{_SIZES[size][3]}_distilled_patch16_224',
                                      distilled=True, mean_std=IMAGENET, crop_fraction=0.875)
       for size in ('ti', 's', 'b')},
    **{f'dinov2_{size}{reg}': _vit(size, 14, f'vit_{_SIZES[size][3]}_patch14{reg and "_reg4"}_dinov2',
                                   layer_scale=True, registers=4 if reg else 0, mean_std=IMAGENET,
                                   crop_fraction=1.0)
       for size in ('s', 'b', 'l') for reg in ('', '_reg')},
    'clip_b': _vit('b', 16, 'vit_base_patch16_clip_224', pre_norm=True, norm_eps=1e-5,
                   mean_std=CLIP),
    'clip_l': _vit('l', 14, 'vit_large_patch14_clip_224', pre_norm=True, norm_eps=1e-5,
                   mean_std=CLIP),
}, _build, _layers, ('patch_size', 'pool', 'dropout', 'drop_path', 'gelu'), title='ViT',
    short_names='vit_*, deit_*, dinov2_*, clip_*',
    layouts=(BIG_VISION, TIMM), timm_architecture=_timm_architecture, preprocessing=_preprocessing,
    input_kernel='params/embedding/kernel', fixed_image_size=True,
    # Grad-CAM on the patch tokens entering the last block (after the encoder's norm, a class token's
    # logits have no gradient on the patches)
    feature_map=lambda spec: (f'block{spec.stage_sizes[0]}', 'norm1'))
