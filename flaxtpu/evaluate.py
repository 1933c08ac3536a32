"""Restore a checkpoint on whatever devices are here, then evaluate a split or predict on images."""

from __future__ import annotations

import logging
import os
import re
from typing import NamedTuple, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from flaxtpu import checkpoint, fewshot, files, finetune, parallel, pretrained, report, steps
from flaxtpu.config import eval_metric_prefix, resolved_eval_batch_size
from flaxtpu.data import loaders, pipeline, predict_inputs
from flaxtpu.errors import UserError, printable


class Predictions(NamedTuple):
  """The logits and labels (int [N], or multilabel multi-hot [N, classes]) of every eval example, in order."""
  logits: np.ndarray
  labels: np.ndarray


def evaluate(placement: steps.Placement, state, dataset: pipeline.Dataset, batch_size: int,
             keep_logits: bool = False, threshold: float = 0.0
             ) -> tuple[dict[str, float], Optional[Predictions]]:
  """The metrics of every example of the eval split, each counted exactly once.

  Multiclass: loss, accuracy, balanced accuracy (and top-5 accuracy), from the devices. Multilabel:
  the loss, and from every example's logits on the host (gathered from every process) mAP, micro
  mAP, micro-F1 at a threshold (`threshold`, or the best one on this split), the threshold, and
  the exact-match accuracy at it (`report.multilabel_report`).

  With `keep_logits`, on one process, the logits and labels of every example
  come back too (for `write_report`); otherwise None.
  """
  totals, one_step_in_flight = None, parallel.one_step_in_flight()
  keep_logits = keep_logits and jax.process_count() == 1  # another process' examples are not here
  logits, labels, multilabel = [], [], False
  for batch in loaders.eval_batches(dataset, batch_size=batch_size, process_index=jax.process_index(),
                                    process_count=jax.process_count()):
    batch_metrics, batch_logits = placement.eval_step(state, placement.put_eval_batch(tuple(batch)))
    if one_step_in_flight:
      jax.block_until_ready(batch_metrics)
    totals = batch_metrics if totals is None else totals.merge(batch_metrics)
    multilabel = batch.labels.ndim == 2
    if keep_logits or multilabel:
      rows_logits, rows_labels = _real_rows(batch_logits, batch)
      logits.append(rows_logits)
      labels.append(rows_labels)
  result = {f'eval_{k}': float(v) for k, v in totals.compute().items()}
  result['num_examples'] = int(totals.loss.count)
  predictions = Predictions(np.concatenate(logits), np.concatenate(labels)) if logits else None
  if multilabel:
    result.update(report.multilabel_metrics(report.multilabel_report(
        predictions.logits, predictions.labels, list(dataset.class_names), threshold)))
  return result, (predictions if keep_logits else None)


def _real_rows(batch_logits, batch: pipeline.Batch) -> tuple[np.ndarray, np.ndarray]:
  """The logits and labels of an eval batch's real (unpadded) rows as numpy arrays: this process's
  rows on one process; every process's, in global order, on many (multilabel metrics rank them all)."""
  if jax.process_count() == 1:  # (pmap hands logits back per device: flattened here, not on the devices)
    return np.asarray(batch_logits).reshape(len(batch.mask), -1)[batch.mask], batch.labels[batch.mask]
  if batch_logits.is_fully_addressable:  # pmap: this process's devices hold its rows
    batch_logits = np.asarray(batch_logits).reshape(len(batch.mask), -1)
  logits, labels, mask = (np.asarray(multihost_utils.process_allgather(x, tiled=True))
                          for x in (batch_logits, batch.labels, batch.mask))
  return logits[mask], labels[mask]


