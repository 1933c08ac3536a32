"""The files of numbers an evaluation leaves: per_class.csv (multiclass or multilabel) and thresholds.json.

Each is written atomically (a temporary file renamed onto the name, or uploaded whole to an object
store), so a crash never leaves half a file. Undefined numbers (NaN) are empty CSV cells, not 0.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from typing import Any, Sequence

from flaxtpu.io import files
from flaxtpu.report import metrics
from flaxtpu.settings.errors import UserError, printable

THRESHOLDS_FILE = 'thresholds.json'


def _csv_number(value: float) -> str:
  return '' if math.isnan(value) else repr(float(value))


def write_per_class_csv(path: str, report: Mapping[str, Any]) -> None:
  """One row per class: class, support, correct, precision, recall, accuracy, most_confused_with (+ count),
  and with prediction sets (a calibrated evaluation) set_size, the mean set size of the class's examples.

  Undefined precision (never predicted) or recall (no examples) is an empty cell, not 0.
  """
  names = report['class_names']
  other, other_count = metrics.most_confused_with(report['confusion'])

  def write(temporary: str) -> None:
    with open(temporary, 'w', newline='', encoding='utf-8') as f:
      writer = csv.writer(f)
      sets = 'class_set_size' in report  # a calibrated evaluation: each class's mean prediction-set size
      writer.writerow(['class', 'support', 'correct', 'precision', 'recall', 'accuracy',
                       'most_confused_with', 'most_confused_count'] + (['set_size'] if sets else []))
      for c, name in enumerate(names):
        writer.writerow([name, int(report['support'][c]), int(report['correct'][c]),
                         _csv_number(report['precision'][c]), _csv_number(report['recall'][c]),
                         _csv_number(report['accuracy'][c]), names[other[c]] if other[c] >= 0 else '',
                         int(other_count[c])] + ([_csv_number(report['class_set_size'][c])] if sets else []))

  files.atomic_write(path, write)



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

  files.atomic_write(path, write)



def thresholds_record(report: Mapping[str, Any], about: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """What THRESHOLDS_FILE holds: each class's threshold, the global one, how they were chosen, and
  `about` (which step, weights and split they were chosen on), for --mode=predict and the export."""
  return {**(about or {}), 'threshold': report['threshold'], 'chosen_by': report['threshold_source'],
          'class_thresholds': {name: float(value) for name, value in
                               zip(report['class_names'], report['class_thresholds'])}}



def write_thresholds(path: str, report: Mapping[str, Any], about: Mapping[str, Any] | None = None) -> None:
  """Writes `thresholds_record(report, about)` as JSON to `path` (a THRESHOLDS_FILE)."""
  record = thresholds_record(report, about)
  files.atomic_write(path, lambda temporary: files.write_json(temporary, record))


def read_thresholds(path: str, class_names: Sequence[str]) -> dict[str, Any] | None:
  """A THRESHOLDS_FILE (a person may have edited it), checked as strictly as the config: None when it
  is another model's (no class in common); else its record, each class's threshold a finite number
  from 0 to 1 and its classes the model's. Anything else is one UserError line naming the file, the
  class and the value."""
  fix = ('fix it, or re-run --mode=eval to rewrite the file, or set --config.eval.threshold to use one '
         'threshold for every tag')
  try:
    with files.open_file(path, encoding='utf-8') as f:
      record = json.load(f)
  except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
    raise UserError(f'{path} cannot be read as JSON ({type(e).__name__}: {" ".join(str(e).split())}); '
                    f'{fix}') from None
  saved = record.get('class_thresholds') if isinstance(record, dict) else None
  if not isinstance(saved, dict):
    raise UserError(f'{path} holds no "class_thresholds" object {{class: threshold}}; {fix}')
  if not set(saved) & set(class_names):
    return None  # another model's classes
  if missing := [name for name in class_names if name not in saved]:
    raise UserError(f'{path} has no threshold for class {printable(missing[0])!r}'
                    + (f' (and {len(missing) - 1} more)' if len(missing) > 1 else '') + f'; {fix}')
  if extra := [name for name in saved if name not in set(class_names)]:
    raise UserError(f'{path} has a threshold for {printable(extra[0])!r}, which is not one of the '
                    f"model's {len(class_names)} classes; {fix}")
  for name in class_names:
    value = saved[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
      raise UserError(f'{path}: the threshold of class {printable(name)!r} is {json.dumps(value)}, not a '
                      f'number from 0 to 1; {fix}')
  return record
