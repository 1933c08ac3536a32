"""The ConvNeXt family (network: nets/convnext.py): convnext_t/s/b/l, with timm's weights
(stem.0/1, stages.S.downsample.0/1, stages.S.blocks.B, head.norm, head.fc).

`model.downsample` says how the stride-2 downsampling treats odd maps: 'floor'
as timm (the default, and what published weights import with), 'ceil' as XLA's
SAME padding, which flaxtpu used before the option existed (runs saved then
keep it through `models.LEGACY_OPTIONS`; they recorded model.padding, which
ConvNeXt never read, so only the missing key tells them apart).
"""

from __future__ import annotations

from flaxtpu.models import layouts
from flaxtpu.models.family import Family, Layout, Spec
from flaxtpu.models.layouts import Rule, conv, dense, layer_norm, vector
from flaxtpu.settings.errors import UserError

_TIMM_NAMES = {'convnext_t': 'convnext_tiny', 'convnext_s': 'convnext_small', 'convnext_b': 'convnext_base',
               'convnext_l': 'convnext_large'}


def _build(spec: Spec, *, num_classes, dtype, wrap, bn_axis_name, patch_size, drop_path, downsample):
  del bn_axis_name
  from flaxtpu.models.nets import convnext  # pylint: disable=g-import-not-at-top
  return convnext.ConvNeXt(num_classes=num_classes, stage_sizes=spec.stage_sizes,
                           stage_widths=spec.widths, block=wrap(convnext.ConvNeXtBlock),
                           patch_size=patch_size or spec.patch_size, drop_path=drop_path,
                           downsample=downsample, dtype=dtype)


def _layers(spec: Spec) -> list[tuple[str, ...]]:
  """The stem, one layer per block (a stage's downsampling joins its first block), the head."""
  layers = [('stem', 'stem_norm')]
  for stage, size in enumerate(spec.stage_sizes, 1):
    downsample = (f'stage{stage}_norm', f'stage{stage}_downsample')
    layers += [(f'stage{stage}_block{block}', *(downsample if block == 1 else ()))
               for block in range(1, size + 1)]
  return [*layers, ('head_norm', 'head')]


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


def _recognise(tensors, where: str):
  keys = set(tensors)
  if not ('stem.0.weight' in keys and 'stages.0.blocks.0.conv_dw.weight' in keys):
    return None
  stages = tuple(layouts.count(keys, rf'stages\.{stage}\.blocks\.(\d+)\..+') for stage in range(4))
  widths = tuple(int(tensors[f'stages.{stage}.blocks.0.norm.weight'].shape[0]) for stage in range(4))
  name = FAMILY.twin(where, f'a ConvNeXt with {stages} blocks of widths {widths}',
                     stage_sizes=stages, widths=widths)
  return name, {'patch_size': int(tensors['stem.0.weight'].shape[-1]), 'downsample': 'floor'}


def _timm_architecture(model: str, spec: Spec, options: dict, image_shape, model_args: dict):
  del image_shape
  if options.get('downsample', 'floor') != 'floor':
    raise UserError(f'{model} with model.downsample={options["downsample"]!r} computes another function '
                    'than timm\'s ConvNeXt on odd-sized maps (XLA SAME padding); train with '
                    'model.downsample=floor to export it to timm')
  model_args['patch_size'] = options.get('patch_size') or spec.patch_size
  return _TIMM_NAMES[model], model_args


TIMM = Layout('timm', ('timm',), _recognise,
              rules=lambda spec, options, keys: convnext_rules(spec.stage_sizes),
              head=lambda keys: 'head.fc.bias')

def _smallest_image(spec: Spec) -> int:
  """A halving per later stage (floored, each map must keep a pixel) after a stem of stride 1 at least;
  the network names a larger stride's need (`nets.convnext.ConvNeXt`)."""
  return 2 ** (len(spec.stage_sizes) - 1)


FAMILY = Family('convnext', {
    'convnext_t': Spec('convnext', (3, 3, 9, 3), widths=(96, 192, 384, 768), patch_size=4),
    'convnext_s': Spec('convnext', (3, 3, 27, 3), widths=(96, 192, 384, 768), patch_size=4),
    'convnext_b': Spec('convnext', (3, 3, 27, 3), widths=(128, 256, 512, 1024), patch_size=4),
    'convnext_l': Spec('convnext', (3, 3, 27, 3), widths=(192, 384, 768, 1536), patch_size=4),
}, _build, _layers, ('patch_size', 'drop_path', 'downsample'), title='ConvNeXt',
    short_names='convnext_t/s/b/l', smallest_image=_smallest_image, layouts=(TIMM,),
    timm_architecture=_timm_architecture, input_kernel='params/stem/kernel')
