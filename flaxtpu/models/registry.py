"""The model registry: `register`, `NAMES`, `get_spec`, `get_family`, `create(name, ...)` and
the layer depths.

The families register in `flaxtpu/models/__init__.py`, one line each; this module imports
none of them, so `family.py` asks it about a family without an import circle. No JAX
or Flax at module level: the CLI validates `model.name` before JAX starts.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

from flaxtpu.settings.errors import UserError, join_or

if TYPE_CHECKING:  # annotations only: family.py imports this module
  from flaxtpu.models.family import Family, Layout, Spec


_FAMILIES: dict[str, Family] = {}  # family name -> plug-in
_SPECS: dict[str, Spec] = {}  # model name -> architecture
NAMES: tuple[str, ...] = ()  # every model name, family by family in registration order


def register(family: Family) -> None:
  """Adds a family plug-in: its models join `NAMES`, `create`, published-weight recognition and export."""
  global NAMES
  if family.name in _FAMILIES or any(name in _SPECS for name in family.specs):
    raise ValueError(f'model family {family.name!r} or one of its models ({", ".join(family.specs)}) '
                     'is registered already')
  assert all(spec.family == family.name for spec in family.specs.values()), family.name
  if not set(family.options) <= set(OPTIONS):
    raise ValueError(f'model family {family.name!r} reads options {", ".join(family.options)}; config.model '
                     f'has only {", ".join(OPTIONS)}')
  _FAMILIES[family.name] = family
  _SPECS.update(family.specs)
  NAMES = tuple(_SPECS)
  layer_depths.cache_clear()


def unregister(name: str) -> None:
  """Removes the family `name` (a test's plug-in) with its models."""
  global NAMES
  family = _FAMILIES.pop(name)
  for model in family.specs:
    del _SPECS[model]
  NAMES = tuple(_SPECS)
  layer_depths.cache_clear()


# The config.model keys a family may read (`Family.options` says which), passed to `create` by name.
OPTIONS = ('patch_size', 'pool', 'dropout', 'drop_path', 'padding', 'gelu', 'downsample', 'space_to_depth',
           'remat_mlps')
POOLS = ('gap', 'tok', 'map', 'avg')  # vit: see flaxtpu/models/vit.py
# resnet: symmetric as PyTorch | XLA's SAME (runs saved before model.padding);
# efficientnet, mobilenetv3: PyTorch's models | TensorFlow's ports (timm's tf_*: SAME, BatchNorm eps 1e-3)
PADDINGS = ('torch', 'same')
# vit: erf as timm | tanh as big_vision (runs saved before model.gelu) | OpenAI CLIP's QuickGELU
GELUS = ('exact', 'tanh', 'quick')
# convnext: stride-2 convs floor odd maps as timm | XLA's SAME rounds up (runs saved before model.downsample)
DOWNSAMPLES = ('floor', 'ceil')
# What a run saved before a model option existed computed; config.from_saved fills these in.
LEGACY_OPTIONS = {'padding': 'same', 'gelu': 'tanh', 'downsample': 'ceil'}


def get_spec(name: str) -> Spec:
  """The spec of model `name`, or a UserError listing the valid names."""
  if name not in _SPECS:
    raise UserError(f'unknown model {name!r}; choose one of: {", ".join(NAMES)}')
  return _SPECS[name]


def get_family(name: str) -> Family:
  """The family plug-in of model `name` (a UserError for an unknown name, as `get_spec`)."""
  return _FAMILIES[get_spec(name).family]


def families() -> tuple[Family, ...]:
  """Every registered family, in registration order."""
  return tuple(_FAMILIES.values())


def layout(name: str, layout_name: str) -> Layout:
  """The `layout_name` layout ('timm', 'big_vision') of model `name`'s family, or a UserError."""
  found = get_family(name).layout(layout_name)
  if found is None and layout_name == 'timm':
    raise UserError(no_timm_twin(name))
  if found is None:
    raise UserError(f'{name} has no {layout_name} layout; it reads: '
                    f'{", ".join(layout.name for layout in get_family(name).layouts) or "none"}')
  return found


def no_timm_twin(name: str) -> str:
  """The message for a model without a timm architecture, naming the models that have one."""
  having = [family.listed() for family in _FAMILIES.values() if family.timm_architecture]
  return f'{name} has no timm twin; timm\'s layout exists for {join_or(having, "and")}'


@functools.lru_cache(maxsize=None)
def layer_depths(name: str) -> tuple[dict[str, int], int]:
  """({top-level module: its layer}, the head's layer) of model `name`'s layer-depth map."""
  layers = get_family(name).layers(get_spec(name))
  return {module: depth for depth, modules in enumerate(layers) for module in modules}, len(layers) - 1


def data_fit(name: str):
  """None, or the function {parameter name: value} of normalised train images that a fresh run of
  model `name` sets before step 1 (`Family.data_fit`)."""
  return get_family(name).data_fit(get_spec(name))


def remat_policy(name: str):
  """'full' recomputes everything (no policy); other names are jax.checkpoint_policies."""
  import jax  # pylint: disable=g-import-not-at-top
  return None if name == 'full' else getattr(jax.checkpoint_policies, name)


def check_image_shape(name: str, image_shape: tuple[int, ...], patch_size: int = 0) -> None:
  """Raises UserError naming config.model.patch_size when the patches do not tile the images,
  or config.dataset.image_size when the images are too small for the model's pooling."""
  spec = get_spec(name)
  patch = patch_size or spec.patch_size
  height, width = image_shape[:2]
  smallest = get_family(name).smallest_image(spec)
  if min(height, width) < smallest:
    raise UserError(f'{name} pools {height}x{width} images to nothing: '
                    f'it needs at least {smallest}x{smallest}; '
                    f'set --config.dataset.image_size={smallest} (or larger) or pick another model')
  if patch and (height % patch or width % patch):
    divisors = [d for d in range(1, min(height, width) + 1) if height % d == 0 and width % d == 0]
    shown = f'{patch_size}' if patch_size else f'0 (= {patch}, the published size for {name})'
    raise UserError(f'config.model.patch_size={shown} does not divide the {height}x{width} images; '
                    f'choose one of {", ".join(map(str, divisors))} (or change config.dataset.image_size)')


def create(name: str, *, num_classes: int, dtype: str = 'float32', remat: str = 'none',
           bn_axis_name: Optional[str] = None, patch_size: int = 0, pool: str = 'gap',
           dropout: float = 0.0, drop_path: float = 0.0, padding: str = 'torch', gelu: str = 'exact',
           downsample: str = 'floor', space_to_depth: bool = False, remat_mlps: int = 0,
           image_shape: Optional[tuple[int, ...]] = None):
  """Builds model `name`; `remat` wraps each block (ResNet, ViT, ConvNeXt) or stage (CNN) in jax.checkpoint.

  `bn_axis_name` makes BatchNorm average its statistics over that pmap axis,
  so that pmap computes the same statistics as one global batch. `patch_size`
  (0 = the published one), `pool`, `dropout`, `drop_path`, `padding` (ResNet),
  `gelu` (ViT), `downsample` (ConvNeXt), `space_to_depth` (the ImageNet ResNets' stem) and
  `remat_mlps` (Swin: its first stages' MLP branches recomputed in the backward pass) configure the
  families that read them (`Spec.options` says which: `Family.options`); given `image_shape`, the
  patches are checked to tile it.
  """
  # pylint: disable=g-import-not-at-top
  import flax.linen as nn
  import jax.numpy as jnp

  spec = get_spec(name)
  if image_shape is not None:
    check_image_shape(name, image_shape, patch_size)
  wrap = (lambda unit: unit) if remat == 'none' else (
      lambda unit: nn.remat(unit, policy=remat_policy(remat)))
  family = _FAMILIES[spec.family]
  options = {'patch_size': patch_size, 'pool': pool, 'dropout': dropout, 'drop_path': drop_path,
             'padding': padding, 'gelu': gelu, 'downsample': downsample, 'space_to_depth': space_to_depth,
             'remat_mlps': remat_mlps}
  return family.build(spec, num_classes=num_classes, dtype=jnp.dtype(dtype), wrap=wrap,
                      bn_axis_name=bn_axis_name, **{key: options[key] for key in family.options})
