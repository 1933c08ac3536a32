"""Class weights (`dataset.class_weights`): none, the train split's balanced weights, or a CSV/JSON
file of class,weight read here; a loss weight per class (`Dataset.class_weights`)."""

from __future__ import annotations

import csv
import difflib
import io
import json
import logging
import math
from typing import Optional, Sequence

import numpy as np

from flaxtpu.data.dataset import Examples, listed_train_labels
from flaxtpu.data.sources.base import DataError
from flaxtpu.settings.errors import printable


def class_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """Examples per class (int64 [C]): of each index, or of each tag's positives in multi-hot rows."""
  if labels.ndim == 2:
    return labels.sum(axis=0, dtype=np.int64)
  return np.bincount(labels, minlength=num_classes).astype(np.int64)


def class_weights(setting: str, train: Examples, class_names: Sequence[str]) -> Optional[np.ndarray]:
  """`dataset.class_weights` as float32 [C] loss weights: None for `none`, the train split's
  `balanced_class_weights`, or a file's (`read_class_weights`); logged once."""
  if setting == 'none':
    return None
  if setting == 'balanced':
    counts = class_counts(listed_train_labels(train, 'class_weights=balanced'), len(class_names))
    weights = balanced_class_weights(counts, len(train))
    if absent := [printable(name) for name, count in zip(class_names, counts) if not count]:
      logging.info('dataset.class_weights=balanced: %d classes have no train example and weigh 1.0: %s',
                   len(absent), ', '.join(absent[:10]) + (', ...' if len(absent) > 10 else ''))
  else:
    weights = read_class_weights(setting, class_names)
  logging.info('dataset.class_weights=%s: weights from %.4g (%s) to %.4g (%s)', setting,
               weights.min(), printable(class_names[int(weights.argmin())]),
               weights.max(), printable(class_names[int(weights.argmax())]))
  return weights


def balanced_class_weights(counts: np.ndarray, num_examples: int) -> np.ndarray:
  """Keras' and sklearn's 'balanced' weights, n / (C x n_c): every class then weighs as much in the
  loss as a class of the average size, and the mean example weight stays 1 (C counts the classes
  present). Multi-hot: n_c is class c's positives among the n rows. An absent class weighs 1.0."""
  present = counts > 0
  weights = np.ones(len(counts), np.float32)
  weights[present] = num_examples / (present.sum() * counts[present])
  return weights


def read_class_weights(path: str, class_names: Sequence[str]) -> np.ndarray:
  """Weights from a CSV of class,weight rows (a header row is optional) or a JSON object
  {class: weight}; classes it does not list weigh 1.0 (a warning names them). Each mistake is one
  DataError line: a class the dataset lacks or weighed twice, a weight that is not a finite number
  >= 0, no class at all, or every weight 0 (the loss would be 0: nothing learnt)."""
  where = f'config.dataset.class_weights={path!r}'
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
    raise DataError(f'{where} cannot be read ({reason}); give a CSV of class,weight or a JSON object '
                    '{class: weight}, or choose none or balanced') from e
  is_json = path.lower().endswith('.json') or text.lstrip().startswith('{')
  entries = _json_weights(text, where) if is_json else _csv_weights(text, where, class_names)
  index = {name: i for i, name in enumerate(class_names)}
  weights = np.ones(len(class_names), np.float32)
  seen = set()
  for place, name, value in entries:
    if name not in index:
      known = ', '.join(printable(n) for n in class_names[:10]) + (', ...' if len(class_names) > 10 else '')
      near = difflib.get_close_matches(name, class_names, n=1)
      hint = f' (did you mean {printable(near[0])!r}?)' if near else ''
      raise DataError(f'{where}, {place}: class {printable(name)!r} is not one of the dataset\'s '
                      f'{len(class_names)} classes{hint} ({known}); correct the name or remove it')
    if name in seen:
      raise DataError(f'{where}, {place}: class {printable(name)!r} is weighted twice; keep one weight')
    weight = _weight(value)
    if weight is None:
      raise DataError(f'{where}, {place}: the weight of class {printable(name)!r} is {value!r}, not a '
                      'finite number >= 0; give a number such as 2.5')
    weights[index[name]] = weight
    seen.add(name)
  if not seen:
    raise DataError(f'{where} weighs no class; write class,weight lines (or {{class: weight}}), or choose '
                    'none or balanced')
  if not weights.any():
    raise DataError(f'{where} weighs every class 0, so the loss would be 0 and nothing learnt; give some '
                    'class a weight > 0')
  if unlisted := [printable(name) for name in class_names if name not in seen]:
    logging.warning('%s does not list %d of the %d classes; they weigh 1.0: %s', where, len(unlisted),
                    len(class_names), ', '.join(unlisted[:10]) + (', ...' if len(unlisted) > 10 else ''))
  return weights


# First cells that make a first row a header whatever the class names (a class named 'glass' is near 'class').
HEADER_WORDS = ('class', 'classes', 'label', 'labels', 'name', 'category', 'class_name')


def _weight(value) -> Optional[float]:
  """A class weight as a float, or None when it is not a finite number >= 0."""
  if isinstance(value, bool):
    return None
  try:
    weight = float(value)
  except (TypeError, ValueError):
    return None
  return weight if math.isfinite(weight) and weight >= 0 else None


def _json_weights(text: str, where: str) -> list[tuple[str, str, object]]:
  """(place, class, weight) of a JSON object {class: weight}."""
  try:
    weights = json.loads(text)
  except ValueError as e:
    raise DataError(f'{where} is not valid JSON ({e}); write an object {{"class": weight, ...}}') from e
  if not isinstance(weights, dict):
    raise DataError(f'{where} holds a JSON {type(weights).__name__}, not an object; write '
                    '{"class": weight, ...}')
  return [(f'key {name!r}', name, value) for name, value in weights.items()]


def _csv_weights(text: str, where: str, class_names: Sequence[str]) -> list[tuple[str, str, str]]:
  """(place, class, weight) of each class,weight row; the first row is a header when it names no
  class and holds no number (class,weight), unless its first cell is a near miss of a class's name
  (dgo,heavy is a misspelt row, read and refused as such)."""
  rows = [(number, [cell.strip() for cell in row]) for number, row in
          enumerate(csv.reader(io.StringIO(text)), start=1) if any(cell.strip() for cell in row)]
  if rows and rows[0][1][0] not in class_names and _weight(rows[0][1][-1]) is None:
    first = rows[0][1][0]
    if first.lower() in HEADER_WORDS or not difflib.get_close_matches(first, class_names, n=1):
      rows = rows[1:]
  entries = []
  for number, row in rows:
    if len(row) != 2:
      raise DataError(f'{where}, line {number}: {len(row)} cells ({printable(",".join(row))[:60]}); '
                      'write one class,weight pair a line')
    entries.append((f'line {number}', row[0], row[1]))
  return entries
