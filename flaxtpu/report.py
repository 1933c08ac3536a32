"""What the model learned and where the time went: per-class metrics, confusions, calibration and curves.

JAX-free (numpy + matplotlib only), so `python -m flaxtpu.report WORKDIR` plots a live or finished run's
curves without starting JAX:

    python -m flaxtpu.report runs/cifar10        # writes runs/cifar10/curves.png and prints its path

`write_eval_report` writes per_class.csv, confusion.png, mistakes.png and reliability.png next to
eval.json (a multilabel evaluation: per-class AP and F1, a TP/FP/FN chart for the confusion matrix,
and thresholds.json); `write_curves` writes curves.png from metrics.jsonl. Multilabel metrics
(`multilabel_report`): mAP macro and micro with sklearn's average precision, F1 at thresholds chosen
on the evaluated split.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flaxtpu import files, storage
from flaxtpu.errors import UserError

METRICS_FILE = 'metrics.jsonl'
CURVES_FILE = 'curves.png'
NUM_CALIBRATION_BINS = 15
FULL_MATRIX_MAX_CLASSES = 30  # Above this a full heatmap is unreadable: show the top confusions only.
TOP_CONFUSED_CLASSES = 20
TOP_CONFUSED_PAIRS = 20
MAX_MISTAKES = 25
_CHUNK = 4096  # Rows per pass, so 50,000 x 1,000 logits never need a second full-size copy.

Images = np.ndarray | Callable[[int], np.ndarray]


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

THRESHOLDS_FILE = 'thresholds.json'
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


def thresholds_record(report: Mapping[str, Any], about: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """What THRESHOLDS_FILE holds: each class's threshold, the global one, how they were chosen, and
  `about` (which step, weights and split they were chosen on), for --mode=predict and the export."""
  return {**(about or {}), 'threshold': report['threshold'], 'chosen_by': report['threshold_source'],
          'class_thresholds': {name: float(value) for name, value in
                               zip(report['class_names'], report['class_thresholds'])}}


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


def _atomic(path: str, write: Callable[[str], None]) -> None:
  """Calls write(temporary path), then renames it onto `path` (an object store: uploads it whole): a crash
  never leaves half a file."""
  files.atomic_write(path, write)


def _pyplot():
  import matplotlib  # Imported here: the numbers above never need it.
  matplotlib.use('Agg')
  from matplotlib import pyplot
  return pyplot


def plain_text(plot: Callable) -> Callable:
  """Has `plot` draw every text as written: a '$' in a class or run name (a regex's 'bias$', '$5 bill')
  is not the start of TeX math, which garbles the name or fails to parse and loses the picture; a
  name in another script ('猫') is drawn with an installed font that has its glyphs (see _fonts)."""

  @functools.wraps(plot)
  def plot_plain(*args, **kwargs):
    import matplotlib
    with matplotlib.rc_context({'text.parse_math': False, 'font.family': _fonts()[0]}):
      return plot(*args, **kwargs)

  return plot_plain


# Fonts with CJK and other scripts, used after matplotlib's DejaVu Sans where the system has them
# (matplotlib ships none; e.g. apt install fonts-noto-cjk, or fonts-wqy-zenhei).
FALLBACK_FONTS = ('Noto Sans CJK SC', 'Noto Sans CJK JP', 'Noto Sans CJK KR', 'Noto Sans SC',
                  'Source Han Sans SC', 'Source Han Sans', 'WenQuanYi Zen Hei', 'WenQuanYi Micro Hei',
                  'Droid Sans Fallback', 'AR PL UMing CN', 'IPAGothic', 'Microsoft YaHei', 'SimHei',
                  'PingFang SC', 'Hiragino Sans GB', 'Arial Unicode MS', 'Noto Sans', 'Noto Sans Arabic',
                  'Noto Sans Devanagari', 'Unifont')


@functools.cache
def _fonts() -> tuple[list[str], frozenset[int]]:
  """(the font families to draw with, the code points they cover): DejaVu Sans, then any fallback
  installed."""
  from matplotlib import font_manager, ft2font
  installed = {font.name for font in font_manager.fontManager.ttflist}
  families = ['DejaVu Sans'] + [name for name in FALLBACK_FONTS if name in installed]
  covered = set()
  for family in families:
    path = font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
    covered.update(ft2font.FT2Font(path).get_charmap())
  return families, frozenset(covered)


def _legible(text: str) -> str:
  """`text` with each character no installed font draws written as its escape ('\\u732b'): readable,
  where matplotlib would draw an empty box and warn once per character and picture."""
  covered = _fonts()[1]
  return ''.join(c if ord(c) in covered or c.isspace() else c.encode('unicode_escape').decode() for c in text)


def _save_figure(figure, path: str) -> None:
  pyplot = _pyplot()
  try:
    _atomic(path, lambda temporary: figure.savefig(temporary, format='png', dpi=100))
  finally:
    pyplot.close(figure)


def _short(name: str, width: int = 24) -> str:
  return _legible(name if len(name) <= width else name[:width - 1] + '…')


def _csv_number(value: float) -> str:
  return '' if math.isnan(value) else repr(float(value))


def write_per_class_csv(path: str, report: Mapping[str, Any]) -> None:
  """One row per class: class, support, correct, precision, recall, accuracy, most_confused_with (+ count).

  Undefined precision (never predicted) or recall (no examples) is an empty cell, not 0.
  """
  names = report['class_names']
  other, other_count = most_confused_with(report['confusion'])

  def write(temporary: str) -> None:
    with open(temporary, 'w', newline='', encoding='utf-8') as f:
      writer = csv.writer(f)
      writer.writerow(['class', 'support', 'correct', 'precision', 'recall', 'accuracy',
                       'most_confused_with', 'most_confused_count'])
      for c, name in enumerate(names):
        writer.writerow([name, int(report['support'][c]), int(report['correct'][c]),
                         _csv_number(report['precision'][c]), _csv_number(report['recall'][c]),
                         _csv_number(report['accuracy'][c]), names[other[c]] if other[c] >= 0 else '',
                         int(other_count[c])])

  _atomic(path, write)


def _heatmap(axes, confusion: np.ndarray, support: np.ndarray, rows: Sequence[int],
             names: Sequence[str]) -> None:
  """Cells of `rows` x `rows` coloured by the fraction of the true class's examples, labelled with counts."""
  index = np.asarray(rows)
  counts = confusion[np.ix_(index, index)]
  fractions = counts / np.maximum(support[index], 1)[:, None]
  image = axes.imshow(fractions, cmap='Blues', vmin=0.0, vmax=1.0)
  size = len(index)
  labels = [_short(names[i]) for i in index]
  font = max(4, min(9, int(160 / max(size, 1))))
  axes.set_xticks(range(size), labels, rotation=90, fontsize=font)
  axes.set_yticks(range(size), labels, fontsize=font)
  axes.set_xlabel('predicted')
  axes.set_ylabel('true')
  for i in range(size):
    for j in range(size):
      if counts[i, j]:
        axes.text(j, i, str(counts[i, j]), ha='center', va='center', fontsize=font,
                  color='white' if fractions[i, j] > 0.5 else 'black')
  axes.figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04, label='fraction of true class')


