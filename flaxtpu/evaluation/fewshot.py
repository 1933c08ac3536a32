"""Few-shot linear probes: how well a frozen backbone's features separate classes from K images each.

big_vision's `fewshot_lsr` evaluator, on flaxtpu's data: for each dataset
(the run's own, and any in `eval.fewshot.datasets`), `seeds` times, K train
images per class are drawn (the K-shot sets nested, 1-shot inside 5-shot, as
big_vision draws them), their features are the classifier's input (the
representation the head reads, in any model family), and a ridge regression
onto +-1 one-hot targets is solved in closed form on standardised features
(an unregularised intercept, penalty `l2_reg`). Its accuracy on every example
of the eval split, averaged over the seeds, is `eval_fewshot_{K}shot`
(`eval_fewshot_{NAME}_{K}shot` for another dataset). The probe's images are
read once per run; the features are computed again at every evaluation.
"""

import dataclasses
import functools
import logging
import os
import re
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from flaxtpu.augmentation import augment
from flaxtpu.data import loaders, pipeline
from flaxtpu.data.spec import DatasetSpec
from flaxtpu.settings.errors import UserError
from flaxtpu.step import parallel, placing, steps
from flaxtpu.transfer import finetune


@dataclasses.dataclass
class ProbeSet:
  """One dataset's probe: the train images drawn per seed, and the split scored."""
  name: str  # '' for the run's own data
  support_images: list[np.ndarray]  # per seed: uint8 [classes x max_shots, H, W, C], class-major
  support_labels: list[np.ndarray]  # per seed: int32 [classes x max_shots]
  max_shots: list[int]  # per seed: images per class drawn (fewer where a class has fewer)
  scored: pipeline.Dataset  # its eval split is what the probe is scored on
  num_classes: int


def metric_name(name: str, shots: int) -> str:
  return f'eval_fewshot_{name}_{shots}shot' if name else f'eval_fewshot_{shots}shot'


def ridge_accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                   num_classes: int, l2_reg: float) -> float:
  """Accuracy on (test_x, test_y) of a ridge regression of +-1 one-hot targets on train_x.

  Features are standardised with the train set's mean and deviation; the intercept is not
  penalised (with centred features it is the targets' mean). The normal equations are solved in
  the smaller of the feature and example dimensions, in float64.
  """
  train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
  mean, std = train_x.mean(0), train_x.std(0) + 1e-5
  x, x_test = (train_x - mean) / std, (test_x - mean) / std
  targets = 2.0 * np.eye(num_classes)[train_y] - 1.0
  intercept = targets.mean(0)
  centred = targets - intercept
  count, dim = x.shape
  if count >= dim:
    weights = np.linalg.solve(x.T @ x + l2_reg * np.eye(dim), x.T @ centred)
  else:
    weights = x.T @ np.linalg.solve(x @ x.T + l2_reg * np.eye(count), centred)
  predicted = np.argmax(x_test @ weights + intercept, axis=-1)
  return float(np.mean(predicted == test_y))


def head_path(task: steps.Task) -> tuple[str, ...]:
  """The module path of the classifier: the module whose parameters depend on the class count."""
  abstract = jax.eval_shape(functools.partial(steps.init_model, task), 0).params
  names = finetune.head_names(task, abstract)
  return tuple(names[0].split('/')[:-1])


def features(task: steps.Task, path: tuple[str, ...], variables, images: jax.Array) -> jax.Array:
  """float32 [batch, D]: what the classifier at `path` reads for uint8 `images` (eval mode)."""
  captured = []

  def capture_head_input(next_fun, args, kwargs, context):
    if context.method_name == '__call__' and context.module.path == path:
      captured.append(args[0])
    return next_fun(*args, **kwargs)

  pixels = augment.normalize(images, task.mean, task.std)
  with nn.intercept_methods(capture_head_input):
    task.model.apply({'params': variables.params, 'batch_stats': variables.batch_stats}, pixels,
                     train=False)
  return captured[0].reshape(len(images), -1).astype(jnp.float32)


