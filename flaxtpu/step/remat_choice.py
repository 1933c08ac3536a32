"""model.remat='auto': the fastest remat policy whose compiled train step fits one device's memory.

The policies, fastest first (so measured on a TPU v5e for all six families of
docs/performance.md's remat table): 'none' keeps every activation for the backward
pass; 'dots_saveable' keeps the outputs of matmuls and convolutions and recomputes
the elementwise work between them (normalisations, activations);
'dots_with_no_batch_dims_saveable' keeps only the matmuls with weights (no
convolutions, no attention scores: ConvNeXt-T and Swin-T in 1.0-1.4 GiB less than
dots_saveable, and faster than 'full'); 'full' recomputes each block whole from its
input. Each is compiled on a zero batch (`compile_plan`) until
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

from flaxtpu.data import memory
from flaxtpu.settings.errors import ConfigError
from flaxtpu.step import compile_plan

AUTO = 'auto'
# Fastest first; each usually needs less memory than the last.
ORDER = ('none', 'dots_saveable', 'dots_with_no_batch_dims_saveable', 'full')


def with_remat(config: ml_collections.ConfigDict, policy: str) -> ml_collections.ConfigDict:
  """A copy of `config` with model.remat=`policy` (the caller's config is never edited)."""
  copy = config.copy_and_resolve_references()
  copy.model.remat = policy
  return copy


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
  for policy in ORDER:
    candidate = with_remat(config, policy)
    plan = compile_plan.plan_memory(candidate, image_shape=image_shape, num_classes=num_classes, **sizes)
    need = memory.device_need(plan)
    plans.append({**plan, 'fits': _everywhere(need is None or need[0] <= need[1])})
    if plans[-1]['fits']:
      if too_large:
        why = f'{_needs(too_large)} did not fit in {too_large[0][1][2]}'
      else:
        why = f'it fits in {need[2]}: nothing to recompute' if need else 'it fits: nothing to recompute'
      logging.info('model.remat=auto: %s (%s)', policy, why)
      return candidate, plans
    too_large.append((policy, need))
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
  return [{key: plan[key] for key in ('remat', 'fits', 'total_bytes', 'temp_bytes', 'compile_seconds')
           if key in plan} for plan in plans]