def evaluate_splits(placement: steps.Placement, state, eval_sets: list[tuple[str, pipeline.Dataset]],
                    batch_size: int, report_weights: Optional[str] = None, threshold: float = 0.0
                    ) -> tuple[dict[str, float], Optional[Predictions]]:
  """Every eval split, with the raw weights and (when the state has them) the EMA weights.

  The first split's metrics are `eval_loss`, `eval_accuracy`, ... (they pick
  the best checkpoint); another split's carry its name (`eval_train_5000_accuracy`);
  the EMA weights' end in `_ema`. `num_examples` counts the first split.
  With `report_weights` ('raw' or 'ema') the first split's predictions under
  those weights come back too (see `evaluate`). `threshold`: multilabel, as in `evaluate`.
  """
  views = [('raw', '', state)]
  if getattr(state, 'ema', None):
    views.append(('ema', '_ema', steps.ema_view(state)))
  results, predictions = {}, None
  for index, (split, dataset) in enumerate(eval_sets):
    prefix = eval_metric_prefix(split, first=index == 0)
    for weights, suffix, view in views:
      for_report = index == 0 and weights == report_weights
      scores, kept = evaluate(placement, view, dataset, batch_size, keep_logits=for_report,
                              threshold=threshold)
      if for_report:
        predictions = kept
      count = scores.pop('num_examples')
      if index == 0 and not suffix:
        results['num_examples'] = count
      results.update({prefix + name[len('eval_'):] + suffix: value for name, value in scores.items()})
  return results, predictions


def write_report(predictions: Optional[Predictions], dataset: pipeline.Dataset, directory: str,
                 suffix: str = '', threshold: float = 0.0, about: Optional[dict] = None) -> dict:
  """per_class.csv, confusion, mistakes and reliability PNGs of the eval split in `directory`;
  multilabel, also thresholds.json (`threshold` and `about` as in `report.write_eval_report`).

  `predictions` are what `evaluate` kept. Returns the summary numbers (ECE,
  top-5 accuracy) for eval.json. They are kept on one process only, so a run
  of many processes leaves the report to `--mode=eval` on one.
  """
  if jax.process_count() > 1:
    logging.info('per-class report skipped: it runs on one process (--mode=eval on one host writes it)')
    return {}
  logits, labels = predictions
  with files.writing(directory, 'free disk space or choose a writable --workdir'):
    summary = report.write_eval_report(directory, logits, labels, list(dataset.class_names),
                                       images=lambda index: loaders.eval_image(dataset, index), suffix=suffix,
                                       threshold=threshold, about=about)
  logging.info('eval report: ECE %.4f%s; %s in %s', summary['eval_ece'],
               f', top-5 accuracy {summary["eval_top5_accuracy"]:.4f}' if 'eval_top5_accuracy' in summary
               else '', ', '.join(summary['report_files']), directory)
  return summary


def report_about(config: ml_collections.ConfigDict, step: int, split: Optional[str] = None) -> dict:
  """What an evaluation report was made of: the step, the split, the weights and the TTA (kept in
  thresholds.json, whose thresholds predict matches to the checkpoint it restores)."""
  return {'step': step, 'split': split or config.dataset.eval_split,
          'weights': 'ema' if config.eval.ema else 'raw', 'tta': tta_name(config.eval)}


def eval_summary(results: dict) -> str:
  """The log line's metrics: loss and accuracy first, then every other scalar, e.g. 'loss 0.4 ...'."""
  names = ['eval_loss', 'eval_accuracy'] + [name for name, value in results.items()
                                            if name.startswith('eval_') and isinstance(value, float)
                                            and name not in ('eval_loss', 'eval_accuracy')]
  return '  '.join(f'{name.removeprefix("eval_")} {results[name]:.4f}' for name in names if name in results)


def tta_name(eval_config) -> str:
  """The test-time augmentation of an `eval` config (or its saved dict): 'flip+translate2', 'flip',
  'none'..."""
  parts = (['flip'] if eval_config.get('flip_tta') else []) + (
      [f'translate{eval_config["translate_tta"]}'] if eval_config.get('translate_tta') else [])
  return '+'.join(parts) or 'none'


def split_file_name(split: str) -> str:
  """A split as part of a file name: 'train_5000' for 'train[:5000]', 'train_45000-' for 'train[45000:]'."""
  name = re.sub(r'\[(-?\d*%?):(-?\d*%?)\]', lambda m: '_' + (f'{m[1]}-{m[2]}' if m[1] else m[2]), split)
  return re.sub(r'[^\w.-]+', '_', name.replace('%', 'pct')).strip('_')


