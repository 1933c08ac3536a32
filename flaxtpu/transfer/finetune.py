"""Fine-tuning: a fresh run starts from the parameters and BatchNorm statistics of another run,
or of a published model (timm, torchvision, the Hugging Face hub, big_vision: flaxtpu/weights/pretrained.py).

`init_from.checkpoint` names a workdir (its `init_from.step`: latest | best |
STEP) or one checkpoint directory, WORKDIR/checkpoints/STEP, of any flaxtpu
run (any device count, jit or pmap, fsdp). Every array of this model whose
'/'-joined path and shape match is read from it, onto this run's shardings;
the classifier is re-initialised when the classes differ, and so is whatever
`init_from.skip` matches. The optimizer state and the step start fresh. Only a
fresh run reads it: a run that has checkpoints of its own resumes from them.

Published weights are mapped onto the model by the tables of its family's
plug-in (flaxtpu/models/<family>.py); a ViT at another image size gets its position
embeddings resampled (bicubic, antialiased, as timm does). The source's
normalisation, image size and crop fraction become the run's defaults
before the config is validated (flaxtpu/validation/resolution.py), so the run, its
eval, predict and export prepare images as the weights expect.
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
import numpy as np
from flax import traverse_util

from flaxtpu import models
from flaxtpu.models import layouts
from flaxtpu.optimizers import optim
from flaxtpu.settings.errors import UserError
from flaxtpu.step import parallel, placing, steps
from flaxtpu.validation import resolution
from flaxtpu.weights import checkpoint, pretrained
from flaxtpu.weights.checkpoint import CheckpointError

COLLECTIONS = ('params', 'batch_stats')  # what is read; never the optimizer state, step or data key


def resolve_source(config: ml_collections.ConfigDict) -> tuple[checkpoint.Checkpoints, int]:
  """The checkpoints of the run `init_from.checkpoint` names, and the step to read."""
  workdir, which = resolution.source_location(config)
  source = checkpoint.Checkpoints(workdir, config, read_only=True)
  try:
    if not source.all_steps():
      raise resolution.no_checkpoint(config, source.directory)
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


def init_from(config: ml_collections.ConfigDict, task: steps.Task, placement: placing.Placement, state,
              class_names: Sequence[str]) -> tuple[Any, dict]:
  """`state` (fresh, from the seed) with the matching arrays of `init_from.checkpoint` read into it.

  Returns the new state and what the checkpoint record keeps about it. A
  shape mismatch outside the re-initialised arrays (another model) is a
  CheckpointError naming the arrays and the `init_from.skip` that would skip them.
  """
  if pretrained.is_published(config.init_from.checkpoint):
    return _init_from_published(config, task, placement, state, class_names)
  source, step = resolve_source(config)
  path = os.path.join(source.directory, str(step))
  try:
    record = source.read_record(step)
    if left_open := resolution.source_dataset_defaults(
        config.dataset, record.get('config', {}).get('dataset', {}), record['normalization']['mean'],
        record['normalization']['std']):
      raise UserError(f'config.dataset.{"/".join(left_open)} left open for init_from {path}; resolve the '
                      "config before training: flaxtpu.validation.resolution.resolve(config, workdir, "
                      "'train') (as the "
                      'CLI does)')
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
    source_task = record.get('task', checkpoint.RECORD_DEFAULTS['task'])
    check_keep_head_task(config, source_task, path)
    # A softmax head's logits mean nothing as sigmoids (they are only defined up to a shift): a new one.
    task_differs = source_task != config.task
    head = set(head_names(task, placement.abstract_state.params)) if classes_differ or task_differs else set()
    head_reason = 'classes differ' if classes_differ else f'the task differs ({source_task} there)'

    load: dict[str, dict[str, Any]] = {collection: {} for collection in COLLECTIONS}
    reasons: dict[str, list[str]] = {}  # why an array starts from the seed -> its names
    mismatched = []
    for collection in COLLECTIONS:
      for name, leaf in target[collection].items():
        if name in head:
          reasons.setdefault(head_reason, []).append(name)
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
    restored, _ = source.restore(step, abstract, subset=True)
  finally:
    source.close()

  loaded = {f'{collection}/{name}': leaf for collection in restored
            for name, leaf in optim.named_leaves(restored[collection]).items()}
  _check_finite(loaded, path)
  state = placement.from_saveable(_merge(placement.to_saveable(state), loaded))

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


def _check_finite(arrays: dict[str, Any], path: str) -> None:
  """A source run's array holding NaN/Inf (it diverged, or the file was damaged) is one line naming it,
  as a published file's tensor is (models/layouts.load)."""
  for name, leaf in arrays.items():
    if jnp.issubdtype(leaf.dtype, jnp.floating) and (bad := int(leaf.size - jnp.isfinite(leaf).sum())):
      raise CheckpointError(f'config.init_from.checkpoint {path}: array {name!r} holds {bad} NaN/Inf '
                            f'value{"s" * (bad > 1)} (of {leaf.size}); that run had diverged or the file is '
                            'damaged: start from an earlier step (--config.init_from.step=N) or another run')


