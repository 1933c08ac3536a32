"""Published architectures that flaxtpu has no model for, told by their state dicts' keys, so that a file
of one is named as what it is ("looks like an EfficientNet") rather than as "not a ResNet", or read
in part as the nearest family (an SE-ResNet as a ResNet).

`identify(keys)` is asked when no registered family recognises a file, and when a recognised file holds
tensors its rules have no place for. Numpy only: no JAX, no torch.
"""

from __future__ import annotations

import re
from typing import Callable, Collection, Optional


def _some(pattern: str) -> Callable[[Collection[str]], Optional[str]]:
  """A test that holds when some key fully matches `pattern`: names the module its group shows ('layer1.0.se')
  in the first such key."""

  def test(keys):
    found = sorted(match.group(1) for key in keys if (match := re.fullmatch(pattern, key)))
    return found[0] if found else None

  return test


def _all(*keys: str) -> Callable[[Collection[str]], Optional[str]]:
  return lambda present: keys[0].rsplit('.', 1)[0] if all(key in present for key in keys) else None


# (what the file is, test: keys -> the module that shows it, or None), the more specific first.
_ARCHITECTURES = (
    ('an SE-ResNet or SE-ResNeXt (squeeze-excitation)', _some(r'(layer\d+\.\d+\.se)\..+')),
    ('a ResNet-D (a deep stem: timm\'s resnet*d)', _all('conv1.0.weight', 'layer1.0.conv1.weight')),
    ('a ViT with layer scale (DeiT III)', _some(r'(blocks\.\d+\.ls1)\..+')),
    ('a timm MobileNetV3', _all('conv_stem.weight', 'conv_head.bias')),
    ('a timm EfficientNet', _some(r'(blocks\.\d+\.\d+\.se)\.conv_reduce\.weight')),
    ('a timm MobileNetV2 or another EfficientNet-like net', _all('conv_stem.weight')),
    ('a torchvision MobileNetV3', _all('classifier.3.weight', 'features.0.0.weight')),
    ('a torchvision EfficientNet', _some(r'(features\.\d+\.\d+\.block)\.\d+\.fc1\.weight')),
    ('a torchvision MobileNetV2', _some(r'(features\.\d+\.conv)\.\d+\.\d+\.weight')),
    ('a ConvNeXt in torchvision\'s layout (flaxtpu reads timm\'s)',
     _some(r'(features\.\d+\.\d+)\.layer_scale')),
    ('a ViT in torchvision\'s layout (flaxtpu reads timm\'s and big_vision\'s)',
     _all('conv_proj.weight', 'encoder.pos_embedding')),
    ('a RegNet', _some(r'(s\d+\.b\d+|trunk_output\.block\d+)\..+')),
    ('a DenseNet', _some(r'(features\.denseblock\d+)\..+')),
    ('a VGG', _some(r'(pre_logits\.fc1|classifier\.6)\.weight')),
)


def identify(keys: Collection[str]) -> Optional[str]:
  """What a state dict's keys look like ('a timm EfficientNet (its blocks.0.0.se.* tensors)'), or None."""
  keys = set(keys)
  for what, test in _ARCHITECTURES:
    if (module := test(keys)) is not None:
      return f'{what} (its {module}.* tensors)'
  return None
