"""The MobileNetV3 family (network: nets/mbconv.py, shared parts: mbconv.py): mobilenetv3_l and mobilenetv3_s,
with the weights of timm (mobilenetv3_large_100/small_100, and tf_mobilenetv3_* with model.padding=same)
and torchvision (mobilenet_v3_large/small: features.N.block.M, classifier.0/3).

Hard-swish blocks (ReLU in the first ones), squeeze-excitation with ReLU and a hard-sigmoid gate on the
expanded width, and a head that pools first, then a 1x1 conv with bias (torchvision's classifier.0), no
BatchNorm, hard-swish, the classifier.
"""

from __future__ import annotations

from flaxtpu.models import layouts, mbconv
from flaxtpu.models.family import INCEPTION_MEAN, INCEPTION_STD, Family, Layout, Preprocessing
from flaxtpu.models.mbconv import MBConvSpec
from flaxtpu.settings.errors import UserError

# timm's _gen_mobilenet_v3 (torchvision's _mobilenet_v3_conf lists the same blocks one by one).
_LARGE = (
    (('ds', 1, 3, 1, 1, 16, 0, 'relu'),),
    (('ir', 1, 3, 2, 4, 24, 0, 'relu'), ('ir', 1, 3, 1, 3, 24, 0, 'relu')),
    (('ir', 3, 5, 2, 3, 40, 0.25, 'relu'),),
    (('ir', 1, 3, 2, 6, 80, 0, ''), ('ir', 1, 3, 1, 2.5, 80, 0, ''), ('ir', 2, 3, 1, 2.3, 80, 0, '')),
    (('ir', 2, 3, 1, 6, 112, 0.25, ''),),
    (('ir', 3, 5, 2, 6, 160, 0.25, ''),),
    (('cn', 1, 1, 1, 1, 960, 0, ''),),
)
_SMALL = (
    (('ds', 1, 3, 2, 1, 16, 0.25, 'relu'),),
    (('ir', 1, 3, 2, 4.5, 24, 0, 'relu'), ('ir', 1, 3, 1, 3.67, 24, 0, 'relu')),
    (('ir', 1, 5, 2, 4, 40, 0.25, ''), ('ir', 2, 5, 1, 6, 40, 0.25, '')),
    (('ir', 2, 5, 1, 3, 48, 0.25, ''),),
    (('ir', 3, 5, 2, 6, 96, 0.25, ''),),
    (('cn', 1, 1, 1, 1, 576, 0, ''),),
)
_TIMM_NAMES = {'mobilenetv3_l': 'mobilenetv3_large_100', 'mobilenetv3_s': 'mobilenetv3_small_100'}


def _spec(stages, features: int) -> MBConvSpec:
  blocks = mbconv.decode(stages, stem=16, act='hard_swish', se_of_expanded=True,
                         se_round=mbconv.make_divisible)
  return MBConvSpec('mobilenetv3', **mbconv.stage_fields(blocks), blocks=blocks, stem=16, features=features,
                    act='hard_swish', gate='hard_sigmoid', se_act='relu', head_norm=False,
                    torchvision_eps=1e-3)


SPECS = {'mobilenetv3_l': _spec(_LARGE, 1280), 'mobilenetv3_s': _spec(_SMALL, 1024)}


def _recognise_timm(tensors, where: str):
  keys = set(tensors)
  if not ('conv_stem.weight' in keys and 'conv_head.bias' in keys and 'blocks.0.0.conv_dw.weight' in keys):
    return None
  sizes, widths = mbconv.timm_shape(tensors)
  name = FAMILY.twin(where, f'a MobileNetV3 with {sizes} blocks of widths {widths}',
                     stage_sizes=sizes, widths=widths)
  return name, {'padding': 'torch'}


def _recognise_torchvision(tensors, where: str):
  keys = set(tensors)
  if not ('features.0.0.weight' in keys and 'classifier.3.weight' in keys
          and 'features.1.block.0.0.weight' in keys):
    return None
  blocks = layouts.count(keys, r'features\.(\d+)\..+') - 1  # features.0 is the stem
  width = int(tensors[f'features.{blocks}.1.running_mean'].shape[0])
  for name, spec in SPECS.items():
    if sum(spec.stage_sizes) == blocks and spec.widths[-1] == width:
      return name, {'padding': 'torch'}
  raise UserError(f'{where} holds a MobileNetV3 of {blocks} blocks, the last {width} wide, which no flaxtpu '
                  f'model matches; supported: {", ".join(SPECS)}')


def _torchvision_rules(spec: MBConvSpec, options: dict, keys):
  del keys
  if options.get('padding', 'torch') != 'torch':
    raise UserError('torchvision\'s MobileNetV3 pads as PyTorch: read its weights with model.padding=torch')
  positions = [f'features.{index}' for index in range(1, sum(spec.stage_sizes) + 1)]  # flat, after the stem
  return mbconv.torchvision_rules(spec, positions)


def _timm_architecture(model: str, spec: MBConvSpec, options: dict, image_shape, model_args: dict):
  del spec, image_shape
  return ('tf_' if options.get('padding') == 'same' else '') + _TIMM_NAMES[model], model_args


def _preprocessing(tensors, layout: str, options: dict) -> Preprocessing:
  """timm's defaults: ImageNet's mean and std, or Inception's for the TensorFlow ports."""
  del tensors, layout
  if options.get('padding') == 'same':
    return Preprocessing(mean=INCEPTION_MEAN, std=INCEPTION_STD)
  return Preprocessing()


TIMM = Layout('timm', ('timm',), _recognise_timm, rules=lambda spec, options, keys: mbconv.timm_rules(spec),
              head=lambda keys: 'classifier.bias')
TORCHVISION = Layout('torchvision', ('torchvision',), _recognise_torchvision, rules=_torchvision_rules,
                     head=lambda keys: 'classifier.3.bias')

FAMILY = Family('mobilenetv3', SPECS, mbconv.build, mbconv.layers, mbconv.OPTIONS, title='MobileNetV3',
                short_names='mobilenetv3_l/s', smallest_image=mbconv.smallest_image,
                layouts=(TIMM, TORCHVISION), timm_architecture=_timm_architecture,
                preprocessing=_preprocessing, input_kernel=mbconv.input_kernel())