@plain_text
def plot_confusion(path: str, report: Mapping[str, Any]) -> None:
  """The confusion matrix as a PNG, readable at any number of classes.

  Up to 30 classes: the full matrix, rows (true class) coloured by the fraction of that class's examples
  and every non-zero cell labelled with its count. Above 30 (e.g. ImageNet's 1,000) a full matrix is a
  grey square, so two panels show where the mistakes are: the 20 classes taken, in order, from the
  largest off-diagonal cells (similar classes end up next to each other, colours still fractions of the
  true class's full support), and a ranked bar chart of the top 20 (true -> predicted) pairs with counts.
  The whole matrix is in the numbers: per_class.csv names each class's most confused partner.
  """
  pyplot = _pyplot()
  confusion, support, names = report['confusion'], report['support'], report['class_names']
  num_classes = len(names)
  accuracy = report['top1_accuracy']
  if num_classes <= FULL_MATRIX_MAX_CLASSES:
    side = max(5.0, 0.4 * num_classes + 3)
    figure, axes = pyplot.subplots(figsize=(side + 1, side))
    _heatmap(axes, confusion, support, range(num_classes), names)
    axes.set_title(f'confusion matrix ({num_classes} classes, accuracy {accuracy:.2%}, balanced '
                   f'{report["balanced_accuracy"]:.2%})')
    figure.tight_layout()
    _save_figure(figure, path)
    return

  pairs = top_confusions(confusion, max(TOP_CONFUSED_PAIRS, 4 * TOP_CONFUSED_CLASSES))
  classes: list[int] = []
  for true, predicted, _ in pairs:
    for c in (true, predicted):
      if c not in classes and len(classes) < TOP_CONFUSED_CLASSES:
        classes.append(c)
  figure, (left, right) = pyplot.subplots(1, 2, figsize=(18, 8.5), gridspec_kw={'width_ratios': [1.1, 1]})
  if classes:
    _heatmap(left, confusion, support, classes, names)
    left.set_title(f'the {len(classes)} most confused classes')
    shown = pairs[:TOP_CONFUSED_PAIRS]
    positions = np.arange(len(shown))
    right.barh(positions, [count for _, _, count in shown], color='tab:red')
    pair_names = [f'{_short(names[t])} → {_short(names[p])}' for t, p, _ in shown]
    right.set_yticks(positions, pair_names, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel('examples')
    right.set_title(f'top {len(shown)} confusions (true → predicted)')
    for position, (_, _, count) in zip(positions, shown):
      right.text(count, position, f' {count}', va='center', fontsize=7)
    right.grid(axis='x', alpha=0.3)
  else:
    for axes in (left, right):
      axes.axis('off')
    left.text(0.5, 0.5, 'no mistakes', ha='center', va='center', fontsize=14)
  figure.suptitle(f'top confusions among {num_classes} classes (accuracy {accuracy:.2%})')
  figure.tight_layout()
  _save_figure(figure, path)


def _display_image(image: np.ndarray) -> tuple[np.ndarray, str | None]:
  """An image for imshow: uint8 as is; other dtypes (e.g. normalised floats) stretched to [0, 1]."""
  image = np.asarray(image)
  if image.ndim == 3 and image.shape[-1] == 1:
    image = image[..., 0]
  if image.dtype != np.uint8:
    image = image.astype(np.float64)
    low, high = image.min(), image.max()
    image = (image - low) / (high - low) if high > low else np.zeros_like(image)
  return image, ('gray' if image.ndim == 2 else None)


def _mistake_grid(pyplot, count: int, cell: tuple[float, float], min_width: float = 0.0):
  """A figure of `count` image panels, five a row, axes off; 'no mistakes' written when empty."""
  columns = max(1, min(5, count))
  grid_rows = max(1, math.ceil(count / columns))
  figure, axes = pyplot.subplots(grid_rows, columns, squeeze=False,
                                 figsize=(max(min_width, cell[0] * columns), cell[1] * grid_rows))
  for axis in axes.ravel():
    axis.axis('off')
  if not count:
    axes[0, 0].text(0.5, 0.5, 'no mistakes', ha='center', va='center', fontsize=12)
  return figure, axes


def _show_image(axis, image: np.ndarray) -> None:
  image, cmap = _display_image(image)
  # Grayscale keeps its absolute brightness (imshow would stretch each image's own range).
  grey_range = {'vmin': 0, 'vmax': 255 if image.dtype == np.uint8 else 1} if cmap else {}
  axis.imshow(image, cmap=cmap, interpolation='nearest', **grey_range)


@plain_text
def plot_mistakes(path: str, report: Mapping[str, Any], images: Images) -> None:
  """A grid of the (up to 25) most confident mistakes: the image, true and predicted class, probability.

  `images` is [N, H, W, C] (C = 1 or 3) in example order, or a function example index -> image, so an
  evaluation need not keep every image in memory.
  """
  pyplot = _pyplot()
  names = report['class_names']
  labels, predictions, confidence = report['labels'], report['predictions'], report['confidence']
  wrong = np.flatnonzero(predictions != labels)
  worst = wrong[np.argsort(-confidence[wrong], kind='stable')][:MAX_MISTAKES]
  get = images if callable(images) else images.__getitem__
  figure, axes = _mistake_grid(pyplot, len(worst), cell=(2.3, 2.6))
  for axis, example in zip(axes.ravel(), worst):
    _show_image(axis, get(int(example)))
    axis.set_title(f'true: {_short(names[labels[example]], 18)}\n'
                   f'pred: {_short(names[predictions[example]], 18)} ({confidence[example]:.2f})', fontsize=7)
  figure.suptitle(f'most confident mistakes ({len(worst)} of {len(wrong)})', fontsize=9)
  figure.tight_layout()
  _save_figure(figure, path)


@plain_text
def plot_reliability(path: str, report: Mapping[str, Any]) -> None:
  """Reliability diagram: accuracy per confidence bin against the diagonal, gaps in red; bin counts below."""
  pyplot = _pyplot()
  bins = report['reliability']
  lower, upper, count = bins['bin_lower'], bins['bin_upper'], bins['count']
  filled = count > 0
  width = upper - lower
  centre = (lower + upper) / 2
  accuracy = np.where(filled, bins['accuracy'], 0.0)
  confidence = np.where(filled, bins['confidence'], 0.0)
  multilabel = 'positives' in report  # every tag's probability against whether the tag is there
  figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(5.5, 6.5), sharex=True,
                                          gridspec_kw={'height_ratios': [3, 1]})
  observed = 'fraction with the tag' if multilabel else 'accuracy'
  top.bar(centre[filled], accuracy[filled], width[filled], color='tab:blue', edgecolor='black',
          linewidth=0.5, label=observed)
  gap_low = np.minimum(accuracy, confidence)[filled]
  top.bar(centre[filled], np.abs(confidence - accuracy)[filled], width[filled], bottom=gap_low,
          color='tab:red', alpha=0.35, edgecolor='tab:red', hatch='//', linewidth=0.5,
          label='gap to confidence')
  top.plot([0, 1], [0, 1], '--', color='gray', label='perfect calibration')
  top.set_xlim(0, 1)
  top.set_ylim(0, 1)
  top.set_ylabel(observed)
  top.legend(loc='upper left', fontsize=8)
  top.set_title(f'reliability (ECE {report["ece"]:.4f}, {NUM_CALIBRATION_BINS} bins)')
  top.grid(alpha=0.3)
  bottom.bar(centre, count, width, color='gray', edgecolor='black', linewidth=0.5)
  bottom.set_xlabel('probability of each tag of each example (sigmoid)' if multilabel
                    else 'confidence (max softmax probability)')
  bottom.set_ylabel('(example, class) pairs' if multilabel else 'examples')
  figure.tight_layout()
  _save_figure(figure, path)


