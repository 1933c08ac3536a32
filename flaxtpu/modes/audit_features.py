"""The audit's `features` method (`--mode=audit` over `audit.fold_limit` images, docs/audit_explain.md):
the frozen embeddings (what the classifier reads) of every image, from `init_from.checkpoint`'s backbone or
else the trained run in the workdir, and a softmax linear probe per fold on them, each scoring its
held-out fold. `audit_folds.out_of_fold` calls it and keeps its probabilities as the fold runs'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from flaxtpu.data import loaders, pipeline
from flaxtpu.data.spec import DatasetSpec
from flaxtpu.io import files
from flaxtpu.modes.audit_pool import Pool, pool_dataset, softmax
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size

# The linear probe of `features`: a softmax regression on standardised embeddings, Adam on batches of
# PROBE_BATCH for PROBE_EPOCHS (at least PROBE_MIN_STEPS steps), L2 penalty PROBE_L2 on the weights.
PROBE_BATCH, PROBE_EPOCHS, PROBE_MIN_STEPS, PROBE_LEARNING_RATE, PROBE_L2 = 256, 30, 300, 3e-3, 1e-4


@dataclasses.dataclass
class Backbone:
  """Where `features` reads embeddings: init_from's weights, or the run trained in the workdir."""
  name: str  # for audit.json's `why`
  identity: dict  # what the key holds of it
  load: object  # (classes, image shape, mean, std) -> (task, placement, model variables)


def backbone_of(config: ml_collections.ConfigDict, workdir: str) -> Optional[Backbone]:
  """init_from.checkpoint's backbone, else the trained run in `workdir`, else None."""
  if config.init_from.checkpoint:
    spec = config.init_from.checkpoint
    return Backbone(f'config.init_from.checkpoint={spec}', {'init_from': spec, 'model': config.model.name,
                                                             'image_size': config.dataset.image_size},
                    functools.partial(_init_from_backbone, config))
  if files.isdir(os.path.join(workdir, 'checkpoints')):
    from flaxtpu.weights import checkpoint  # pylint: disable=g-import-not-at-top
    checkpoints = checkpoint.Checkpoints(workdir, config, read_only=True)
    latest = checkpoints.latest_step()
    checkpoints.close()
    if latest is not None:
      return Backbone(f'the trained run in {workdir} (checkpoint step {latest}; it has seen these labels)',
                      {'workdir': os.path.abspath(workdir), 'step': latest,
                       'checkpoint': config.eval.checkpoint},
                      functools.partial(_trained_backbone, config, workdir))
  return None


def _trained_backbone(config: ml_collections.ConfigDict, workdir: str, num_classes: int, shape, mean, std):
  """The run in `workdir` (eval.checkpoint's step), as it was trained (its classes, size, normalisation)."""
  del num_classes, shape, mean, std  # the checkpoint's own
  from flaxtpu.modes.restore import restore  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import steps  # pylint: disable=g-import-not-at-top
  placement, state, _, record = restore(config, workdir, calibrated=False)
  task = steps.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']), mean=record['normalization']['mean'],
                           std=record['normalization']['std'])
  return task, placement, state


def _init_from_backbone(config: ml_collections.ConfigDict, num_classes: int, shape, mean, std):
  """A fresh model with init_from's arrays read in, as a run starts (its head, never used, as it comes)."""
  from flaxtpu.settings import lengths  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import parallel, placing, steps  # pylint: disable=g-import-not-at-top
  from flaxtpu.transfer import finetune  # pylint: disable=g-import-not-at-top
  length = lengths.RunLength(steps_per_epoch=1, total_steps=1, eval_every_steps=1,
                             checkpoint_every_steps=1, warmup_steps=0)
  task = steps.create_task(config, num_classes=num_classes, image_shape=shape, mean=mean, std=std,
                           length=length)
  placement = placing.place(task, parallel.make_mesh(config), config)
  state = placing.create_state(task, placement, config.seed)
  state, _ = finetune.init_from(config, task, placement, state, [str(i) for i in range(num_classes)])
  return task, placement, steps.ModelState(params=state.params, batch_stats=state.batch_stats)


