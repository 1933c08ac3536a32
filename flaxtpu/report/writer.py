"""An evaluation's report files: its numbers (`report.metrics`), their tables and its pictures.

`write_eval_report` is what the end of a run and `--mode=eval` call: per_class.csv, the pictures of
`plots.PICTURES` (confusion, mistakes, reliability) and, multilabel, thresholds.json.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flaxtpu.io import files
from flaxtpu.report import conformal, html, metrics, plots, tables


def write_eval_report(directory: str, logits: np.ndarray, labels: np.ndarray, class_names: Sequence[str],
                      images: plots.Images | None = None, suffix: str = '', threshold: float = 0.0,
                      about: Mapping[str, Any] | None = None,
                      calibration: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Writes per_class{suffix}.csv, confusion{suffix}.png, reliability{suffix}.png and, with images,
  mistakes{suffix}.png into `directory` (each atomically); returns numbers for eval.json.

  The result: eval_ece, eval_top5_accuracy (when there are more than 5 classes), classes_without_examples
  (the classes the split lacks, when it lacks any) and report_files (the file names written, relative to
  `directory`). `images` as in `plots.plot_mistakes`.

  Multilabel `labels` ([N, C] multi-hot) get the multilabel report (`threshold` as in
  `metrics.multilabel_report`): per_class.csv of `tables.write_multilabel_csv`, confusion.png the
  per-class TP/FP/FN chart, mistakes.png the most confident wrong tags, reliability.png every tag's
  probability, and thresholds{suffix}.json (`tables.thresholds_record`, with `about`).

  `calibration` (multiclass: the checkpoint's WORKDIR/calibration.json, whose temperature already
  divides `logits`) adds eval_ece_uncalibrated beside eval_ece, the prediction sets' eval_set_coverage
  and eval_set_size (and a set_size column, set_sizes.png). Last comes report{suffix}.html
  (`report.html`): the whole evaluation on one self-contained page.
  """
  multilabel = np.ndim(labels) == 2
  if multilabel:
    report = metrics.multilabel_report(logits, labels, class_names, threshold)
  else:
    report = metrics.eval_report(logits, labels, class_names)
  if images is not None and not callable(images) and len(images) != report['num_examples']:
    raise ValueError(f'{len(images)} images for {report["num_examples"]} examples')
  if calibration is not None and not multilabel:
    _add_calibration(report, logits, calibration)
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
    if task in picture.tasks and (images is not None or not picture.images) and (
        not picture.needs or picture.needs in report):
      picture.draw(path(picture.name, 'png'), report, *([images] if picture.images else []))
  if multilabel:
    tables.write_thresholds(path(tables.THRESHOLDS_FILE.removesuffix('.json'), 'json'), report, about)
  summary: dict[str, Any] = {'eval_ece': report['ece']}
  if 'top5_accuracy' in report:
    summary['eval_top5_accuracy'] = report['top5_accuracy']
  # A split may lack classes (matched by name to training's): their per_class rows have support 0.
  if absent := [name for name, count in zip(report['class_names'], report['support']) if count == 0]:
    summary['classes_without_examples'] = absent
  if 'ece_uncalibrated' in report:
    summary.update(eval_ece_uncalibrated=report['ece_uncalibrated'], temperature=report['temperature'],
                   eval_set_coverage=report['set_coverage'], eval_set_size=float(report['set_sizes'].mean()))
  summary['report_files'] = written
  html.write_page(path('report', 'html'), directory, suffix, report, summary)
  return summary


def _add_calibration(report: dict[str, Any], logits: np.ndarray, calibration: Mapping[str, Any]) -> None:
  """The calibrated evaluation's extra numbers in `report`: ECE and reliability before the temperature
  (the logits times it), and each example's prediction set (`report.conformal`)."""
  from flaxtpu.report import calibration as calibration_file  # pylint: disable=g-import-not-at-top
  temperature = float(calibration['temperature'])
  report['temperature'] = temperature
  report['ece_uncalibrated'], report['reliability_uncalibrated'] = metrics.confidence_calibration(
      logits, report['labels'], scale=temperature)
  sets = conformal.prediction_sets(logits, calibration_file.set_parameters(calibration), logits=True)
  report['set_sizes'] = sets.sum(axis=1)
  report.update(conformal.set_summary(sets, report['labels']), set_target=float(calibration['coverage']))
  per_class = np.bincount(report['labels'], weights=report['set_sizes'], minlength=report['num_classes'])
  report['class_set_size'] = per_class / np.where(report['support'] > 0, report['support'], np.nan)