MAX_TAG_BARS = 40  # classes in the multilabel TP/FP/FN chart; above, the classes with the most errors


def write_multilabel_csv(path: str, report: Mapping[str, Any]) -> None:
  """One row per class: class, support (examples with the tag), average_precision, threshold, and
  precision, recall, f1, tp, fp, fn at that threshold. Undefined values are empty cells."""

  def write(temporary: str) -> None:
    with open(temporary, 'w', newline='', encoding='utf-8') as f:
      writer = csv.writer(f)
      writer.writerow(['class', 'support', 'average_precision', 'threshold', 'precision', 'recall', 'f1',
                       'tp', 'fp', 'fn'])
      for c, name in enumerate(report['class_names']):
        writer.writerow([name, int(report['support'][c]), _csv_number(report['average_precision'][c]),
                         repr(float(report['class_thresholds'][c])), _csv_number(report['precision'][c]),
                         _csv_number(report['recall'][c]), _csv_number(report['f1_per_class'][c]),
                         int(report['tp'][c]), int(report['fp'][c]), int(report['fn'][c])])

  _atomic(path, write)


@plain_text
def plot_tag_counts(path: str, report: Mapping[str, Any]) -> None:
  """The multilabel counterpart of the confusion matrix: per class, stacked bars of true positives,
  missed tags (false negatives) and wrong tags (false positives) at each class's threshold.

  Up to 40 classes in class order; above, the 40 with the most errors, most first.
  """
  pyplot = _pyplot()
  names, tp, fp, fn = report['class_names'], report['tp'], report['fp'], report['fn']
  shown = list(range(len(names)))
  if len(names) > MAX_TAG_BARS:
    shown = sorted(shown, key=lambda c: (-(fp[c] + fn[c]), c))[:MAX_TAG_BARS]
  positions = np.arange(len(shown))
  figure, axes = pyplot.subplots(figsize=(9, max(3.0, 0.3 * len(shown) + 1.5)))
  left = np.zeros(len(shown))
  for counts, label, colour in ((tp, 'true positives', 'tab:green'), (fn, 'missed (false negatives)',
                                                                      'tab:orange'),
                                (fp, 'wrong (false positives)', 'tab:red')):
    values = counts[shown].astype(float)
    axes.barh(positions, values, left=left, color=colour, label=label)
    left += values
  axes.set_yticks(positions, [_short(names[c]) for c in shown], fontsize=8)
  axes.invert_yaxis()
  axes.set_xlabel('examples')
  axes.legend(fontsize=8, loc='lower right')
  axes.grid(axis='x', alpha=0.3)
  subset = f'the {len(shown)} of {len(names)} classes with the most errors' if len(shown) < len(names) \
      else f'{len(names)} classes'
  axes.set_title(f'tags at each class\'s threshold ({subset}; mAP {report["map"]:.3f}, '
                 f'micro-F1 {report["f1"]:.3f} at {report["threshold"]:.2f})', fontsize=9)
  figure.tight_layout()
  _save_figure(figure, path)