def embeddings(config: ml_collections.ConfigDict, pool: Pool, scored: np.ndarray, class_names, channels: int,
               backbone: Backbone) -> np.ndarray:
  """float32 [S, D]: what the backbone's classifier reads for each scored image (eval preprocessing)."""
  from flaxtpu.evaluation import fewshot  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import parallel, steps  # pylint: disable=g-import-not-at-top
  template, _ = pool_dataset(config, [pool.paths[i] for i in scored], pool.labels[scored], class_names,
                              channels)
  dataset = pipeline._normalized(template, DatasetSpec.of(config))  # pylint: disable=protected-access
  task, placement, variables = backbone.load(len(class_names), dataset.image_shape, dataset.mean, dataset.std)
  if tuple(task.image_shape) != tuple(dataset.image_shape):
    raise UserError(f'the backbone reads {tuple(task.image_shape)} images and the audited data gives '
                    f'{tuple(dataset.image_shape)}; set --config.dataset.image_size={task.image_shape[0]}')
  variables = steps.ModelState(params=variables.params, batch_stats=variables.batch_stats)
  if placement.parallelism == 'pmap':
    variables = placement.to_saveable(variables)
  features = jax.jit(functools.partial(fewshot.features, task, fewshot.head_path(task)),
                     out_shardings=parallel.replicated(placement.mesh))
  rows = []
  for batch in loaders.eval_batches(dataset, batch_size=resolved_eval_batch_size(config)):
    rows.append(np.asarray(features(variables, batch.images))[batch.mask])
  return np.concatenate(rows)


def probe_folds(config: ml_collections.ConfigDict, pool: Pool, scored: np.ndarray, folds: np.ndarray,
                 class_names, channels: int, backbone: Backbone) -> tuple[np.ndarray, dict]:
  """A softmax linear probe per fold on the frozen embeddings, each scoring its held-out fold."""
  started = time.time()
  x = embeddings(config, pool, scored, class_names, channels, backbone)
  logging.info('audit: %d embeddings of %d dimensions from %s (%.1f s)', len(x), x.shape[1], backbone.name,
               time.time() - started)
  labels = pool.labels[scored]
  probabilities = np.zeros((len(scored), len(class_names)), np.float32)
  accuracies = []
  for k in range(int(folds.max()) + 1):
    held_out, kept = folds == k, folds != k
    probabilities[held_out] = linear_probe(x[kept], labels[kept], x[held_out], len(class_names),
                                           config.seed + k)
    accuracies.append(float(np.mean(probabilities[held_out].argmax(axis=1) == labels[held_out])))
  logging.info('audit: linear probes, held-out accuracy %.4f', float(np.mean(accuracies)))
  return probabilities, {'embedding_dimensions': int(x.shape[1]),
                         'held_out_accuracy': round(float(np.mean(accuracies)), 4)}


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, num_classes: int,
                 seed: int) -> np.ndarray:
  """Softmax probabilities [len(test_x), classes] of a linear classifier fitted to (train_x, train_y):
  standardised features, cross-entropy plus PROBE_L2 x |W|^2, Adam with a cosine decay on batches."""
  mean, std = train_x.mean(axis=0), train_x.std(axis=0) + 1e-5
  train_x = ((train_x - mean) / std).astype(np.float32)
  test_x = ((test_x - mean) / std).astype(np.float32)
  batch = min(PROBE_BATCH, len(train_x))
  total = max(PROBE_MIN_STEPS, PROBE_EPOCHS * len(train_x) // batch)
  optimizer = optax.adam(optax.cosine_decay_schedule(PROBE_LEARNING_RATE, total))
  params = {'w': jnp.zeros((train_x.shape[1], num_classes)), 'b': jnp.zeros(num_classes)}
  opt_state = optimizer.init(params)

  def loss(params, x, y):
    logits = x @ params['w'] + params['b']
    penalty = PROBE_L2 * jnp.sum(params['w'] ** 2)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + penalty

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  rng = np.random.default_rng(seed)
  order = np.zeros(0, np.int64)
  for _ in range(total):
    if len(order) < batch:
      order = np.concatenate([order, rng.permutation(len(train_x))])
    chosen, order = order[:batch], order[batch:]
    params, opt_state = step(params, opt_state, train_x[chosen], train_y[chosen].astype(np.int32))
  weights, bias = np.asarray(params['w']), np.asarray(params['b'])
  logits = test_x @ weights + bias
  return softmax(logits)
