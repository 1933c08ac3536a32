"""The Swin Transformer family (network: nets/swin.py): swin_t/s/b (window 7), with timm's weights
(patch_embed.proj/norm, layers.S.downsample.norm/reduction, layers.S.blocks.B.{norm1, attn.qkv,
attn.relative_position_bias_table, attn.proj, norm2, mlp.fc1/fc2}, norm, head.fc).

The relative position tables keep their 7x7-window shape at every image size
(the network resizes them where a small map shrinks a window, as timm does
when it loads them), so a 224 px file imports at any size, and an export at
another size loads in `timm.create_model(..., img_size=N)` through timm's own
resize. What timm's relative_position_index and attn_mask buffers hold
(persistent in files of older timm versions) the network computes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flaxtpu.models import layouts
from flaxtpu.models.family import Family, Layout, Preprocessing, Spec
from flaxtpu.models.layouts import Rule, conv, dense, layer_norm, linear, vector
from flaxtpu.settings.errors import UserError

_TIMM_NAMES = {'swin_t': 'swin_tiny_patch4_window7_224', 'swin_s': 'swin_small_patch4_window7_224',
               'swin_b': 'swin_base_patch4_window7_224'}
WINDOW = 7


@dataclasses.dataclass(frozen=True)
class SwinSpec(Spec):
  heads: tuple[int, ...] = ()  # attention heads per stage


def _build(spec: SwinSpec, *, num_classes, dtype, wrap, bn_axis_name, patch_size, drop_path, remat_mlps):
  del bn_axis_name
  from flaxtpu.models.nets import swin  # pylint: disable=g-import-not-at-top
  return swin.Swin(num_classes=num_classes, stage_sizes=spec.stage_sizes, width=spec.widths[0],
                   num_heads=spec.heads, block=wrap(swin.SwinBlock), patch_size=patch_size or spec.patch_size,
                   window=WINDOW, drop_path=drop_path, dtype=dtype, remat_mlps=remat_mlps)


def _layers(spec: Spec) -> list[tuple[str, ...]]:
  """The patch embedding, one layer per block (a stage's patch merging joins its first block, the final
  norm the last block: timm's group_matcher), the head."""
  layers = [('patch_embed', 'patch_embed_norm')]
  for stage, size in enumerate(spec.stage_sizes, 1):
    merge = (f'stage{stage}_merge_norm', f'stage{stage}_merge') if stage > 1 else ()
    layers += [(f'stage{stage}_block{block}', *(merge if block == 1 else ())) for block in range(1, size + 1)]
  return [*layers[:-1], (*layers[-1], 'norm'), ('head',)]


def swin_rules(stage_sizes) -> list[Rule]:
  """timm's SwinTransformer (patch_embed, layers.S.downsample, layers.S.blocks.B, norm, head.fc)."""
  rules = [*dense('patch_embed.proj', 'patch_embed', conv),
           *layer_norm('patch_embed.norm', 'patch_embed_norm')]
  for stage, blocks in enumerate(stage_sizes):
    if stage > 0:
      merge = f'stage{stage + 1}_merge'
      rules += [*layer_norm(f'layers.{stage}.downsample.norm', f'{merge}_norm'),
                linear(f'layers.{stage}.downsample.reduction.weight', f'params/{merge}/kernel')]
    for block in range(blocks):
      source, target = f'layers.{stage}.blocks.{block}', f'stage{stage + 1}_block{block + 1}'
      rules += [*layer_norm(f'{source}.norm1', f'{target}/norm1'),
                *dense(f'{source}.attn.qkv', f'{target}/attention/qkv'),
                vector(f'{source}.attn.relative_position_bias_table',
                       f'params/{target}/attention/relative_position_bias_table'),
                *dense(f'{source}.attn.proj', f'{target}/attention/proj'),
                *layer_norm(f'{source}.norm2', f'{target}/norm2'),
                *dense(f'{source}.mlp.fc1', f'{target}/mlp1'), *dense(f'{source}.mlp.fc2', f'{target}/mlp2')]
  return rules + layer_norm('norm', 'norm') + dense('head.fc', 'head')


def _recognise(tensors, where: str):
  keys = set(tensors)
  if not {'patch_embed.proj.weight', 'layers.0.blocks.0.attn.relative_position_bias_table'} <= keys:
    return None
  if 'layers.0.downsample.reduction.weight' in keys:
    raise UserError(f'{where} is a Swin Transformer in Microsoft\'s original layout (patch merging at the '
                    'end of a stage); flaxtpu reads timm\'s: load it with timm.create_model(..., '
                    'pretrained=True, pretrained_cfg_overlay={"file": ...}) and save model.state_dict()')
  stages = tuple(layouts.count(keys, rf'layers\.{stage}\.blocks\.(\d+)\..+') for stage in range(4))
  tables = [tensors[f'layers.{stage}.blocks.0.attn.relative_position_bias_table'].shape for stage in range(4)
            if stages[stage]]
  if any(rows != (2 * WINDOW - 1) ** 2 for rows, _ in tables):
    side = (int(round(np.sqrt(tables[0][0]))) + 1) // 2
    raise UserError(f'{where} is a Swin Transformer with {side}x{side} windows; flaxtpu\'s Swin models '
                    f'({", ".join(FAMILY.specs)}) have {WINDOW}x{WINDOW} windows (timm\'s *_window7_224)')
  kernel = tensors['patch_embed.proj.weight']
  widths = (int(kernel.shape[0]),)
  heads = tuple(int(heads) for _, heads in tables)
  name = FAMILY.twin(where, f'a Swin Transformer with {stages} blocks, width {widths[0]} and {heads} heads',
                     stage_sizes=stages, widths=widths, heads=heads)
  return name, {'patch_size': int(kernel.shape[-1])}


def _unread(keys) -> set[str]:
  """The index and mask buffers that older timm versions saved: the network computes them."""
  return {key for key in keys if key.endswith(('.relative_position_index', '.attn_mask'))}


def _timm_architecture(model: str, spec: Spec, options: dict, image_shape, model_args: dict):
  model_args.update(img_size=list(image_shape[:2]), patch_size=options.get('patch_size') or spec.patch_size)
  return _TIMM_NAMES[model], model_args


def _preprocessing(tensors, layout: str, options: dict) -> Preprocessing:
  """timm's for its Swin weights: ImageNet's mean/std, 224 px, crop 0.9."""
  del tensors, layout, options
  return Preprocessing(crop_fraction=0.9)


def _smallest_image(spec: Spec) -> int:
  return spec.patch_size  # a one-token map is one window; merging rounds up


TIMM = Layout('timm', ('timm',), _recognise, rules=lambda spec, options, keys: swin_rules(spec.stage_sizes),
              head=lambda keys: 'head.fc.bias', unread=_unread)

FAMILY = Family('swin', {
    'swin_t': SwinSpec('swin', (2, 2, 6, 2), widths=(96,), patch_size=4, heads=(3, 6, 12, 24)),
    'swin_s': SwinSpec('swin', (2, 2, 18, 2), widths=(96,), patch_size=4, heads=(3, 6, 12, 24)),
    'swin_b': SwinSpec('swin', (2, 2, 18, 2), widths=(128,), patch_size=4, heads=(4, 8, 16, 32)),
}, _build, _layers, ('patch_size', 'drop_path', 'remat_mlps'), title='Swin Transformer',
    short_names='swin_t/s/b', smallest_image=_smallest_image, layouts=(TIMM,),
    timm_architecture=_timm_architecture, preprocessing=_preprocessing,
    input_kernel='params/patch_embed/kernel')
