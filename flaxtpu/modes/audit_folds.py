"""Out-of-fold probabilities for the audit's mislabel search (`--mode=audit`, docs/audit_explain.md).

A model scores its own training images with the labels it memorised, wrong ones included; confident
learning needs each image scored by a model that never saw it. The audited images are split into K
folds (`audit.assign_folds`: stratified by label, exact and near copies in one fold) and each fold is
scored by a model of the other K - 1:

- `folds`: K runs of the run's own recipe, each at least as long as the run (`fold_steps`:
  `audit.steps_fraction`, default 1, of the longer of the run's own steps and its epochs over the K - 1
  folds; its epoch-denominated schedule points scaled alike), each trained by `train.train_and_evaluate`
  on K - 1 folds with the held-out fold as its eval split, then restored to score that fold;
- `sample`: the same, on a stratified sample of `audit.fold_limit` images (a larger audit), which
  alone is scored;
- `features` (`audit_features`): the frozen embeddings (what the classifier reads) of every image, from
  `init_from.checkpoint`'s backbone or else the trained run in the workdir, and a softmax linear probe
  per fold on them.

Where the workdir holds a trained run (its config.json, else its checkpoint record's config), the fold
runs train that run's recipe (`trained_run`), not a config file given without the run's overrides.

Everything is kept in WORKDIR/audit_folds/KEY/: the fold runs (KEY/fold_K, each a workdir that resumes)
and the probabilities (KEY/probabilities.npz). KEY hashes what the probabilities depend on: the images'
contents (SHA-256) and labels, the folds, the method and the training recipe. A second audit of the
same data and recipe reads them back and trains nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import time
from typing import Optional

import jax
import ml_collections
import numpy as np

from flaxtpu.data import audit, class_weights, pipeline
from flaxtpu.data.dataset import Dataset, Examples
from flaxtpu.data.sources import base
from flaxtpu.data.spec import DatasetSpec
from flaxtpu.io import files
from flaxtpu.modes.audit_pool import Pool, pool_dataset, softmax
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size, run_length

FOLDS_DIR = 'audit_folds'  # in the workdir
PROBABILITIES = 'probabilities.npz'
KEY_VERSION = 'audit-folds-1'  # changing what the probabilities mean changes every key
# Keys of a config that change nothing a fold model learns: left out of the recipe's part of the key.
UNTRAINED_KEYS = ('audit', 'predict', 'export', 'calibrate', 'lr_find', 'wandb', 'mlflow', 'search', 'input',
                  'log_every_steps', 'log_every_secs', 'profile_steps', 'compilation_cache_dir',
                  'tpu_premapped_buffer_mib', 'eval_every_steps', 'checkpoint_every_steps', 'checkpoint',
                  'early_stopping', 'require_platform', 'time_budget')
# The data is keyed by content: where it lies (and how it was split) does not matter.
SOURCE_KEYS = ('name', 'folder', 'data_dir', 'labels', 'shards', 'parquet', 'train_split', 'eval_split',
               'eval_splits', 'decoded_cache_dir', 'skip_corrupt', 'unknown_classes', 'cache')



@dataclasses.dataclass
class OutOfFold:
  """Each scored image's probabilities from the model that did not see it."""
  scored: np.ndarray  # int [S]: positions in the pool
  probabilities: np.ndarray  # float32 [S, classes]
  about: dict  # for audit.json's mislabel_search
  folds: np.ndarray  # int [S]: the fold of each scored image (whose model scored it)


@dataclasses.dataclass(frozen=True)
class Run:
  """The run trained in the workdir: its recipe and how long it trained, and how well it did."""
  source: str  # where its recipe was read ('WORKDIR/config.json')
  config: ml_collections.ConfigDict  # its recipe, under the given config's audit, logging and data location
  differences: list  # ['key: given -> run', ...]: what of the given recipe the run's replaced
  train_examples: Optional[int]  # the images it trained on (its checkpoint record)
  steps: Optional[int]  # the steps it trained (results.json, else its latest checkpoint)
  eval_accuracy: Optional[float]  # its eval_accuracy (results.json, else its checkpoint's progress)