def restore(config: ml_collections.ConfigDict, workdir: str):
  """The model of `config.eval.checkpoint` (latest | best | STEP), laid out for these devices.

  Returns (placement, model state, step, record). Only parameters and
  BatchNorm statistics are read: no optimizer is built. The model is checked
  against the checkpoint's own record (model, classes, image shape);
  normalisation statistics come from the checkpoint. A workdir without
  checkpoints and a config whose init_from names published weights gives
  the published model, its head and classes kept.
  """
  if (config.init_from.checkpoint and pretrained.is_published(config.init_from.checkpoint)
      and not files.isdir(os.path.join(workdir, 'checkpoints'))):
    return finetune.published_model(config)
  checkpoints = checkpoint.Checkpoints(workdir, config, read_only=True)
  mesh = parallel.make_mesh(config)
  # Classes and image shape come from the checkpoint; a softmax head read as sigmoids (or back) is refused.
  expected = {'model': config.model.name, 'task': config.task}

  def read(step: int):
    """The placement its record describes, and the model state of `step` laid out by it."""
    record = checkpoints.read_record(step)
    if config.eval.ema and not record.get('config', {}).get('ema', {}).get('decay'):
      raise checkpoint.CheckpointError(
          f'config.eval.ema=True but the run in {workdir} was trained without an EMA of its weights '
          '(ema.decay=0); drop --config.eval.ema or train with --config.ema.decay=0.999')
    task = steps.create_task(config, num_classes=record['num_classes'],
                             image_shape=tuple(record['image_shape']),
                             mean=record['normalization']['mean'], std=record['normalization']['std'])
    placement = steps.place(task, mesh, config)
    model = placement.abstract_state
    if not config.eval.ema:
      return placement, *checkpoints.restore(step, model, expected, config=config, subset=True)
    # The saved state's `ema` subtree, read into a ModelState's layout.
    ema = {'ema': {'params': model.params, 'batch_stats': model.batch_stats}}
    saved, record = checkpoints.restore(step, ema, expected, config=config, subset=True)
    return placement, steps.ModelState(**saved['ema']), record

  # An unreadable latest checkpoint falls back to the newest readable one; one that a live run
  # rotates away while it is read is listed again.
  step, (placement, saved, record) = checkpoints.restore_which(str(config.eval.checkpoint), read)
  checkpoints.close()
  if config.eval.ema:
    logging.info('using the EMA weights of checkpoint step %d', step)
  return placement, placement.from_saveable(saved), step, record


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """--mode=eval: accuracy and loss over every example of the eval split -> WORKDIR/eval.json.

  eval.json holds this evaluation at its top level (`split` names what it
  scored, `weights` raw or ema, `tta` the test-time augmentation) and, under
  `splits`, the latest result of every split, weights, TTA and step evaluated
  ('test', 'test:ema', 'test:tta=none' when training used TTA, 'test:step=48'
  for a checkpoint before the last), so scoring another never loses one.
  """
  # A run on a read-only disk is still evaluated: its files then go elsewhere (a warning says where).
  output = files.writable_or_elsewhere(workdir, 'eval.json, per_class.csv and the pictures')
  placement, state, step, record = restore(config, workdir)
  dataset = pipeline.load(config, need_train=False, class_names=record.get('class_names'))  # matched by name
  if dataset.num_classes != record['num_classes'] or dataset.image_shape != tuple(record['image_shape']):
    raise UserError(f'{config.dataset.folder or config.dataset.name} has {dataset.num_classes} classes '
                    f'of {dataset.image_shape} images but checkpoint {workdir}/checkpoints/{step} was '
                    f'trained on {record["num_classes"]} classes of {tuple(record["image_shape"])}; '
                    'evaluate on data like the training data')
  results, predictions = evaluate(placement, state, dataset, resolved_eval_batch_size(config),
                                  keep_logits=True, threshold=config.eval.threshold)
  if config.eval.fewshot.shots:
    results.update(fewshot_accuracies(config, placement, state, record))
  # The run's own final evaluation (its eval split, TTA and weights at its last step) gets the plain
  # names its end-of-run report has; any other view of the checkpoints a suffix naming how it differs,
  # so no result replaces another's.
  trained = record.get('config', {})
  split, tta, ema = config.dataset.eval_split, tta_name(config.eval), bool(config.eval.ema)
  final_step = (files.read_json(os.path.join(workdir, 'results.json')) or {}).get('step')
  other_step = final_step is not None and step != final_step
  other_tta = tta != tta_name(trained.get('eval', {}))
  other_weights = ema != bool(trained.get('eval', {}).get('ema', False))
  suffix = ''.join(part for part, differs in (
      (f'-{split_file_name(split)}', split != trained.get('dataset', {}).get('eval_split')),
      (f'-step{step}', other_step), (f'-tta_{tta}', other_tta),
      ('-ema' if ema else '-raw', other_weights)) if differs)
  key = split + (f':step={step}' if other_step else '') + (f':tta={tta}' if other_tta else '') + (
      ':ema' if ema else '')
  results.update(write_report(predictions, dataset, output, suffix, config.eval.threshold,
                              report_about(config, step, split)))
  results.update(step=step, split=split, tta=tta, weights='ema' if ema else 'raw',
                 source=config.dataset.folder or config.dataset.name,
                 checkpoint=os.path.join(workdir, 'checkpoints', str(step)))
  logging.info('eval of step %d: %s  (%d examples)', step, eval_summary(results), results['num_examples'])
  if jax.process_index() == 0:
    # The latest evaluation on top; every split's latest result kept under 'splits'.
    path = os.path.join(output, 'eval.json')
    earlier = files.read_json(path) or files.read_json(os.path.join(workdir, 'eval.json')) or {}
    splits = earlier.get('splits', {})
    splits[key] = dict(results)
    with files.writing(path, 'free disk space or choose a writable --workdir'):
      files.write_json(path, {**results, 'splits': splits})
  return results


