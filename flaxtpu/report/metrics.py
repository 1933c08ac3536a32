"""The numbers of one evaluation, from its logits and labels: numpy only (no plotting, no JAX).

Multiclass (`eval_report`): per-class precision and recall, the confusion matrix, top-1/top-5 and
balanced accuracy, expected calibration error and its reliability bins. Multilabel
(`multilabel_report`): average precision per class (sklearn's), mAP macro and micro, each class's
best-F1 threshold and micro-F1, exact match, calibration of every tag. The in-training evaluation
takes its multilabel metrics from here; `report.tables` and `report.plots` write them to files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

NUM_CALIBRATION_BINS = 15
_CHUNK = 4096  # Rows per pass, so 50,000 x 1,000 logits never need a second full-size copy.


def softmax(logits: np.ndarray) -> np.ndarray:
  """Softmax over the last axis, shifted by the row maximum so exp never overflows."""
  logits = np.asarray(logits, dtype=np.float64)
  shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
  return shifted / shifted.sum(axis=-1, keepdims=True)


def _check_inputs(logits: Any, labels: Any, class_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  logits = np.asarray(logits)
  if logits.dtype not in (np.float32, np.float64):
    logits = logits.astype(np.float32)  # bfloat16 from the device, or integers; float64 is kept as given.
  labels = np.asarray(labels)
  if logits.ndim != 2:
    raise ValueError(f'logits must be [examples, classes], got shape {logits.shape}')
  if labels.shape != (logits.shape[0],):
    raise ValueError(f'labels must be [{logits.shape[0]}] to match logits {logits.shape}, got {labels.shape}')
  if not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f'labels must be integers, got {labels.dtype}')
  if len(class_names) != logits.shape[1]:
    raise ValueError(f'{len(class_names)} class names for {logits.shape[1]} logits per example')
  if logits.shape[0] == 0:
    raise ValueError('no examples to report on')
  if labels.min() < 0 or labels.max() >= logits.shape[1]:
    raise ValueError(f'labels must be in [0, {logits.shape[1]}), got {labels.min()}..{labels.max()}')
  return logits, labels.astype(np.int64)


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
  """numerator / denominator, NaN where the denominator is 0 (undefined, not 0%)."""
  out = np.full(numerator.shape, np.nan)
  np.divide(numerator, denominator, out=out, where=denominator > 0)
  return out


def eval_report(logits: np.ndarray, labels: np.ndarray, class_names: Sequence[str]) -> dict[str, Any]:
  """Per-class and calibration numbers of one evaluation.

  Args:
    logits: [N, C] float scores (any real scale; softmax is taken here).
    labels: [N] int true classes in [0, C).
    class_names: C names, in class-index order.

  Returns a dict of numpy arrays and floats:
    num_examples, num_classes, class_names, labels [N];
    predictions [N] (argmax, first index on ties), confidence [N] (max softmax probability);
    confusion [C, C] counts, rows = true class, columns = predicted class;
    support, correct, predicted [C] counts;
    precision, recall, accuracy [C] (accuracy = recall = correct / support; NaN where the denominator is 0);
    top1_accuracy, top5_accuracy (only when C > 5; tied logits rank in class-index order, as in argmax);
    balanced_accuracy: the mean recall over the classes with examples;
    ece: sum over 15 equal-width confidence bins (lo, hi] of |B|/N * |accuracy(B) - confidence(B)|;
    reliability: {bin_lower, bin_upper, count, accuracy, confidence} arrays of the bins (NaN where empty).
  """
  logits, labels = _check_inputs(logits, labels, class_names)
  num_examples, num_classes = logits.shape
  predictions = np.empty(num_examples, np.int64)
  confidence = np.empty(num_examples, np.float64)
  rank = np.empty(num_examples, np.int64)  # Position of the true class in a stable descending sort.
  class_index = np.arange(num_classes)
  for start in range(0, num_examples, _CHUNK):
    rows = slice(start, start + _CHUNK)
    chunk, chunk_labels = logits[rows].astype(np.float64), labels[rows]
    predictions[rows] = chunk.argmax(axis=1)
    # The max softmax probability is 1 / sum(exp(l - max l)): no full probability matrix needed.
    confidence[rows] = 1.0 / np.exp(chunk - chunk.max(axis=1, keepdims=True)).sum(axis=1)
    true_logit = chunk[np.arange(len(chunk)), chunk_labels][:, None]
    rank[rows] = ((chunk > true_logit).sum(axis=1) +
                  ((chunk == true_logit) & (class_index < chunk_labels[:, None])).sum(axis=1))

  confusion = np.bincount(labels * num_classes + predictions,
                          minlength=num_classes * num_classes).reshape(num_classes, num_classes)
  support = confusion.sum(axis=1)
  predicted = confusion.sum(axis=0)
  correct = np.diag(confusion).copy()
  recall = _divide(correct, support)
  hits = predictions == labels
  ece, reliability = _calibration(confidence, hits)
  report = {
      'num_examples': num_examples,
      'num_classes': num_classes,
      'class_names': list(class_names),
      'labels': labels,
      'predictions': predictions,
      'confidence': confidence,
      'confusion': confusion,
      'support': support,
      'correct': correct,
      'predicted': predicted,
      'precision': _divide(correct, predicted),
      'recall': recall,
      'accuracy': recall,
      'top1_accuracy': float(hits.mean()),
      'balanced_accuracy': float(np.mean(recall[support > 0])),
      'ece': ece,
      'reliability': reliability,
  }
  if num_classes > 5:
    report['top5_accuracy'] = float((rank < 5).mean())
  return report


def confidence_calibration(logits: np.ndarray, labels: np.ndarray,
                           scale: float = 1.0) -> tuple[float, dict[str, np.ndarray]]:
  """(ECE, reliability bins) of multiclass `logits` [N, C] times `scale` against int `labels` [N], as
  `eval_report`'s (a block of rows at a time)."""
  confidence, hits = np.empty(len(labels)), np.empty(len(labels), bool)
  for start in range(0, len(labels), _CHUNK):
    rows = slice(start, start + _CHUNK)
    chunk = np.asarray(logits[rows], np.float64) * scale
    confidence[rows] = 1.0 / np.exp(chunk - chunk.max(axis=1, keepdims=True)).sum(axis=1)
    hits[rows] = chunk.argmax(axis=1) == np.asarray(labels[rows])
  return _calibration(confidence, hits)