def trained_run(config: ml_collections.ConfigDict, workdir: str) -> Optional[Run]:
  """The run trained in `workdir` (config.json, else the latest checkpoint record's config), or None.

  Its recipe is what the fold runs train, as --mode=eval restores a run with the config it trained
  with: every key of its saved config except those that change nothing learnt (`UNTRAINED_KEYS`: the
  audit's own settings among them) and the data's location (`SOURCE_KEYS`), which stay the given
  config's."""
  from flaxtpu.validation import workdir_config  # pylint: disable=g-import-not-at-top
  if not workdir:
    return None
  path = os.path.join(workdir, workdir_config.CONFIG_FILE)
  saved, source = files.read_json(path), path
  record, latest = {}, None
  if files.isdir(os.path.join(workdir, 'checkpoints')):
    from flaxtpu.weights import checkpoint  # pylint: disable=g-import-not-at-top
    try:
      checkpoints = checkpoint.Checkpoints(workdir, config, read_only=True)
      try:
        latest = checkpoints.latest_step()
        record = checkpoints.read_record(latest) if latest is not None else {}
      finally:
        checkpoints.close()
    except checkpoint.CheckpointError as e:
      logging.warning('audit: the checkpoints in %s cannot be read (%s)', workdir, files.short_error(e))
  if not isinstance(saved, dict) and isinstance(record.get('config'), dict):
    saved, source = record['config'], f'the checkpoint record of step {latest} in {workdir}'
  if not isinstance(saved, dict):
    return None
  run = workdir_config.from_saved(saved)
  given = config.copy_and_resolve_references()
  with run.unlocked():
    for key in UNTRAINED_KEYS:
      if key in given:
        run[key] = given[key]
    for key in SOURCE_KEYS:
      if key in given.dataset:
        run.dataset[key] = given.dataset[key]
  ours, theirs = _flat(_recipe(given)), _flat(_recipe(run))
  differences = [f'{key}: {ours.get(key)!r} -> {theirs.get(key)!r}' for key in sorted(set(ours) | set(theirs))
                 if ours.get(key) != theirs.get(key)]
  results = files.read_json(os.path.join(workdir, 'results.json'))
  results = results if isinstance(results, dict) else {}
  progress_eval = (record.get('progress') or {}).get('eval') or {}
  accuracy = results.get('eval_accuracy', progress_eval.get('eval_accuracy'))
  steps = results.get('step', latest)
  train_examples = record.get('num_train_examples')
  return Run(source=source, config=run, differences=differences,
             train_examples=int(train_examples) if train_examples else None,
             steps=int(steps) if isinstance(steps, (int, float)) else None,
             eval_accuracy=float(accuracy) if isinstance(accuracy, (int, float)) else None)


def _flat(tree: dict, prefix: str = '') -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = tuple(value) if isinstance(value, list) else value
  return flat


def out_of_fold(config: ml_collections.ConfigDict, workdir: str, pool: Pool, class_names, channels: int,
                method: str, backbone, run_steps: int = 0) -> OutOfFold:
  """The out-of-fold probabilities of `method` (`folds`, `sample` or `features`), computed or read back;
  a fold run trains at least `run_steps` steps x audit.steps_fraction (the run's own length)."""
  if jax.process_count() > 1:
    raise UserError('--mode=audit searches for wrong labels on one process; start it without '
                    '--num_processes (or set --config.audit.folds=0)')
  settings = config.audit
  scored = np.arange(len(pool.labels))
  if method == 'sample':  # every class in proportion, the same sample every time
    scored = np.sort(base.stratified_order(pool.labels)[:settings.fold_limit])
  labels = pool.labels[scored]
  folds = audit.assign_folds(labels, pool.groups[scored], settings.folds, config.seed)
  fold_config = None if method == 'features' else _fold_config(config, len(scored), folds, run_steps)
  recipe = backbone.identity if method == 'features' else _recipe(fold_config)
  key = _key(method, settings.folds, settings.steps_fraction if method != 'features' else None, recipe,
             [pool.sha[i] for i in scored], labels, folds)
  directory = os.path.join(workdir, FOLDS_DIR, key[:16])
  path = os.path.join(directory, PROBABILITIES)
  about = {'folds': int(settings.folds), 'scored': int(len(scored)), 'directory': directory}
  saved = _load(path, key)
  if saved is not None:
    logging.info('audit: out-of-fold probabilities of these %d images and this recipe read back from %s '
                 '(nothing trained)', len(scored), path)
    return OutOfFold(scored, saved['probabilities'], {**about, **json.loads(str(saved['about'])),
                                                      'reused': True}, folds)
  files.makedirs(directory)
  started = time.time()
  if method == 'features':
    from flaxtpu.modes import audit_features  # pylint: disable=g-import-not-at-top
    probabilities, details = audit_features.probe_folds(config, pool, scored, folds, class_names, channels,
                                                        backbone)
  else:
    probabilities, details = _train_folds(fold_config, directory, pool, scored, folds, class_names, channels)
  details['seconds'] = round(time.time() - started, 1)
  _save(path, key, probabilities, details, [pool.paths[i] for i in scored], labels, class_names)
  return OutOfFold(scored, probabilities, {**about, **details, 'reused': False}, folds)