def fewshot_accuracies(config: ml_collections.ConfigDict, placement: steps.Placement, state,
                       record: dict) -> dict[str, float]:
  """eval.fewshot's probe accuracies of a restored model (they need the train split too)."""
  dataset = pipeline.load(config, class_names=record.get('class_names'))
  norm = record['normalization']
  task = steps.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']), mean=norm['mean'], std=norm['std'])
  return fewshot.Probe(config, dataset, task, placement)(state)


def tag_thresholds(config: ml_collections.ConfigDict, workdir: str, step: int,
                   class_names: list[str]) -> tuple[np.ndarray, str]:
  """(the probability each tag must reach in --mode=predict, where it comes from).

  `eval.threshold` when set (the user's choice wins); else the per-class thresholds of an
  evaluation saved in WORKDIR/thresholds*.json: the one made of this step, these weights and this
  TTA, the run's own final evaluation (thresholds.json) first; else 0.5.
  """
  if config.eval.threshold:
    return np.full(len(class_names), config.eval.threshold), f'eval.threshold={config.eval.threshold:g}'
  wanted = report_about(config, step)
  candidates = []
  for name in sorted(files.listdir(workdir)) if files.isdir(workdir) else []:
    if not (name.startswith('thresholds') and name.endswith('.json')):
      continue
    saved = files.read_json(os.path.join(workdir, name)) or {}
    if list(saved.get('class_thresholds', {})) != list(class_names):
      continue  # another model's classes
    fit = tuple(saved.get(key) == wanted[key] for key in ('step', 'weights', 'tta'))
    candidates.append((fit + (name == report.THRESHOLDS_FILE,), name, saved))
  if not candidates:
    return (np.full(len(class_names), report.DEFAULT_THRESHOLD),
            f'{report.DEFAULT_THRESHOLD:g} for every tag: no evaluation has chosen thresholds (run '
            '--mode=eval, or set --config.eval.threshold)')
  _, name, saved = max(candidates, key=lambda candidate: candidate[0])
  source = (f'per-class thresholds from {name} ({saved.get("chosen_by")}, {saved.get("split")} at step '
            f'{saved.get("step")}, {saved.get("weights")} weights)')
  if saved.get('step') != step:
    source += f'; predicting with step {step}: --mode=eval of it would choose its own'
  return np.array([saved['class_thresholds'][c] for c in class_names], np.float64), source


