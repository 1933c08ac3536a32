"""An evaluation's report files: its numbers (`report.metrics`), their tables and its pictures.

`write_eval_report` is what the end of a run and `--mode=eval` call: per_class.csv, the pictures of
`plots.PICTURES` (confusion, mistakes, reliability) and, multilabel, thresholds.json.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flaxtpu import files
from flaxtpu.report import metrics, plots, tables


def write_eval_report(directory: str, logits: np.ndarray, labels: np.ndarray, class_names: Sequence[str],
                      images: plots.Images | None = None, suffix: str = '', threshold: float = 0.0,
                      about: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Writes per_class{suffix}.csv, confusion{suffix}.png, reliability{suffix}.png and, with images,
  mistakes{suffix}.png into `directory` (each atomically); returns numbers for eval.json.

  The result: eval_ece, eval_top5_accuracy (when there are more than 5 classes), classes_without_examples
  (the classes the split lacks, when it lacks any) and report_files (the file names written, relative to
  `directory`). `images` as in `plots.plot_mistakes`.

  Multilabel `labels` ([N, C] multi-hot) get the multilabel report (`threshold` as in
  `metrics.multilabel_report`): per_class.csv of `tables.write_multilabel_csv`, confusion.png the
  per-class TP/FP/FN chart, mistakes.png the most confident wrong tags, reliability.png every tag's
  probability, and thresholds{suffix}.json (`tables.thresholds_record`, with `about`).
  """
  multilabel = np.ndim(labels) == 2
  if multilabel:
    report = metrics.multilabel_report(logits, labels, class_names, threshold)
  else:
    report = metrics.eval_report(logits, labels, class_names)
  if images is not None and not callable(images) and len(images) != report['num_examples']:
    raise ValueError(f'{len(images)} images for {report["num_examples"]} examples')
  files.makedirs(directory)
  written = []

  def path(name: str, extension: str) -> str:
    written.append(f'{name}{suffix}.{extension}')
    return os.path.join(directory, written[-1])

  if multilabel:
    tables.write_multilabel_csv(path('per_class', 'csv'), report)
  else:
    tables.write_per_class_csv(path('per_class', 'csv'), report)
  task = 'multilabel' if multilabel else 'classification'
  for picture in plots.PICTURES:
    if task in picture.tasks and (images is not None or not picture.images):
      picture.draw(path(picture.name, 'png'), report, *([images] if picture.images else []))
  if multilabel:
    tables.write_thresholds(path(tables.THRESHOLDS_FILE.removesuffix('.json'), 'json'), report, about)
  summary: dict[str, Any] = {'eval_ece': report['ece']}
  if 'top5_accuracy' in report:
    summary['eval_top5_accuracy'] = report['top5_accuracy']
  # A split may lack classes (matched by name to training's): their per_class rows have support 0.
  if absent := [name for name, count in zip(report['class_names'], report['support']) if count == 0]:
    summary['classes_without_examples'] = absent
  summary['report_files'] = written
  return summary
