"""Fine-tuning: a fresh run starts from the parameters and BatchNorm statistics of another run.

`init_from.checkpoint` names a workdir (its `init_from.step`: latest | best |
STEP) or one checkpoint directory, WORKDIR/checkpoints/STEP, of any flaxtpu
run (any device count, jit or pmap, fsdp). Every array of this model whose
'/'-joined path and shape match is read from it, onto this run's shardings;
the classifier is re-initialised when the classes differ, and so is whatever
`init_from.skip` matches. The optimizer state and the step start fresh. Only a
fresh run reads it: a run that has checkpoints of its own resumes from them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import traverse_util

from flaxtpu import checkpoint, optim, steps
from flaxtpu.checkpoint import CheckpointError

COLLECTIONS = ('params', 'batch_stats')  # what is read; never the optimizer state, step or data key


def resolve_source(config: ml_collections.ConfigDict) -> tuple[checkpoint.Checkpoints, int]:
  """The checkpoints of the run `init_from.checkpoint` names, and the step to read."""
  given = config.init_from.checkpoint
  path = os.path.abspath(os.path.expanduser(given))
  name, parent = os.path.basename(path), os.path.dirname(path)
  if os.path.isdir(os.path.join(path, 'checkpoints')):
    workdir, which = path, str(config.init_from.step)
  elif name.isdigit() and os.path.basename(parent) == 'checkpoints' and os.path.isdir(path):
    workdir, which = os.path.dirname(parent), name
    if str(config.init_from.step) not in ('latest', name):
      raise CheckpointError(f'config.init_from.checkpoint={given!r} is step {name} but '
                            f'config.init_from.step={config.init_from.step!r}; give the workdir with a '
                            'step, or the step directory alone')
  else:
    raise CheckpointError(f'config.init_from.checkpoint={given!r} holds no flaxtpu checkpoint; point it at '
                          'the --workdir of a finished run (or its WORKDIR/checkpoints/STEP)')
  source = checkpoint.Checkpoints(workdir, config, read_only=True)
  try:
    if not source.all_steps():
      raise CheckpointError(f'config.init_from.checkpoint={given!r}: {source.directory} holds no complete '
                            'checkpoint; point it at a run that saved one')
    return source, source.resolve(which, key='init_from.step')
  except CheckpointError:
    source.close()
    raise


def head_names(task: steps.Task, abstract_params) -> list[str]:
  """The parameters whose shape depends on the class count: the classifier, in any model."""
  other = dataclasses.replace(task, model=task.model.clone(num_classes=task.num_classes + 1))
  here = optim.named_leaves(abstract_params)
  there = optim.named_leaves(jax.eval_shape(functools.partial(steps.init_model, other), 0).params)
  return [name for name, leaf in here.items() if leaf.shape != there[name].shape]


def _matching(patterns: Sequence[str], names: Sequence[str]) -> set[str]:
  return {name for name in names if any(re.search(pattern, name) for pattern in patterns)}


def init_from(config: ml_collections.ConfigDict, task: steps.Task, placement: steps.Placement, state,
              class_names: Sequence[str]) -> tuple[Any, dict]:
  """`state` (fresh, from the seed) with the matching arrays of `init_from.checkpoint` read into it.

  Returns the new state and what the checkpoint record keeps about it. A
  shape mismatch outside the re-initialised arrays (another model) is a
  CheckpointError naming the arrays and the `init_from.skip` that would skip them.
  """
  source, step = resolve_source(config)
  path = os.path.join(source.directory, str(step))
  try:
    record = source.read_record(step)
    saved = source.array_shapes(step, COLLECTIONS)
    target = {collection: optim.named_leaves(getattr(placement.abstract_state, collection))
              for collection in COLLECTIONS}
    names = [name for collection in COLLECTIONS for name in target[collection]]
    skipped = _matching(config.init_from.skip, names)
    for pattern in config.init_from.skip:
      if not _matching([pattern], names):
        raise CheckpointError(f'config.init_from.skip pattern {pattern!r} matches no parameter of '
                              f'{config.model.name}; names look like {names[0]!r}')
    classes_differ = (record.get('num_classes') != task.num_classes
                      or record.get('class_names', list(class_names)) != list(class_names))
    head = set(head_names(task, placement.abstract_state.params)) if classes_differ else set()

    load: dict[str, dict[str, Any]] = {collection: {} for collection in COLLECTIONS}
    reasons: dict[str, list[str]] = {}  # why an array starts from the seed -> its names
    mismatched = []
    for collection in COLLECTIONS:
      for name, leaf in target[collection].items():
        if name in head:
          reasons.setdefault('classes differ', []).append(name)
        elif name in skipped:
          reasons.setdefault('init_from.skip', []).append(name)
        elif name not in saved[collection]:
          reasons.setdefault('not in the checkpoint', []).append(name)
        elif saved[collection][name] != tuple(leaf.shape):
          mismatched.append(f'{name} {saved[collection][name]} there, {tuple(leaf.shape)} here')
        else:
          load[collection][name] = leaf
    if mismatched:
      modules = sorted({entry.partition('/')[0] for entry in mismatched})
      suggestion = '("' + '", "'.join(f'^{module}/' for module in modules) + '",)'
      raise CheckpointError(
          f'config.init_from.checkpoint {path} ({record.get("model")}) does not fit {config.model.name}: '
          f'{len(mismatched)} arrays differ in shape ({"; ".join(mismatched[:3])}); start from a checkpoint '
          f"of this model or re-initialise them with --config.init_from.skip='{suggestion}'")
    if not load['params']:
      raise CheckpointError(f'config.init_from.checkpoint {path} ({record.get("model")}) shares no parameter '
                            f'with {config.model.name}; start from a checkpoint of this model')
    abstract = {collection: traverse_util.unflatten_dict(arrays, sep='/')
                for collection, arrays in load.items() if arrays}
    restored = source.restore_subset(step, abstract)
  finally:
    source.close()

  loaded = {f'{collection}/{name}': leaf for collection in restored
            for name, leaf in optim.named_leaves(restored[collection]).items()}
  fresh = placement.to_saveable(state)
  merged = {collection: jax.tree_util.tree_map_with_path(
      lambda keys, leaf, c=collection: loaded.get(f'{c}/{optim.path_name(keys)}', leaf),
      getattr(fresh, collection)) for collection in COLLECTIONS}
  if fresh.ema:  # the average starts at the loaded weights (copies: the train step donates both)
    merged['ema'] = jax.tree.map(jnp.copy, {'params': merged['params'], 'batch_stats': merged['batch_stats']})
  state = placement.from_saveable(fresh.replace(**merged))

  counts = {collection: f'{len(load[collection])} of {len(target[collection])}' for collection in COLLECTIONS}
  logging.info('init_from: loaded %s parameter arrays and %s BatchNorm statistics from %s (%s, %d classes)',
               counts['params'], counts['batch_stats'], path, record.get('model'), record.get('num_classes'))
  for reason, reinitialised in reasons.items():
    logging.info('init_from: not loaded, kept as initialised (from the seed or fitted to the data) (%s): %s',
                 reason, ', '.join(reinitialised))
  return state, {'checkpoint': path, 'step': step, 'model': record.get('model'),
                 'class_names': record.get('class_names'),
                 'loaded': sum(len(arrays) for arrays in load.values()),
                 'reinitialised': {reason: names for reason, names in reasons.items()}}
