"""The in-training evaluation: every example of the eval splits scored once, and the end-of-run report.

`train.py` calls `evaluate_splits` at each evaluation and `write_report` at the end; `--mode=eval`
(`flaxtpu.modes.eval`) scores a restored checkpoint with the same functions. Multilabel metrics (mAP,
F1 thresholds) come from `report.metrics`, the report files from `report.writer`.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from flaxtpu.data import loaders, pipeline
from flaxtpu.io import files
from flaxtpu.optimizers import swa
from flaxtpu.report import metrics as report_metrics
from flaxtpu.report import writer
from flaxtpu.settings.metric_names import eval_metric_prefix
from flaxtpu.step import parallel, placing, steps


class Predictions(NamedTuple):
  """The logits and labels (int [N], or multilabel multi-hot [N, classes]) of every eval example, in order."""
  logits: np.ndarray
  labels: np.ndarray


def evaluate(placement: placing.Placement, state, dataset: pipeline.Dataset, batch_size: int,
             keep_logits: bool = False, threshold: float = 0.0
             ) -> tuple[dict[str, float], Optional[Predictions]]:
  """The metrics of every example of the eval split, each counted exactly once.

  Multiclass: loss, accuracy, balanced accuracy (and top-5 accuracy), from the devices. Multilabel:
  the loss, and from every example's logits on the host (gathered from every process) mAP, micro
  mAP, micro-F1 at a threshold (`threshold`, or the best one on this split), the threshold, and
  the exact-match accuracy at it (`report.metrics.multilabel_report`).

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
    totals = batch_metrics if totals is None else steps.merge_metrics(totals, batch_metrics)
    multilabel = batch.labels.ndim == 2
    if keep_logits or multilabel:
      rows_logits, rows_labels = _real_rows(batch_logits, batch)
      logits.append(rows_logits)
      labels.append(rows_labels)
  result = {f'eval_{k}': float(v) for k, v in totals.compute().items()}
  result['num_examples'] = int(totals.loss.count)
  predictions = Predictions(np.concatenate(logits), np.concatenate(labels)) if logits else None
  if multilabel:
    result.update(report_metrics.multilabel_metrics(report_metrics.multilabel_report(
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


def evaluate_splits(placement: placing.Placement, state, eval_sets: list[tuple[str, pipeline.Dataset]],
                    batch_size: int, report_weights: Optional[str] = None, threshold: float = 0.0
                    ) -> tuple[dict[str, float], Optional[Predictions]]:
  """Every eval split, with the raw weights and (when the state has them) the EMA weights.

  The first split's metrics are `eval_loss`, `eval_accuracy`, ... (they pick
  the best checkpoint); another split's carry its name (`eval_train_5000_accuracy`);
  the EMA weights' end in `_ema`, the SWA's in `_swa`. `num_examples` counts the first split.
  With `report_weights` ('raw', 'ema' or 'swa') the first split's predictions under
  those weights come back too (see `evaluate`). `threshold`: multilabel, as in `evaluate`.
  """
  views = [('raw', '', state)]
  if getattr(state, 'ema', None):
    views.append(('ema', '_ema', steps.ema_view(state)))
  if swa.has_average(state):  # its BatchNorm statistics recomputed (swa.before_evaluation)
    views.append(('swa', '_swa', swa.view(state)))
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
                 suffix: str = '', threshold: float = 0.0, about: Optional[dict] = None,
                 overlay: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 calibration: Optional[dict] = None) -> dict:
  """per_class.csv, confusion, mistakes and reliability PNGs of the eval split in `directory`;
  multilabel, also thresholds.json (`threshold`, `about` and `calibration` as in
  `report.writer.write_eval_report`), and report.html.

  `predictions` are what `evaluate` kept. Returns the summary numbers (ECE,
  top-5 accuracy) for eval.json. `overlay` (image -> image, e.g. `explain.overlaid`) draws on each
  image the mistakes picture shows. They are kept on one process only, so a run
  of many processes leaves the report to `--mode=eval` on one.
  """
  if jax.process_count() > 1:
    logging.info('per-class report skipped: it runs on one process (--mode=eval on one host writes it)')
    return {}
  logits, labels = predictions
  draw = overlay or _same
  with files.writing(directory, 'free disk space or choose a writable --workdir'):
    summary = writer.write_eval_report(directory, logits, labels, list(dataset.class_names),
                                       images=lambda index: draw(loaders.eval_image(dataset, index)),
                                       suffix=suffix, threshold=threshold, about=about,
                                       calibration=calibration)
  logging.info('eval report: ECE %.4f%s; %s in %s', summary['eval_ece'],
               f', top-5 accuracy {summary["eval_top5_accuracy"]:.4f}' if 'eval_top5_accuracy' in summary
               else '', ', '.join(summary['report_files']), directory)
  return summary


def _same(image: np.ndarray) -> np.ndarray:
  return image


def report_about(config: ml_collections.ConfigDict, step: int, split: Optional[str] = None) -> dict:
  """What an evaluation report was made of: the step, the split, the weights and the TTA (kept in
  thresholds.json, whose thresholds predict matches to the checkpoint it restores)."""
  return {'step': step, 'split': split or config.dataset.eval_split,
          'weights': swa.weights_name(config.eval), 'tta': tta_name(config.eval)}


def tta_name(eval_config) -> str:
  """The test-time augmentation of an `eval` config (or its saved dict): 'flip+translate2', 'flip',
  'none'..."""
  parts = (['flip'] if eval_config.get('flip_tta') else []) + (
      [f'translate{eval_config["translate_tta"]}'] if eval_config.get('translate_tta') else [])
  return '+'.join(parts) or 'none'