# --- the fold runs ----------------------------------------------------------------------------


def fold_steps(config: ml_collections.ConfigDict, train_examples: int, run_steps: int = 0) -> int:
  """Steps of a fold run: `audit.steps_fraction` (default 1) of the longer of the run's own length
  `run_steps` and the recipe's run on the fold's `train_examples` images (num_train_steps, else
  num_epochs over them; a time budget counts as its epochs), and at least `audit.min_epochs` (default
  10) epochs over its `train_examples`. At the defaults a fold model trains at least as many steps as the
  run, at least its epochs over its K - 1 folds, and at least 10 epochs."""
  own = run_length(config, train_examples).total_steps
  floor = math.ceil(config.audit.min_epochs * train_examples / config.batch_size)
  return max(1, math.ceil(config.audit.steps_fraction * max(own, run_steps)), floor)


def _fold_config(config: ml_collections.ConfigDict, count: int, folds: np.ndarray,
                 run_steps: int = 0) -> ml_collections.ConfigDict:
  """The recipe as a fold run trains it: its length (`fold_steps`), evaluated and saved only at its end,
  untracked."""
  fold = config.copy_and_resolve_references()
  fold.time_budget = ''
  train_examples = count - int(np.bincount(folds).max())  # the smallest fold run: every run as long
  fold.num_train_steps = fold_steps(fold, train_examples, run_steps)
  # A schedule set in epochs keeps its shape over the fold run's steps: each point moves by the fold
  # run's length over the recipe's own on these images (audit.steps_fraction when num_train_steps is set).
  scale = fold.num_train_steps / run_length(config, train_examples).total_steps
  fold.schedule.warmup_epochs = config.schedule.warmup_epochs * scale
  fold.schedule.cooldown_epochs = config.schedule.cooldown_epochs * scale
  fold.schedule.milestones = tuple(m * scale for m in config.schedule.milestones)
  fold.eval_every_steps = fold.checkpoint_every_steps = 2**31 - 1  # at the end only (clamped to it)
  fold.checkpoint.keep = 1
  fold.checkpoint.best_metric = ''
  fold.early_stopping.metric = ''
  fold.eval.checkpoint = 'latest'
  fold.eval.fewshot.shots = ()
  fold.dataset.eval_splits = ()
  fold.profile_steps = 0
  fold.wandb.project = ''
  fold.mlflow.tracking_uri = ''
  fold.search.storage = ''
  return fold


def _recipe(fold_config: ml_collections.ConfigDict) -> dict:
  """What of a fold run's config decides what it learns."""
  recipe = {key: value for key, value in fold_config.to_dict().items() if key not in UNTRAINED_KEYS}
  recipe['dataset'] = {key: value for key, value in recipe['dataset'].items() if key not in SOURCE_KEYS}
  return recipe