def check_keep_head_task(config: ml_collections.ConfigDict, source_task: str, source: str) -> None:
  """init_from.keep_head keeps the source's classifier: only for a run of the source's task."""
  if config.init_from.keep_head and source_task != config.task:
    raise UserError(f'config.init_from.keep_head=True keeps the {source_task} head of {source}, but '
                    f'config.task={config.task!r}; drop keep_head to train a new head for the task')


def _shapes(saveable) -> dict[str, tuple[int, ...]]:
  """{'params/NAME' or 'batch_stats/NAME': shape} of a (saveable or abstract) state."""
  return {f'{collection}/{name}': tuple(leaf.shape) for collection in COLLECTIONS
          for name, leaf in optim.named_leaves(getattr(saveable, collection)).items()}


def _merge(fresh, loaded: dict[str, Any]):
  """The saveable (or abstract) state `fresh` with the arrays of `loaded` ({'params/NAME' or
  'batch_stats/NAME': array}) in their places; numpy arrays are laid out on the leaves' shardings (every
  process holds the whole array)."""

  def pick(collection, keys, leaf):
    array = loaded.get(f'{collection}/{optim.path_name(keys)}')
    if array is None:
      return leaf
    if isinstance(array, np.ndarray):
      array = array.astype(leaf.dtype)
      return jax.make_array_from_callback(array.shape, leaf.sharding, lambda index: array[index])
    return array

  merged = {collection: jax.tree_util.tree_map_with_path(functools.partial(pick, collection),
                                                         getattr(fresh, collection))
            for collection in COLLECTIONS}
  if getattr(fresh, 'ema', None):  # the average starts at the loaded weights (copies: the step donates both)
    merged['ema'] = jax.tree.map(jnp.copy, {'params': merged['params'], 'batch_stats': merged['batch_stats']})
  return fresh.replace(**merged)


def resample_position_embeddings(embeddings: np.ndarray, shape: tuple[int, ...],
                                 prefix_tokens: int) -> np.ndarray:
  """ViT position embeddings [1, prefix + rows * cols, width] for another grid: the grid part
  resampled bicubically with antialiasing (timm's resample_abs_pos_embed), the prefix tokens' (class,
  distillation) kept."""
  prefix, grid = embeddings[:, :prefix_tokens], embeddings[:, prefix_tokens:]
  old, new = round((grid.shape[1]) ** 0.5), round((shape[1] - prefix_tokens) ** 0.5)
  if old * old != grid.shape[1] or new * new != shape[1] - prefix_tokens:
    raise UserError(f'position embeddings of {grid.shape[1]} tokens cannot be resampled to '
                    f'{shape[1] - prefix_tokens}: both must be square grids (use square images)')
  width = grid.shape[-1]
  resized = jax.image.resize(jnp.asarray(grid.reshape(1, old, old, width), jnp.float32), (1, new, new, width),
                             'bicubic', antialias=True)
  logging.info('init_from: position embeddings resampled from %dx%d to %dx%d patches', old, old, new, new)
  return np.concatenate([prefix, np.asarray(resized).reshape(1, new * new, width)], axis=1)


