"""The EfficientNet family (network: nets/mbconv.py, shared parts: mbconv.py): efficientnet_b0-b7, with the
weights of timm (efficientnet_b*, and tf_efficientnet_b* with model.padding=same) and torchvision
(efficientnet_b*: features.S.B.block.N, classifier.1).

timm's efficientnet_bN and tf_efficientnet_bN hold the same tensors; only the padding and BatchNorm eps
differ (PyTorch's vs TensorFlow's), so a timm file's config.json (its architecture) tells them apart, and
a bare file of a tf_ model needs model.padding=same.
"""

from __future__ import annotations

from flaxtpu.models import layouts, mbconv
from flaxtpu.models.family import Family, Layout, Preprocessing
from flaxtpu.models.mbconv import MBConvSpec
from flaxtpu.settings.errors import UserError

# timm's _gen_efficientnet (and torchvision's _efficientnet_conf): stage rows of the B0 base network.
_STAGES = (
    (('ds', 1, 3, 1, 1, 16, 0.25, ''),),
    (('ir', 2, 3, 2, 6, 24, 0.25, ''),),
    (('ir', 2, 5, 2, 6, 40, 0.25, ''),),
    (('ir', 3, 3, 2, 6, 80, 0.25, ''),),
    (('ir', 3, 5, 1, 6, 112, 0.25, ''),),
    (('ir', 4, 5, 2, 6, 192, 0.25, ''),),
    (('ir', 1, 3, 1, 6, 320, 0.25, ''),),
)
# name: (width multiplier, depth multiplier, resolution, crop: timm's tf_efficientnet_bN defaults)
_SCALES = {
    'b0': (1.0, 1.0, 224, 0.875), 'b1': (1.0, 1.1, 240, 0.882), 'b2': (1.1, 1.2, 260, 0.890),
    'b3': (1.2, 1.4, 300, 0.904), 'b4': (1.4, 1.8, 380, 0.922), 'b5': (1.6, 2.2, 456, 0.934),
    'b6': (1.8, 2.6, 528, 0.942), 'b7': (2.0, 3.1, 600, 0.949),
}


def _spec(variant: str) -> MBConvSpec:
  width, depth, size, crop = _SCALES[variant]
  stem = mbconv.make_divisible(32 * width)
  blocks = mbconv.decode(_STAGES, stem=stem, act='silu', width=width, depth=depth, se_of_expanded=False)
  return MBConvSpec('efficientnet', **mbconv.stage_fields(blocks), blocks=blocks, stem=stem,
                    features=mbconv.make_divisible(1280 * width), act='silu', gate='sigmoid',
                    head_norm=True, image_size=size, crop=crop,
                    torchvision_eps=1e-3 if variant in ('b5', 'b6', 'b7') else 1e-5)


SPECS = {f'efficientnet_{variant}': _spec(variant) for variant in _SCALES}


def _recognise_timm(tensors, where: str):
  keys = set(tensors)
  if not ('conv_stem.weight' in keys and 'bn2.running_mean' in keys and 'blocks.0.0.conv_dw.weight' in keys
          and 'blocks.0.0.se.conv_reduce.weight' in keys):  # timm's MobileNetV2 is the same net without SE
    return None
  sizes, widths = mbconv.timm_shape(tensors)
  name = FAMILY.twin(where, f'an EfficientNet with {sizes} blocks of widths {widths}',
                     stage_sizes=sizes, widths=widths)
  return name, {'padding': 'torch'}


def _torchvision_positions(spec: MBConvSpec) -> list[str]:
  return [f'features.{stage}.{index}' for stage, blocks in enumerate(spec.blocks, 1)
          for index in range(len(blocks))]


def _recognise_torchvision(tensors, where: str):
  keys = set(tensors)
  if not ('features.0.0.weight' in keys and 'classifier.1.weight' in keys
          and 'features.1.0.block.0.0.weight' in keys):
    return None
  stages = layouts.count(keys, r'features\.(\d+)\.\d+\.block\..+')
  sizes = tuple(layouts.count(keys, rf'features\.{stage}\.(\d+)\.block\..+')
                for stage in range(1, stages + 1))
  widths = tuple(int(tensors[max(key for key in keys if key.startswith(f'features.{stage}.{size - 1}.block.')
                                 and key.endswith('.running_mean'))].shape[0])
                 for stage, size in enumerate(sizes, 1))
  name = FAMILY.twin(where, f'an EfficientNet with {sizes} blocks of widths {widths}',
                     stage_sizes=sizes, widths=widths)
  return name, {'padding': 'torch'}


def _timm_architecture(model: str, spec: MBConvSpec, options: dict, image_shape, model_args: dict):
  del spec, image_shape
  return ('tf_' if options.get('padding') == 'same' else '') + model, model_args


def _preprocessing(tensors, layout: str, options: dict) -> Preprocessing:
  """timm's defaults for the variant's resolution and crop."""
  recognise = _recognise_timm if layout == 'timm' else _recognise_torchvision
  spec = SPECS[recognise(tensors, 'the weights')[0]]
  return Preprocessing(image_size=spec.image_size, crop_fraction=spec.crop)


def _check_padding(spec, options, keys):
  if options.get('padding', 'torch') != 'torch':
    raise UserError('torchvision\'s EfficientNet pads as PyTorch: read its weights with model.padding=torch')
  return mbconv.torchvision_rules(spec, _torchvision_positions(spec))


TIMM = Layout('timm', ('timm',), _recognise_timm, rules=lambda spec, options, keys: mbconv.timm_rules(spec),
              head=lambda keys: 'classifier.bias')
TORCHVISION = Layout('torchvision', ('torchvision',), _recognise_torchvision, rules=_check_padding,
                     head=lambda keys: 'classifier.1.bias')

FAMILY = Family('efficientnet', SPECS, mbconv.build, mbconv.layers, mbconv.OPTIONS, title='EfficientNet',
                short_names='efficientnet_b0-b7', smallest_image=mbconv.smallest_image,
                layouts=(TIMM, TORCHVISION), timm_architecture=_timm_architecture,
                preprocessing=_preprocessing, input_kernel=mbconv.input_kernel())