def _train_folds(fold_config: ml_collections.ConfigDict, directory: str, pool: Pool, scored: np.ndarray,
                 folds: np.ndarray, class_names, channels: int) -> tuple[np.ndarray, dict]:
  """K fold runs (each resumes or finds itself finished where a previous audit stopped), each then
  scoring its held-out fold."""
  from flaxtpu.evaluation.evaluate import evaluate  # pylint: disable=g-import-not-at-top
  from flaxtpu.loop import train  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes.restore import restore  # pylint: disable=g-import-not-at-top
  template, examples = pool_dataset(fold_config, [pool.paths[i] for i in scored], pool.labels[scored],
                                     class_names, channels)
  count = int(folds.max()) + 1
  probabilities = np.zeros((len(scored), len(class_names)), np.float32)
  accuracies = []
  for k in range(count):
    held_out, kept = np.flatnonzero(folds == k), np.flatnonzero(folds != k)
    dataset = _fold_dataset(fold_config, template, examples, kept, held_out)
    workdir = os.path.join(directory, f'fold_{k}')
    started = time.time()
    results = train.train_and_evaluate(fold_config, workdir, dataset=dataset, pictures=False)
    if 'stopped_at_step' in results:
      raise UserError(f'--mode=audit stopped in fold run {k + 1} of {count} ({workdir}); run the same '
                      'command to resume it')
    placement, state, _, _ = restore(fold_config, workdir, calibrated=False)
    _, predictions = evaluate(placement, state, dataset, resolved_eval_batch_size(fold_config),
                              keep_logits=True)
    probabilities[held_out] = softmax(predictions.logits)
    accuracies.append(float(np.mean(predictions.logits.argmax(axis=1) == pool.labels[scored][held_out])))
    logging.info('audit: fold run %d/%d: %d steps on %d images, held-out accuracy %.4f on %d (%.1f s)', k + 1,
                 count, fold_config.num_train_steps, len(kept), accuracies[-1], len(held_out),
                 time.time() - started)
  return probabilities, {'steps': int(fold_config.num_train_steps),
                         'held_out_accuracy': round(float(np.mean(accuracies)), 4)}


def _subset(examples: Examples, positions: np.ndarray) -> Examples:
  if not examples.cached:
    return Examples(source=examples.source.subset(positions))
  images = (examples.images[positions] if isinstance(examples.images, np.ndarray)
            else [examples.images[i] for i in positions])
  return Examples(images=images, labels=examples.labels[positions])


def _fold_dataset(config: ml_collections.ConfigDict, template: Dataset, examples: Examples, kept: np.ndarray,
                  held_out: np.ndarray) -> Dataset:
  """A fold run's data: the kept folds to train on, the held-out fold as its eval split."""
  train_examples = _subset(examples, kept)
  dataset = dataclasses.replace(
      template, train=train_examples, eval=_subset(examples, held_out),
      class_weights=class_weights.class_weights(config.dataset.class_weights, train_examples,
                                                template.class_names))
  return pipeline._normalized(dataset, DatasetSpec.of(config))  # pylint: disable=protected-access


# --- the key and the saved probabilities -----------------------------------------------------


def _key(method: str, folds: int, fraction: Optional[float], recipe: dict, contents: list, labels: np.ndarray,
         fold_of: np.ndarray) -> str:
  digest = hashlib.sha256(json.dumps([KEY_VERSION, method, folds, fraction, recipe], sort_keys=True,
                                     default=str).encode())
  for content, label, fold in zip(contents, labels.tolist(), fold_of.tolist()):
    digest.update(content)
    digest.update(f'{label} {fold}\n'.encode())
  return digest.hexdigest()


def _load(path: str, key: str) -> Optional[dict]:
  if not files.exists(path):
    return None
  try:
    with np.load(io.BytesIO(files.open_bytes(path))) as saved:
      if str(saved['key']) != key:
        return None
      return {'probabilities': saved['probabilities'], 'about': saved['about']}
  except (OSError, ValueError, KeyError) as e:  # cut off by a crash: computed again
    logging.warning('audit: %s cannot be read (%s); computing it again', path, files.short_error(e))
    return None


def _save(path: str, key: str, probabilities: np.ndarray, about: dict, paths: list, labels: np.ndarray,
          class_names) -> None:
  """The probabilities [S, classes] with what they are of: each row's file and label (a class index into
  `class_names`), for a reader other than the audit (cleanlab, benchmarks/accuracy/audit_label_errors.py)."""
  def write(temporary: str) -> None:
    with open(temporary, 'wb') as f:
      np.savez(f, key=np.asarray(key), probabilities=probabilities, about=np.asarray(json.dumps(about)),
               paths=np.asarray(paths, str), labels=np.asarray(labels, np.int32),
               class_names=np.asarray(list(class_names), str))

  with files.writing(path, 'free disk space or choose a writable --workdir'):
    files.atomic_write(path, write)