def to_one_channel(kernel: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """An RGB model's first kernel [h, w, 3, out] for grayscale images [h, w, 1, out]: the sum over colours,
  which sees a gray pixel (R = G = B) as the RGB model does (timm's adapt_input_conv)."""
  if kernel.shape[2] != 3 or shape != (*kernel.shape[:2], 1, kernel.shape[3]):
    return kernel  # another mismatch: layouts.load names it
  logging.info('init_from: the RGB first layer summed over its colours for 1-channel images')
  return kernel.sum(axis=2, keepdims=True)


def _published_arrays(config: ml_collections.ConfigDict, published: pretrained.Published,
                      wanted: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
  """The published arrays that `wanted` ({'params/NAME': shape}) names, converted to flaxtpu's layout."""
  first_kernel = models.get_family(published.model).input_kernel
  # Only ViTs have position embeddings; their spec counts the tokens before the patches that have one.
  adapt = {'params/pos_embedding': lambda array, shape: resample_position_embeddings(
               array, shape, models.get_spec(config.model.name).prefix_tokens(config.model.pool)),
           **({first_kernel: to_one_channel} if first_kernel else {})}
  if published.model != config.model.name:  # read in part it would compute neither model's function
    raise UserError(f'config.init_from.checkpoint={published.spec!r} holds {published.model} but '
                    f'config.model.name={config.model.name!r}; drop model.name (the weights\' model is used) '
                    f'or give {config.model.name} weights')
  return layouts.load(published.rules(), pretrained.read_tensors(published.path), wanted,
                      f'config.init_from.checkpoint={published.spec!r}', adapt)


def _init_from_published(config: ml_collections.ConfigDict, task: steps.Task, placement: placing.Placement,
                         state, class_names: Sequence[str]) -> tuple[Any, dict]:
  """init_from for published weights: every array the layout maps, the head unless kept."""
  published = pretrained.describe(config.init_from.checkpoint)
  if config.init_from.keep_head and not published.num_classes:  # headless: the new head is all it lacks
    raise UserError(f'config.init_from.keep_head=True keeps the head of {published.spec}, but it has '
                    f'none (no tensor {published.head!r}: a headless checkpoint, as timm saves with '
                    'num_classes=0); drop keep_head to train a new head for the data\'s classes')
  abstract = placement.abstract_state
  target = _shapes(abstract)
  bare = {name: name.split('/', 1)[1] for name in target}  # without the collection, as the patterns see them
  skip_matches = _matching(config.init_from.skip, list(bare.values()))
  skipped = {name for name in target if bare[name] in skip_matches}
  for pattern in config.init_from.skip:
    if not _matching([pattern], list(bare.values())):
      raise CheckpointError(f'config.init_from.skip pattern {pattern!r} matches no parameter of '
                            f'{config.model.name}; names look like {next(iter(bare.values()))!r}')
  head = {f'params/{name}' for name in head_names(task, abstract.params)}
  source_names = list(pretrained.class_names(published))
  check_keep_head_task(config, 'multiclass', published.spec)  # published classifiers are softmax heads
  if config.init_from.keep_head:
    if task.num_classes != published.num_classes:
      raise UserError(f'config.init_from.keep_head=True keeps the {published.num_classes}-class head of '
                      f'{published.spec}, but the data has {task.num_classes} classes; drop keep_head to '
                      'train a new head for them')
    if list(class_names) != source_names and published.class_names:
      raise UserError(f'config.init_from.keep_head=True: the data\'s classes '
                      f'({", ".join(class_names[:3])}, ...) are not the head\'s '
                      f'({", ".join(source_names[:3])}, ...) in order; drop keep_head')
    head = set()
  wanted = {name: shape for name, shape in target.items() if name not in head and name not in skipped}
  loaded = _published_arrays(config, published, wanted)
  reasons = {reason: sorted(bare[name] for name in names) for reason, names in (
      ('a new head for the data\'s classes', head), ('init_from.skip', skipped),
      ('not in the published weights', set(wanted) - set(loaded))) if names}
  state = placement.from_saveable(_merge(placement.to_saveable(state), loaded))
  logging.info('init_from: loaded %d of %d arrays from %s (%s, %s layout, %d classes)',
               len(loaded), len(target), published.path, published.model, published.layout,
               published.num_classes)
  for reason, names in reasons.items():
    logging.info('init_from: not loaded, kept as initialised (%s): %s', reason, ', '.join(names))
  return state, {'checkpoint': published.spec, 'path': published.path, 'step': None, 'model': published.model,
                 'layout': published.layout, 'class_names': source_names, 'loaded': len(loaded),
                 'reinitialised': reasons}


def published_model(config: ml_collections.ConfigDict):
  """--mode=predict/eval/export straight from published weights, without training: (placement,
  model state, step 0, a checkpoint-like record). The published head and its classes are kept.

  `config` is resolved already (`pretrained.apply_defaults`: flaxtpu/validation/resolution.py)."""
  if not (config.init_from.checkpoint and pretrained.is_published(config.init_from.checkpoint)):
    raise UserError(f'config.init_from.checkpoint={config.init_from.checkpoint!r} is not published weights')
  published = pretrained.describe(config.init_from.checkpoint)
  if not published.num_classes:
    raise UserError(f'{published.spec} has no classifier (no tensor {published.head!r}: a headless '
                    'checkpoint, as timm saves with num_classes=0), so it cannot score images as it is; '
                    'fine-tune it on labelled images first (train with init_from: a new head is trained)')
  if config.task != 'multiclass':
    raise UserError(f'{published.spec} is a softmax classifier: predict with it as config.task=multiclass, '
                    'or fine-tune it on tagged images first (init_from) for task=multilabel')
  size = config.dataset.image_size or published.image_size
  image_shape = (size, size, len(published.mean))
  mean, std = ((config.dataset.mean, config.dataset.std) if config.dataset.normalize == 'fixed'
               else ((0.,) * 3, (1.,) * 3))
  task = steps.create_task(config, num_classes=published.num_classes, image_shape=image_shape,
                           mean=mean, std=std)
  placement = placing.place(task, parallel.make_mesh(config), config)
  wanted = _shapes(placement.abstract_state)
  loaded = _published_arrays(config, published, wanted)
  if missing := sorted(set(wanted) - set(loaded)):
    raise UserError(f'{published.spec} lacks {len(missing)} arrays of {config.model.name} '
                    f'({missing[0]}, ...); train from it instead of predicting with it')
  # Every array comes from the file: laid straight onto the abstract state's shardings, no initialisation.
  state = placement.from_saveable(_merge(placement.abstract_state, loaded))
  record = {'model': config.model.name, 'num_classes': published.num_classes,
            'image_shape': list(image_shape),
            'task': 'multiclass',
            'class_names': list(pretrained.class_names(published)),
            'normalization': {'mean': list(mean), 'std': list(std)}, 'config': config.to_dict(),
            'init_from': {'checkpoint': published.spec, 'path': published.path}}
  logging.info('using the published weights of %s (%s, %d classes) without training', published.spec,
               published.model, published.num_classes)
  return placement, state, 0, record