def _calibration(confidence: np.ndarray, hits: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
  """(ECE, reliability bins) of predictions made with `confidence` that came true where `hits`.

  ECE: sum over 15 equal-width confidence bins (lo, hi] of |B|/N * |accuracy(B) - confidence(B)|
  (the first bin also holds confidence 0).
  """
  edges = np.linspace(0.0, 1.0, NUM_CALIBRATION_BINS + 1)
  bins = np.clip(np.digitize(confidence, edges, right=True) - 1, 0, NUM_CALIBRATION_BINS - 1)
  bin_count = np.bincount(bins, minlength=NUM_CALIBRATION_BINS)
  bin_accuracy = _divide(np.bincount(bins, weights=hits, minlength=NUM_CALIBRATION_BINS), bin_count)
  bin_confidence = _divide(np.bincount(bins, weights=confidence, minlength=NUM_CALIBRATION_BINS),
                           bin_count)
  filled = bin_count > 0
  gaps = np.abs(bin_accuracy[filled] - bin_confidence[filled])
  ece = float(np.sum(bin_count[filled] / len(confidence) * gaps))
  return ece, {'bin_lower': edges[:-1], 'bin_upper': edges[1:], 'count': bin_count,
               'accuracy': bin_accuracy, 'confidence': bin_confidence}


# --- multilabel: average precision and F1 thresholds -------------------------------------------

DEFAULT_THRESHOLD = 0.5  # a tag's probability that predicts it where no evaluation chose one
_RANKING_CELLS = 2**22  # per-class ranking works on blocks of columns of about this many cells


def sigmoid(logits: Any) -> np.ndarray:
  """float64 probabilities of independent tags (the tanh form never overflows)."""
  return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(logits, np.float64)))


