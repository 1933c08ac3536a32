"""model.remat='auto': the fastest remat policy whose compiled train step fits one device's memory.

The policies, fastest first (so measured on a TPU v5e for all six families of
docs/performance.md's remat table): 'none' keeps every activation for the backward
pass; 'dots_saveable' keeps the outputs of matmuls and convolutions and recomputes
the elementwise work between them (normalisations, activations);
'dots_with_no_batch_dims_saveable' keeps only the matmuls with weights (no
convolutions, no attention scores: ConvNeXt-T and Swin-T in 1.0-1.4 GiB less than
dots_saveable, and faster than 'full'); 'full' recomputes each block whole from its
input. A model that can recompute its first stage's MLP branches alone
(`model.remat_mlps`: Swin) tries that between 'none' and 'dots_saveable': Swin-T on a
v5e ran 1,328 img/s in 7.73 GiB so, against 1,350 in 9.18 with none and 1,063 in
5.99 with dots_saveable. Each is compiled on a zero batch (`compile_plan`) until
XLA's per-device memory plan fits (`memory.device_need`, the check every run makes
after its compile). The winner's train step is the one training compiles next: with
the persistent compilation cache on, a cache hit.
"""

from __future__ import annotations

from typing import Optional

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from flaxtpu import models
from flaxtpu.data import memory
from flaxtpu.settings.errors import ConfigError
from flaxtpu.step import compile_plan

AUTO = 'auto'
# Fastest first; each usually needs less memory than the last.
ORDER = ('none', 'dots_saveable', 'dots_with_no_batch_dims_saveable', 'full')


def with_remat(config: ml_collections.ConfigDict, policy: str, remat_mlps: Optional[int] = None
               ) -> ml_collections.ConfigDict:
  """A copy of `config` with model.remat=`policy` (and model.remat_mlps, where given); the caller's
  config is never edited."""
  copy = config.copy_and_resolve_references()
  copy.model.remat = policy
  if remat_mlps is not None:
    copy.model.remat_mlps = remat_mlps
  return copy


def candidates(config: ml_collections.ConfigDict) -> list[ml_collections.ConfigDict]:
  """The configs 'auto' compiles, fastest first: ORDER's policies, and for a model whose first
  stage's MLP branches can be recomputed alone (and model.remat_mlps left at 0) that one after 'none'."""
  tried = [with_remat(config, policy) for policy in ORDER]
  if 'remat_mlps' in models.get_spec(config.model.name).options and config.model.remat_mlps == 0:
    tried.insert(1, with_remat(config, 'none', remat_mlps=1))
  return tried


def label(config: ml_collections.ConfigDict) -> str:
  """A candidate as the log and the errors name it: its policy, and remat_mlps where set."""
  mlps = config.model.get('remat_mlps', 0)
  return f'{config.model.remat} with remat_mlps={mlps}' if mlps else config.model.remat


def resolve(config: ml_collections.ConfigDict, *, image_shape: tuple[int, int, int], num_classes: int,
            num_train_examples: Optional[int] = None) -> tuple[ml_collections.ConfigDict, list[dict]]:
  """(`config` with model.remat='auto' replaced by the fastest policy that fits, the memory plans
  compiled to find it, in order); `config` itself and [] for any other model.remat.

  Raises ConfigError when not even 'full' fits, naming what each policy needs.
  """
  if config.model.remat != AUTO:
    return config, []
  plans, too_large = [], []  # too_large: (policy, its need) of each policy that did not fit
  sizes = {} if num_train_examples is None else {'num_train_examples': num_train_examples}
  for candidate in candidates(config):
    plan = compile_plan.plan_memory(candidate, image_shape=image_shape, num_classes=num_classes, **sizes)
    need = memory.device_need(plan)
    mlps = {'remat_mlps': candidate.model.remat_mlps} if candidate.model.remat_mlps else {}
    plans.append({**plan, **mlps, 'fits': _everywhere(need is None or need[0] <= need[1])})
    if plans[-1]['fits']:
      if too_large:
        why = f'{_needs(too_large)} did not fit in {too_large[0][1][2]}'
      else:
        why = f'it fits in {need[2]}: nothing to recompute' if need else 'it fits: nothing to recompute'
      logging.info('model.remat=auto: %s (%s)', label(candidate), why)
      return candidate, plans
    too_large.append((label(candidate), need))
  raise ConfigError(f'config.model.remat=auto: no policy fits config.batch_size={config.batch_size} of '
                    f'model.name={config.model.name!r} in {too_large[0][1][2]} (the train step needs '
                    f'{_needs(too_large)}); lower config.batch_size or the image size')


def _needs(too_large: list) -> str:
  return ', '.join(f'{policy} {memory.format_bytes(need[0])}' for policy, need in too_large)


def _everywhere(fits: bool) -> bool:
  """Whether the plan fits on every process: all of them compile the same policies, in step."""
  if jax.process_count() == 1:
    return fits
  return bool(np.all(multihost_utils.process_allgather(np.array(fits))))


def summary(plans: list[dict]) -> list[dict]:
  """What --mode=plan reports of each policy `resolve` compiled."""
  return [{key: plan[key] for key in ('remat', 'remat_mlps', 'fits', 'total_bytes', 'temp_bytes',
                                     'compile_seconds')
           if key in plan} for plan in plans]
