"""What a model family plug-in declares: `Spec` (one model's architecture), `Layout` (a published weight
layout it reads and writes) and `Family` (its models, options, layer map, layouts and hooks).

Each `flaxtpu/models/<family>.py` builds one `Family` and `flaxtpu/models/__init__.py`
registers it; nothing else in flaxtpu knows which families exist. No JAX or
Flax here: the CLI reads specs, options and published files before JAX starts,
and a family's `build` imports its network (`flaxtpu/models/nets/`) when called.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Mapping, Optional

import numpy as np

from flaxtpu.models.layouts import torch_counters
from flaxtpu.settings.errors import UserError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
INCEPTION_MEAN, INCEPTION_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # pixels to [-1, 1]: big_vision, AugReg


@dataclasses.dataclass(frozen=True)
class Spec:
  family: str  # the registered Family's name: 'cnn' | 'fastnet' | 'cifar_resnet' | ... | a plug-in's
  stage_sizes: tuple[int, ...] = ()  # blocks per stage (ResNet, ConvNeXt); (depth,) for ViT
  bottleneck: bool = False
  widths: tuple[int, ...] = ()  # channels per stage (ConvNeXt); (stem, *blocks) for FastNet; (width,) for ViT
  num_heads: int = 0  # ViT
  mlp_dim: int = 0  # ViT
  patch_size: int = 0  # the published patch (ViT) or stem stride (ConvNeXt); 0 = no patches
  whiten: bool = False  # FastNet: airbench94's data-fitted whitening stem and initialisation

  @property
  def options(self) -> tuple[str, ...]:
    """The `create` options (config.model.* keys) this model reads; the others must keep their defaults."""
    from flaxtpu.models import registry  # pylint: disable=g-import-not-at-top
    return next(family for family in registry.families() if family.name == self.family).options


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """How published weights of a family want images prepared, where the file does not say (timm's defaults)."""
  mean: tuple[float, ...] = IMAGENET_MEAN
  std: tuple[float, ...] = IMAGENET_STD
  crop_fraction: float = 0.875
  image_size: int = 224


def imagenet_preprocessing(tensors: Mapping[str, np.ndarray], layout: str, options: dict) -> Preprocessing:
  """timm's defaults for a convolutional network: ImageNet's mean/std, 224 px, crop 0.875."""
  del tensors, layout, options
  return Preprocessing()


@dataclasses.dataclass(frozen=True)
class Layout:
  """One published layout of a family's weights: how a file of it is recognised, and the rules between
  its tensors and flaxtpu's arrays (`flaxtpu.models.layouts.Rule`)."""
  name: str  # what `pretrained.Published.layout` records: 'timm' | 'big_vision'
  sources: tuple[str, ...]  # whose files these are, for messages: ('timm', 'torchvision')
  # (tensors, where) -> (model name, its options) when the file is of this layout, else None;
  # a file of this layout that no model of the family matches is a UserError
  recognise: Callable[[Mapping[str, np.ndarray], str], Optional[tuple[str, dict]]]
  # (spec, model options, the file's keys (empty when writing)) -> the rules
  rules: Callable[[Spec, dict, Collection[str]], list]
  # the file's key of the classifier's bias (its length: the classes), also where a headless file has none
  head: Callable[[Collection[str]], str]
  # the file's keys that no rule reads and no model computes with (BatchNorm's counters, an optimizer's
  # state); any other key that no rule reads is an error (another model)
  unread: Callable[[Collection[str]], Collection[str]] = torch_counters


def _no_data_fit(spec: Spec) -> None:
  del spec


def _last_spatial_map(spec: Spec) -> tuple[str, ...]:
  del spec
  return ()


def _smallest_one(spec: Spec) -> int:
  del spec
  return 1


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family plug-in: everything flaxtpu knows about its models lives here."""
  name: str  # Spec.family of its models
  specs: Mapping[str, Spec]  # model name -> architecture, in the order `models.NAMES` lists them
  # (spec, *, num_classes, dtype, wrap, bn_axis_name, **{option: value for option in options}) -> flax Module;
  # `wrap` wraps a remat unit (block) class in nn.remat, or is the identity
  build: Callable[..., Any]
  # The top-level modules of each layer, from the input up, the head last (as timm's group_matcher
  # counts): optimizer.layer_decay scales a parameter's rate by its module's layer; a module listed
  # nowhere is an error.
  layers: Callable[[Spec], list[tuple[str, ...]]]
  options: tuple[str, ...] = ()  # the `create` options (config.model.* keys) it reads
  title: str = ''  # how messages name it: 'ResNet'
  short_names: str = ''  # how messages list its models ('resnet18-152'); '' = the names joined
  smallest_image: Callable[[Spec], int] = _smallest_one  # the smallest side its pooling leaves non-empty
  layouts: tuple[Layout, ...] = ()  # the published layouts it reads (and, for timm, writes)
  # (model name, spec, model options, image_shape, timm model_args) -> (timm architecture, model_args)
  # computing the same function; None: no timm twin (no timm export)
  timm_architecture: Optional[Callable[..., tuple[str, dict]]] = None
  # timm's preprocessing defaults for the family's published weights (tensors, layout, options)
  preprocessing: Callable[[Mapping[str, np.ndarray], str, dict], Preprocessing] = imagenet_preprocessing
  # its first kernel ('params/Conv_0/kernel'), which init_from sums over colours for 1-channel images
  input_kernel: str = ''
  fixed_image_size: bool = False  # its parameters fix the image size it reads (ViT's position embeddings)
  # spec -> None, or a function {parameter name: value} of normalised train images [N, H, W, C] that a
  # fresh run sets before step 1 (FastNet's whitening stem)
  data_fit: Callable[[Spec], Optional[Callable[[np.ndarray], dict]]] = _no_data_fit
  # spec -> the module path (('block12', 'norm1')) whose output Grad-CAM explains
  # (`flaxtpu.evaluation.explain`);
  # () = the last module that returns a [batch, H, W, C] map (every convolutional family)
  feature_map: Callable[[Spec], tuple[str, ...]] = _last_spatial_map

  def layout(self, name: str) -> Optional[Layout]:
    return next((layout for layout in self.layouts if layout.name == name), None)

  def listed(self) -> str:
    return self.short_names or ', '.join(self.specs)

  def twin(self, where: str, described: str, **fields) -> str:
    """The model of this family whose spec has these fields, or a UserError naming the supported ones."""
    for name, spec in self.specs.items():
      if all(getattr(spec, key) == value for key, value in fields.items()):
        return name
    raise UserError(f'{where} holds {described}, which no flaxtpu model matches; supported: '
                    f'{", ".join(self.specs)}')