def _check_multilabel(logits: Any, labels: Any, class_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  logits, labels = np.asarray(logits), np.asarray(labels)
  if logits.ndim != 2 or labels.shape != logits.shape:
    raise ValueError(f'multilabel logits and labels must both be [examples, classes], got {logits.shape} '
                     f'and {labels.shape}')
  if len(class_names) != logits.shape[1]:
    raise ValueError(f'{len(class_names)} class names for {logits.shape[1]} logits per example')
  if logits.shape[0] == 0:
    raise ValueError('no examples to report on')
  if not np.isin(labels, (0, 1)).all():
    raise ValueError('multilabel labels must be 0 or 1 (multi-hot rows)')
  return sigmoid(logits), labels.astype(bool)


def ranking_scores(scores: np.ndarray, positives: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per column of `scores` [N, K] and bool `positives` [N, K]: (average precision, best F1, its threshold).

  Average precision is sklearn's `average_precision_score`: the step-wise area under the
  precision-recall curve, sum over thresholds of (R_k - R_{k-1}) P_k, no interpolation; tied
  scores enter together. It is NaN for a column without positives.

  The threshold is the one at which `score >= threshold` gives the column's highest F1 (the
  highest such threshold on a tie): the midpoint between the lowest score predicted positive and
  the next score below it (0 below the last), so it sits between the examples, not on one.
  """
  num_rows, num_columns = scores.shape
  average_precision, best_f1, threshold = (np.empty(num_columns) for _ in range(3))
  rows = np.arange(num_rows)[:, None]
  step = max(1, _RANKING_CELLS // max(num_rows, 1))
  for start in range(0, num_columns, step):
    block = slice(start, start + step)
    order = np.argsort(-scores[:, block], axis=0, kind='stable')
    ranked = np.take_along_axis(scores[:, block], order, 0)
    hits = np.take_along_axis(positives[:, block], order, 0)
    true_positives = np.cumsum(hits, axis=0)  # of the rows up to and including this one
    total = true_positives[-1]
    # The last row of each run of tied scores: a threshold cannot split ties.
    last_tied = np.ones(ranked.shape, bool)
    last_tied[:-1] = ranked[1:] != ranked[:-1]
    group_end = np.minimum.accumulate(np.where(last_tied, rows, num_rows)[::-1], axis=0)[::-1]
    precision = np.take_along_axis(true_positives, group_end, 0) / (group_end + 1)
    with np.errstate(invalid='ignore', divide='ignore'):
      # Each positive adds 1/P recall at its group's end, at that group's precision.
      average_precision[block] = np.where(total > 0, (hits * precision).sum(0) / total, np.nan)
    f1 = np.where(last_tied, 2 * true_positives / (rows + 1 + total), -1.0)  # 2TP / (TP + FP + P)
    best = f1.argmax(0)
    columns = np.arange(ranked.shape[1])
    best_f1[block] = f1[best, columns]
    lowest_in = ranked[best, columns]
    below = np.where(best + 1 < num_rows, ranked[np.minimum(best + 1, num_rows - 1), columns], 0.0)
    middle = (lowest_in + below) / 2
    threshold[block] = np.where(middle > below, middle, lowest_in)  # adjacent floats: no midpoint
  return average_precision, best_f1, threshold


def multilabel_report(logits: np.ndarray, labels: np.ndarray, class_names: Sequence[str],
                      threshold: float = 0.0) -> dict[str, Any]:
  """The numbers of one multilabel evaluation.

  Args:
    logits: [N, C] float scores (a sigmoid per class is taken here).
    labels: [N, C] multi-hot 0/1 (a row may be all zeros).
    class_names: C names, in class-index order.
    threshold: a tag is predicted when its probability reaches this; 0 chooses the thresholds on
      these examples (then optimistic for them: they are chosen and scored on the same split).

  Returns a dict of numpy arrays and floats:
    num_examples, num_classes, class_names, probabilities [N, C], positives [N, C] bool;
    support [C] (examples with the tag), average_precision [C] (NaN without support);
    map: mean AP over the classes with support (0 when none has); map_micro: AP of every
      (example, class) pair pooled;
    threshold: the given one, else the one with the best micro-F1; f1 (micro-F1) and exact_match
      (the fraction of examples whose every tag is right) at it;
    class_thresholds [C]: the given one, else each class's best-F1 threshold (the global one for a
      class without support); predictions [N, C] bool and tp, fp, fn, precision, recall, f1_per_class
      [C] at them (precision/recall/F1 NaN where undefined);
    threshold_source: 'eval.threshold' or 'best F1 on the eval split';
    ece, reliability: calibration of every (example, class) probability against its tag's presence.
  """
  probabilities, positives = _check_multilabel(logits, labels, class_names)
  num_examples, num_classes = probabilities.shape
  average_precision, _, class_thresholds = ranking_scores(probabilities, positives)
  pooled_ap, _, pooled_threshold = ranking_scores(probabilities.reshape(-1, 1), positives.reshape(-1, 1))
  support = positives.sum(0)
  if threshold:
    chosen, class_thresholds = float(threshold), np.full(num_classes, float(threshold))
  else:
    chosen = float(pooled_threshold[0]) if support.any() else DEFAULT_THRESHOLD
    class_thresholds = np.where(support > 0, class_thresholds, chosen)
  predicted_global = probabilities >= chosen
  pooled_tp = int((predicted_global & positives).sum())
  pooled_errors = int((predicted_global != positives).sum())
  predictions = probabilities >= class_thresholds
  tp = (predictions & positives).sum(0)
  fp = (predictions & ~positives).sum(0)
  fn = (~predictions & positives).sum(0)
  ece, reliability = _calibration(probabilities.ravel(), positives.ravel())
  return {
      'num_examples': num_examples,
      'num_classes': num_classes,
      'class_names': list(class_names),
      'probabilities': probabilities,
      'positives': positives,
      'support': support,
      'average_precision': average_precision,
      'map': float(np.mean(average_precision[support > 0])) if support.any() else 0.0,
      'map_micro': float(pooled_ap[0]) if support.any() else 0.0,
      'threshold': chosen,
      'threshold_source': 'eval.threshold' if threshold else 'best F1 on the eval split',
      'f1': 2 * pooled_tp / (2 * pooled_tp + pooled_errors) if pooled_tp else 0.0,
      'exact_match': float(np.all(predicted_global == positives, axis=1).mean()),
      'class_thresholds': class_thresholds,
      'predictions': predictions,
      'tp': tp, 'fp': fp, 'fn': fn,
      'precision': _divide(tp, tp + fp),
      'recall': _divide(tp, support),
      'f1_per_class': _divide(2 * tp, 2 * tp + fp + fn),
      'ece': ece,
      'reliability': reliability,
  }


def multilabel_metrics(report: Mapping[str, Any]) -> dict[str, float]:
  """The evaluation's scalars as metric names: eval_map, eval_map_micro, eval_f1 (micro, at
  eval_threshold), eval_threshold and eval_accuracy (the exact-match ratio at eval_threshold)."""
  return {'eval_map': report['map'], 'eval_map_micro': report['map_micro'], 'eval_f1': report['f1'],
          'eval_threshold': report['threshold'], 'eval_accuracy': report['exact_match']}


def most_confused_with(confusion: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per true class: the other class it is most often predicted as (-1 if never wrong) and that count."""
  off_diagonal = confusion.copy()
  np.fill_diagonal(off_diagonal, 0)
  other = off_diagonal.argmax(axis=1)
  count = off_diagonal[np.arange(len(other)), other]
  return np.where(count > 0, other, -1), count


def top_confusions(confusion: np.ndarray, k: int) -> list[tuple[int, int, int]]:
  """The k largest off-diagonal cells as (true, predicted, count), largest first; zero counts left out."""
  off_diagonal = confusion.copy()
  np.fill_diagonal(off_diagonal, 0)
  flat = off_diagonal.ravel()
  k = min(k, int(np.count_nonzero(flat)))
  if k == 0:
    return []
  top = np.argpartition(-flat, k - 1)[:k]
  top = top[np.lexsort((top, -flat[top]))]  # Count descending, then cell order: deterministic on ties.
  size = confusion.shape[1]
  return [(int(i // size), int(i % size), int(flat[i])) for i in top]