def _multiclass_row(path: str, probabilities: np.ndarray, class_names: list[str], top_k: int) -> dict:
  """predict's row for one image: its top-k classes and their softmax probabilities."""
  best = np.argsort(-probabilities)[:top_k]
  row = {'path': path}
  for rank, index in enumerate(best, 1):
    row[f'class_{rank}'], row[f'probability_{rank}'] = class_names[index], float(probabilities[index])
  print(f'{printable(path)}: ' + ', '.join(f'{printable(class_names[i])} {probabilities[i]:.3f}'
                                                for i in best))
  return row


def _multilabel_row(path: str, probabilities: np.ndarray, thresholds: np.ndarray, class_names: list[str],
                    top_k: int) -> dict:
  """predict's row for one image: every tag whose probability reaches its threshold ('tags', most
  probable first, ';'-separated, and their 'tag_probabilities'), then the top-k classes as multiclass."""
  tags = [c for c in np.argsort(-probabilities, kind='stable') if probabilities[c] >= thresholds[c]]
  row = {'path': path, 'tags': ';'.join(class_names[c] for c in tags),
         'tag_probabilities': ';'.join(f'{probabilities[c]:.4f}' for c in tags)}
  for rank, index in enumerate(np.argsort(-probabilities, kind='stable')[:top_k], 1):
    row[f'class_{rank}'], row[f'probability_{rank}'] = class_names[index], float(probabilities[index])
  print(f'{printable(path)}: ' + (', '.join(f'{printable(class_names[c])} {probabilities[c]:.3f}'
                                                 for c in tags) or '(no tag)'))
  return row


def predict(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """--mode=predict: top-k classes of each image in `config.predict.input`; multilabel, every tag
  whose probability reaches its threshold (`tag_thresholds` says which, in the log and on stdout)."""
  if not config.predict.input:
    raise UserError('--mode=predict needs --config.predict.input=IMAGE_OR_FOLDER')
  placement, state, step, record = restore(config, workdir)
  image_shape = tuple(record['image_shape'])
  paths, images = predict_inputs.read_images(config.predict.input, image_shape,
                                             pipeline.image_transform(config, channels=image_shape[-1]),
                                             skip_corrupt=config.dataset.skip_corrupt)
  logits = predict_logits(placement, state, images, resolved_eval_batch_size(config))
  class_names = record['class_names']
  top_k = min(config.predict.top_k, len(class_names))
  if config.task == 'multilabel':
    thresholds, source = tag_thresholds(config, workdir, step, class_names)
    print(f'tags at or above their thresholds: {source}')
    logging.info('thresholds: %s', source)
    rows = [_multilabel_row(path, probs, thresholds, class_names, top_k)
            for path, probs in zip(paths, report.sigmoid(logits))]
  else:
    rows = [_multiclass_row(path, probs, class_names, top_k)
            for path, probs in zip(paths, np.asarray(jax.nn.softmax(logits, axis=-1)))]
  logging.info('predicted %d images with checkpoint step %d', len(rows), step)
  if config.predict.output_csv and jax.process_index() == 0:
    files.write_csv(config.predict.output_csv, [{**row, 'path': files.csv_path(row['path'])} for row in rows],
                    'predict.output_csv')
  return rows


def predict_logits(placement: steps.Placement, state, images: np.ndarray,
                   batch_size: int) -> np.ndarray:
  """Logits of every image, in fixed-size padded batches through one compiled function.

  `batch_size` divides over the devices (`steps.place` checked it).
  """
  if jax.process_count() > 1:
    raise UserError('--mode=predict runs on one process; start it without --num_processes')
  # A few images need no full batch of padding: the smallest multiple of the device count holding them.
  devices = placement.mesh.devices.size
  batch_size = min(batch_size, -(-len(images) // devices) * devices)
  outputs = []
  for start in range(0, len(images), batch_size):
    chunk = images[start:start + batch_size]
    padded = np.concatenate([chunk, np.zeros((batch_size - len(chunk), *chunk.shape[1:]), np.uint8)])
    (device_images,) = placement.put_eval_batch((padded,))
    outputs.append(np.asarray(placement.logits(state, device_images))[:len(chunk)])
  return np.concatenate(outputs)