class Probe:
  """The few-shot probes of `eval.fewshot`: built once per run, `__call__`ed at every evaluation."""

  def __init__(self, config: ml_collections.ConfigDict, dataset: pipeline.Dataset, task: steps.Task,
               placement: placing.Placement):
    settings = config.eval.fewshot
    self.shots, self.l2_reg = sorted(set(settings.shots)), settings.l2_reg
    self.placement, self.batch_size = placement, config.eval_batch_size if config.eval_batch_size > 0 else (
        config.batch_size)
    path = head_path(task)
    replicated = parallel.replicated(placement.mesh)
    self._features = jax.jit(functools.partial(features, task, path), out_shardings=replicated)
    self.sets = [_probe_set('', dataset, dataset, settings, config.seed)]
    for entry in settings.datasets:
      name, other = _other_dataset(config, entry, dataset)
      self.sets.append(_probe_set(name, other, other, settings, config.seed))

  def __call__(self, state) -> dict[str, float]:
    """{eval_fewshot_..: accuracy} of `state`'s features (the mean over the seeds)."""
    variables = steps.ModelState(params=state.params, batch_stats=state.batch_stats)
    variables = self.placement.to_saveable(variables) if self.placement.parallelism == 'pmap' else variables
    results = {}
    for probe in self.sets:
      test_x, test_y = self._split_features(variables, probe.scored)
      for shots in self.shots:
        accuracies = []
        for images, labels, drawn in zip(probe.support_images, probe.support_labels, probe.max_shots):
          keep = np.arange(len(labels)) % drawn < shots  # the first `shots` of each class's draw
          train_x = self._batched_features(variables, images[keep])
          accuracies.append(ridge_accuracy(train_x, labels[keep], test_x, test_y, probe.num_classes,
                                           self.l2_reg))
        results[metric_name(probe.name, shots)] = float(np.mean(accuracies))
    return results

  def _batched_features(self, variables, images: np.ndarray) -> np.ndarray:
    """Features of host images, in batches padded to the eval batch size (one compiled shape)."""
    rows = []
    for start in range(0, len(images), self.batch_size):
      chunk = images[start:start + self.batch_size]
      padded = np.concatenate([chunk, np.repeat(chunk[:1], self.batch_size - len(chunk), axis=0)])
      rows.append(np.asarray(self._features(variables, padded))[:len(chunk)])
    return np.concatenate(rows)

  def _split_features(self, variables, dataset: pipeline.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of every eval example (every process computes all of them)."""
    xs, ys = [], []
    for batch in loaders.eval_batches(dataset, batch_size=self.batch_size):
      xs.append(np.asarray(self._features(variables, batch.images))[batch.mask])
      ys.append(batch.labels[batch.mask])
    return np.concatenate(xs), np.concatenate(ys)


def _probe_set(name: str, train: pipeline.Dataset, scored: pipeline.Dataset, settings, seed: int) -> ProbeSet:
  """The probe images of `train`'s train split: per seed, up to max(shots) of each class."""
  labels = train.train.listed_labels
  where = f'config.eval.fewshot.datasets entry {name!r}' if name else 'config.eval.fewshot'
  if labels is None:
    raise UserError(f'{where} draws images by class, which a streamed TFDS split does not list; set '
                    '--config.dataset.cache=memory (or use an image folder)')
  if labels.ndim != 1:
    raise UserError(f'{where} probes one class per image; its data has several labels per image')
  wanted = max(settings.shots)
  images, chosen_labels, drawn = [], [], []
  for seed_index in range(settings.seeds):
    rng = np.random.default_rng([seed, seed_index])
    per_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(train.num_classes)]
    count = min([wanted] + [len(indices) for indices in per_class if len(indices)])
    if count < wanted:
      logging.warning('%s: the smallest class has %d train images; probes use at most %d per class',
                      where, count, count)
    positions = np.concatenate([indices[:count] for indices in per_class if len(indices)])
    images.append(np.stack(loaders.split_images(train, train.train, positions)))
    chosen_labels.append(labels[positions].astype(np.int32))
    drawn.append(count)
  logging.info('few-shot probe%s: %s-shot, %d seeds, %d classes, scored on %d images', f' {name}' if name
               else '', '/'.join(map(str, settings.shots)), settings.seeds, train.num_classes,
               len(scored.eval))
  return ProbeSet(name=name, support_images=images, support_labels=chosen_labels, max_shots=drawn,
                  scored=scored, num_classes=train.num_classes)


def _other_dataset(config: ml_collections.ConfigDict, entry: str,
                   dataset: pipeline.Dataset) -> tuple[str, pipeline.Dataset]:
  """(metric name, Dataset) of an `eval.fewshot.datasets` entry: NAME[:TRAIN_SPLIT[:EVAL_SPLIT]],
  a folder or a TFDS name, read at the run's image size."""
  parts = [entry] if os.path.isdir(entry) else re.split(r':(?![^\[]*\])', entry)  # not inside [..]
  source, train_split, eval_split = (parts + ['train', 'test'][len(parts) - 1:])[:3]
  # The run's spec with its own source: every source key of the run's is cleared (`with_source`).
  key = 'folder' if os.path.isdir(source) else 'name'
  if key == 'name' and os.sep in source:  # a path, not a TFDS name
    raise UserError(f'config.eval.fewshot.datasets entry {entry!r}: {source} is not a folder; give an image '
                    'folder laid out as split/class/image, or a TFDS name')
  other = DatasetSpec.of(config).with_source(**{key: source}).replace(
      train_split=train_split, eval_split=eval_split, eval_splits=(), image_size=dataset.image_shape[0],
      class_weights='none', sampling='shuffle', eval_image_size=0)
  loaded = pipeline.load(other)
  if loaded.image_shape != dataset.image_shape:
    raise UserError(f'config.eval.fewshot.datasets entry {entry!r} gives {loaded.image_shape} images and the '
                    f'model reads {dataset.image_shape}; use a dataset of {dataset.image_shape[-1]}-channel '
                    'images')
  name = re.sub(r'[^\w]+', '_', os.path.basename(source.rstrip('/')) or source).strip('_')
  return name, loaded


def maybe_probe(config: ml_collections.ConfigDict, dataset: pipeline.Dataset, task: steps.Task,
                placement: placing.Placement) -> Optional[Probe]:
  return Probe(config, dataset, task, placement) if config.eval.fewshot.shots else None