def _tag_list(names: Sequence[str], row: np.ndarray, width: int = 30) -> str:
  listed = ', '.join(names[c] for c in np.flatnonzero(row)) or '-'
  return _short(listed, width)


@plain_text
def plot_tag_mistakes(path: str, report: Mapping[str, Any], images: Images) -> None:
  """The (up to 25) images with the most confident wrong tag at each class's threshold: a tag
  predicted with probability p that is absent counts p, a tag missed at p counts 1 - p."""
  pyplot = _pyplot()
  names, probabilities = report['class_names'], report['probabilities']
  positives, predictions = report['positives'], report['predictions']
  wrongness = np.where(predictions == positives, 0.0, np.where(positives, 1.0 - probabilities, probabilities))
  worst_tag = wrongness.argmax(1)
  worst = wrongness[np.arange(len(wrongness)), worst_tag]
  wrong = np.flatnonzero(worst > 0)
  shown = wrong[np.argsort(-worst[wrong], kind='stable')][:MAX_MISTAKES]
  get = images if callable(images) else images.__getitem__
  figure, axes = _mistake_grid(pyplot, len(shown), cell=(2.5, 2.8), min_width=4.0)
  for axis, example in zip(axes.ravel(), shown):
    _show_image(axis, get(int(example)))
    tag = worst_tag[example]
    kind = 'missed' if positives[example, tag] else 'wrong'
    axis.set_title(f'true: {_tag_list(names, positives[example])}\n'
                   f'pred: {_tag_list(names, predictions[example])}\n'
                   f'{kind}: {_short(names[tag], 16)} ({probabilities[example, tag]:.2f})', fontsize=7)
  figure.suptitle(f'most confident wrong tags ({len(shown)} of {len(wrong)} images with any)', fontsize=9)
  figure.tight_layout()
  _save_figure(figure, path)


