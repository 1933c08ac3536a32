"""Published weight layouts <-> flaxtpu's parameter trees, in both directions: the parts every table shares.

Each family keeps its own tables in its plug-in (`flaxtpu/models/<family>.py`).
A `Rule` ties one array of the source layout (a timm/torchvision state-dict
key, or a big_vision/`vision_transformer` .npz key) to the flaxtpu arrays it
becomes ('params/...' or 'batch_stats/...' names), with the function that
converts it and its inverse. Importing reads every rule's source array;
exporting (to timm's layout) runs the inverses. PyTorch keeps convolutions
as OIHW and linear layers as [out, in]; flax as HWIO and [in, out].

Numpy only: no JAX, no torch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Collection, Mapping, Optional

import numpy as np

from flaxtpu.settings.errors import UserError


@dataclasses.dataclass(frozen=True)
class Rule:
  source: str  # key in the published file
  targets: tuple[str, ...]  # flaxtpu names: 'params/Conv_0/kernel', 'batch_stats/BatchNorm_0/mean'
  load: Callable[[np.ndarray], tuple[np.ndarray, ...]]  # source array -> target arrays
  save: Callable[..., np.ndarray]  # target arrays -> source array


def one(source: str, target: str, load=lambda w: w, save=lambda w: w) -> Rule:
  return Rule(source, (target,), lambda w: (load(w),), save)


def count(keys, pattern: str) -> int:
  """How many distinct values the first group of `pattern` takes over the keys it fully matches."""
  return len({match.group(1) for key in keys if (match := re.fullmatch(pattern, key))})


def conv(source: str, target: str) -> Rule:
  """PyTorch OIHW <-> flax HWIO (depthwise: O1HW <-> HW1O)."""
  return one(source, target, lambda w: w.transpose(2, 3, 1, 0), lambda k: k.transpose(3, 2, 0, 1))


def linear(source: str, target: str) -> Rule:
  return one(source, target, lambda w: w.T, lambda k: k.T)


def vector(source: str, target: str) -> Rule:
  return one(source, target)


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


def torch_counters(keys: Collection[str]) -> set[str]:
  """The keys a state dict holds that no model computes with: BatchNorm's update counters."""
  return {key for key in keys if key.endswith('.num_batches_tracked')}


def module_of(key: str) -> str:
  """'fc' of 'fc.bias', 'params/head' of 'params/head/bias'."""
  return re.split(r'[./](?=[^./]*$)', key)[0]


def _listed(keys: list[str]) -> str:
  shown = ', '.join(repr(key) for key in keys[:2])
  return shown + (f' and {len(keys) - 2} more' if len(keys) > 2 else '')


def check_coverage(rules: list[Rule], tensors: Mapping[str, np.ndarray], head: str, unread: Collection[str],
                   where: str, what: str, identify: Callable[[Collection[str]], Optional[str]]) -> bool:
  """That the file holds every tensor the rules read and nothing else (`unread` aside): a file the rules
  read in part is another model. Returns whether the file is headless: the classifier's module (of
  `head`, its bias) absent altogether, which a run that trains a new head does not need.

  `what` names the model the rules are of ('resnet18 (timm layout)'); `identify` (keys -> what the file
  looks like, or None) names the architecture of a file whose extra tensors flaxtpu has no model for.
  """
  sources = {rule.source for rule in rules}
  head_sources = {source for source in sources if module_of(source) == module_of(head)}
  headless = not any(source in tensors for source in head_sources)
  missing = [rule.source for rule in rules if rule.source not in tensors
             and not (headless and rule.source in head_sources)]
  if missing:
    raise UserError(f'{where} lacks tensor {_listed(missing)} of {what}, which its other tensors are: the '
                    'file is incomplete or damaged; download it again or save the whole model.state_dict()')
  unused = [key for key in tensors if key not in sources and key not in unread]
  if unused:
    modules = list(dict.fromkeys(module_of(key) + '.*' for key in unused))
    looks = identify(set(tensors))
    raise UserError(f'{where} holds {len(unused)} tensor{"s" * (len(unused) > 1)} that {what} has no place '
                    f'for ({_listed(unused)}): '
                    + (f'it looks like {looks}, which flaxtpu has no model for' if looks else
                       f'it is another architecture or a variant ({", ".join(modules[:2])}'
                       f'{", ..." if len(modules) > 2 else ""}) that flaxtpu has no model for')
                    + '; read without them it would compute another function')
  return headless


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
    if not np.isfinite(source).all():
      bad = int(np.size(source) - np.isfinite(source).sum())
      raise UserError(f'{where}: tensor {rule.source!r} holds {bad} NaN/Inf value{"s" * (bad > 1)} (of '
                      f'{np.size(source)}); the file is damaged or was saved from a diverged model: '
                      'use another copy of the weights')
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
