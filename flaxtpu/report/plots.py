"""Every picture flaxtpu draws of a run: one function each, matplotlib imported only when one is drawn.

An evaluation's pictures are listed in PICTURES, in the order they are written (`report.writer`):
the confusion matrix (multilabel: each class's TP/FP/FN), the most confident mistakes and the
reliability diagram. A new picture is a function here and one line in that list. `write_curves`
draws a run's curves.png from its metrics.jsonl (`python -m flaxtpu.report WORKDIR`).

Every plot draws text as written (`plain_text`: no TeX math, fonts for any script) and saves its
PNG atomically.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from flaxtpu.io import files
from flaxtpu.report.metrics import NUM_CALIBRATION_BINS, top_confusions
from flaxtpu.settings.errors import UserError

METRICS_FILE = 'metrics.jsonl'
CURVES_FILE = 'curves.png'
FULL_MATRIX_MAX_CLASSES = 30  # Above this a full heatmap is unreadable: show the top confusions only.
TOP_CONFUSED_CLASSES = 20
TOP_CONFUSED_PAIRS = 20
MAX_MISTAKES = 25
MAX_TAG_BARS = 40  # classes in the multilabel TP/FP/FN chart; above, the classes with the most errors

Images = np.ndarray | Callable[[int], np.ndarray]


def _pyplot():
  import matplotlib  # Imported here: importing this module, or the numbers, never needs it.
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
    files.atomic_write(path, lambda temporary: figure.savefig(temporary, format='png', dpi=100))
  finally:
    pyplot.close(figure)


def _short(name: str, width: int = 24) -> str:
  return _legible(name if len(name) <= width else name[:width - 1] + '…')


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
  title = f'reliability (ECE {report["ece"]:.4f}, {NUM_CALIBRATION_BINS} bins)'
  if (before := report.get('reliability_uncalibrated')) is not None:  # a calibrated evaluation
    seen = before['count'] > 0
    top.plot(((before['bin_lower'] + before['bin_upper']) / 2)[seen], before['accuracy'][seen], 'o-',
             color='tab:orange', label=f'before calibration (ECE {report["ece_uncalibrated"]:.4f})')
    title = (f'reliability: ECE {report["ece_uncalibrated"]:.4f} -> {report["ece"]:.4f} '
             f'(T = {report["temperature"]:.3f})')
  top.set_xlim(0, 1)
  top.set_ylim(0, 1)
  top.set_ylabel(observed)
  top.legend(loc='upper left', fontsize=8)
  top.set_title(title)
  top.grid(alpha=0.3)
  bottom.bar(centre, count, width, color='gray', edgecolor='black', linewidth=0.5)
  bottom.set_xlabel('probability of each tag of each example (sigmoid)' if multilabel
                    else 'confidence (max softmax probability)')
  bottom.set_ylabel('(example, class) pairs' if multilabel else 'examples')
  figure.tight_layout()
  _save_figure(figure, path)


@plain_text
def plot_set_sizes(path: str, report: Mapping[str, Any]) -> None:
  """How many classes each example's prediction set holds: correct and misclassified examples apart."""
  pyplot = _pyplot()
  sizes, hits = report['set_sizes'], report['predictions'] == report['labels']
  edges = np.arange(-0.5, report['num_classes'] + 1.5)
  figure, axis = pyplot.subplots(figsize=(6, 3.5))
  axis.hist([sizes[hits], sizes[~hits]], bins=edges, stacked=True, color=['tab:blue', 'tab:red'],
            label=[f'correct (mean {sizes[hits].mean() if hits.any() else 0:.2f})',
                   f'misclassified (mean {sizes[~hits].mean() if (~hits).any() else 0:.2f})'])
  axis.set_xlabel('classes in the prediction set')
  axis.set_ylabel('examples')
  axis.set_title(f'prediction sets: coverage {report["set_coverage"]:.3f} (target '
                 f'{report["set_target"]:.2f}), mean size {sizes.mean():.2f}')
  axis.legend(fontsize=8)
  figure.tight_layout()
  _save_figure(figure, path)


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
def write_curves(workdir: str, path: str = '') -> str:
  """Writes WORKDIR/curves.png (or `path`) from WORKDIR/metrics.jsonl (live or finished run); returns
  its path.

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
  path = path or os.path.join(workdir, CURVES_FILE)
  _save_figure(figure, path)
  return path



class Picture(NamedTuple):
  """One picture of an evaluation report: NAME{suffix}.png, drawn for the tasks named by
  `draw(path, report)`, or with `images` by `draw(path, report, images)` and left out when the
  evaluation has no images."""
  name: str
  tasks: tuple[str, ...]
  draw: Callable[..., None]
  images: bool = False
  needs: str = ''  # a report key the picture draws (left out without it), e.g. a calibrated evaluation's


# An evaluation report's pictures, in the order written. A new picture: its function above and a line here.
PICTURES = [
    Picture('confusion', ('classification',), plot_confusion),
    Picture('confusion', ('multilabel',), plot_tag_counts),
    Picture('mistakes', ('classification',), plot_mistakes, images=True),
    Picture('mistakes', ('multilabel',), plot_tag_mistakes, images=True),
    Picture('reliability', ('classification', 'multilabel'), plot_reliability),
    Picture('set_sizes', ('classification',), plot_set_sizes, needs='set_sizes'),
]