def write_eval_report(directory: str, logits: np.ndarray, labels: np.ndarray, class_names: Sequence[str],
                      images: Images | None = None, suffix: str = '', threshold: float = 0.0,
                      about: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Writes per_class{suffix}.csv, confusion{suffix}.png, reliability{suffix}.png and, with images,
  mistakes{suffix}.png into `directory` (each atomically); returns numbers for eval.json.

  The result: eval_ece, eval_top5_accuracy (when there are more than 5 classes), classes_without_examples
  (the classes the split lacks, when it lacks any) and report_files (the file names written, relative to
  `directory`). `images` as in `plot_mistakes`.

  Multilabel `labels` ([N, C] multi-hot) get the multilabel report (`threshold` as in
  `multilabel_report`): per_class.csv of `write_multilabel_csv`, confusion.png the per-class
  TP/FP/FN chart, mistakes.png the most confident wrong tags, reliability.png every tag's
  probability, and thresholds{suffix}.json (`thresholds_record`, with `about`).
  """
  if np.ndim(labels) == 2:
    return _write_multilabel_report(directory, logits, labels, class_names, images, suffix, threshold, about)
  report = eval_report(logits, labels, class_names)
  if images is not None and not callable(images) and len(images) != report['num_examples']:
    raise ValueError(f'{len(images)} images for {report["num_examples"]} examples')
  files.makedirs(directory)
  written = []

  def path(name: str) -> str:
    written.append(f'{name}{suffix}.{"csv" if name == "per_class" else "png"}')
    return os.path.join(directory, written[-1])

  write_per_class_csv(path('per_class'), report)
  plot_confusion(path('confusion'), report)
  if images is not None:
    plot_mistakes(path('mistakes'), report, images)
  plot_reliability(path('reliability'), report)
  summary: dict[str, Any] = {'eval_ece': report['ece']}
  if 'top5_accuracy' in report:
    summary['eval_top5_accuracy'] = report['top5_accuracy']
  # A split may lack classes (matched by name to training's): their per_class rows have support 0.
  if absent := [name for name, count in zip(report['class_names'], report['support']) if count == 0]:
    summary['classes_without_examples'] = absent
  summary['report_files'] = written
  return summary


def _write_multilabel_report(directory: str, logits: np.ndarray, labels: np.ndarray,
                             class_names: Sequence[str], images: Images | None, suffix: str, threshold: float,
                             about: Mapping[str, Any] | None) -> dict[str, Any]:
  report = multilabel_report(logits, labels, class_names, threshold)
  if images is not None and not callable(images) and len(images) != report['num_examples']:
    raise ValueError(f'{len(images)} images for {report["num_examples"]} examples')
  files.makedirs(directory)
  written = []

  def path(name: str, extension: str) -> str:
    written.append(f'{name}{suffix}.{extension}')
    return os.path.join(directory, written[-1])

  write_multilabel_csv(path('per_class', 'csv'), report)
  plot_tag_counts(path('confusion', 'png'), report)
  if images is not None:
    plot_tag_mistakes(path('mistakes', 'png'), report, images)
  plot_reliability(path('reliability', 'png'), report)
  record = thresholds_record(report, about)
  _atomic(path(THRESHOLDS_FILE.removesuffix('.json'), 'json'),
          lambda temporary: files.write_json(temporary, record))
  summary: dict[str, Any] = {'eval_ece': report['ece']}
  if absent := [name for name, count in zip(report['class_names'], report['support']) if count == 0]:
    summary['classes_without_examples'] = absent
  summary['report_files'] = written
  return summary


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
  """(steps, values) of one metric in step order; missing, non-numeric and non-finite values left out."""
  points = sorted((row['step'], float(row[key])) for row in rows
                  if isinstance(row.get(key), (int, float)) and not isinstance(row[key], bool)
                  and math.isfinite(row[key]))
  return [step for step, _ in points], [value for _, value in points]


def _curve_panels(keys: Sequence[str]) -> list[tuple[str, list[str]]]:
  """(panel title, metric keys) for the panels that have data: loss, accuracy, learning rate, throughput."""
  def metric(key: str) -> bool:
    return key.startswith(('train_', 'eval_'))

  panels = [
      ('loss', [k for k in keys if metric(k) and 'loss' in k]),
      ('accuracy', [k for k in keys if metric(k) and 'accuracy' in k]),
      ('mAP, F1', [k for k in keys if metric(k) and ('_map' in k or '_f1' in k)]),
      ('learning rate', [k for k in keys if k in ('learning_rate', 'lr')]),
      ('images / s', [k for k in keys if k.endswith('images_per_sec')]),
  ]
  # train_* before eval_*, then by name: the same colours in every run's picture.
  return [(title, sorted(found, key=lambda k: (not k.startswith('train_'), k)))
          for title, found in panels if found]


@plain_text
def write_curves(workdir: str) -> str:
  """Writes WORKDIR/curves.png from WORKDIR/metrics.jsonl (live or finished run) and returns its path.

  One panel each for loss (train, eval), accuracy (train, eval and every other eval_*accuracy* series, e.g.
  eval_top5_accuracy), mAP and F1 (multilabel), learning rate and images/s, for those present. A line
  cut off mid-write is skipped.
  """
  if not files.isdir(workdir):
    raise UserError(f'{workdir}: no such run directory')
  metrics_path = os.path.join(workdir, METRICS_FILE)
  if not files.isfile(metrics_path):
    raise UserError(f'{metrics_path} not found: is {workdir} a run\'s --workdir? '
                    '(the file appears at the first log step)')
  rows = [row for row in files.read_jsonl(metrics_path)
          if isinstance(row, dict) and isinstance(row.get('step'), (int, float))]
  keys = sorted({key for row in rows for key in row if key != 'step'})
  panels = [(title, [(key, _series(rows, key)) for key in found]) for title, found in _curve_panels(keys)]
  panels = [(title, [(key, series) for key, series in curves if series[0]]) for title, curves in panels]
  panels = [(title, curves) for title, curves in panels if curves]
  if not panels:
    raise UserError(f'{metrics_path} has no loss, accuracy or learning-rate values yet: '
                    'wait for the first log step')

  pyplot = _pyplot()
  from matplotlib.ticker import PercentFormatter
  columns = min(2, len(panels))
  grid_rows = math.ceil(len(panels) / columns)
  figure, axes = pyplot.subplots(grid_rows, columns, figsize=(6 * columns, 3.8 * grid_rows), squeeze=False)
  for axis in axes.ravel()[len(panels):]:
    axis.axis('off')
  for axis, (title, curves) in zip(axes.ravel(), panels):
    for key, (steps, values) in curves:
      # Eval points are few: markers keep a single point visible.
      axis.plot(steps, values, label=key, linewidth=1.2, marker='o' if len(steps) < 30 else None,
                markersize=3)
    axis.set_title(title)
    axis.set_xlabel('step')
    axis.grid(alpha=0.3)
    if title in ('accuracy', 'mAP, F1'):
      axis.yaxis.set_major_formatter(PercentFormatter(1.0))
    if title != 'learning rate' or len(curves) > 1:
      axis.legend(fontsize=8)
  last_step = max(row['step'] for row in rows)
  figure.suptitle(f'{_legible(os.path.basename(files.absolute(workdir).rstrip("/")))}: step {last_step}',
                  fontsize=11)
  figure.tight_layout()
  path = os.path.join(workdir, CURVES_FILE)
  _save_figure(figure, path)
  return path


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m flaxtpu.report WORKDIR`: writes WORKDIR/curves.png and prints its path; 2 on bad input."""
  parser = argparse.ArgumentParser(
      prog='python -m flaxtpu.report',
      description='Plot a live or finished run\'s curves from WORKDIR/metrics.jsonl into WORKDIR/curves.png.')
  parser.add_argument('workdir', help='the run\'s --workdir')
  args = parser.parse_args(argv)
  storage.configure()  # a gs:// workdir on an emulator: STORAGE_EMULATOR_HOST
  try:
    print(write_curves(args.workdir))
  except UserError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
