"""Label files: a CSV or JSON Lines file of image paths and labels (`dataset.labels`), the images
anywhere under a folder (`dataset.folder`, or the file's own)."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from typing import NamedTuple, Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu.data.preprocess import IMAGE_EXTENSIONS
from flaxtpu.data.sources.base import ALL, DataError, Split, printable
from flaxtpu.data.sources.folder import FileRecords, inside
from flaxtpu.data.sources.tagged import (
  LABEL_COLUMNS,
  TAG_SEPARATOR,
  Catalog,
  SeveralTags,
  TaggedSource,
  label_values,
  one_label,
  pick_column,
  several_tags,
  sorted_classes,
)

IMAGE_COLUMNS = ('path', 'image', 'img', 'file', 'filename')  # a label file's image column, if not set
SPLIT_COLUMN = 'split'


class LabelRow(NamedTuple):
  line: int  # in the file, from 1
  image: str  # as written
  tags: tuple[str, ...]
  split: Optional[str]  # None without a split column


def read_label_file(path: str, image_column: str = '', label_column: str = '') -> list[LabelRow]:
  """The rows of a CSV (with a header, or rows path,label[,label...]) or JSON Lines label file.

  Anything wrong with the file itself (not UTF-8, ragged rows, bad JSON, columns it cannot tell
  apart) is a DataError naming the line.
  """
  try:
    with open(path, encoding='utf-8-sig', newline='') as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise DataError(f'{path} is not UTF-8 text (byte {e.start}); save it as UTF-8') from None
  except OSError as e:
    raise DataError(f'cannot read config.dataset.labels={path!r} ({e.strerror or e}); point it at a CSV or '
                    'JSON Lines file of image paths and labels') from None
  if path.lower().endswith(('.jsonl', '.ndjson', '.json')) or text.lstrip().startswith('{'):
    rows = _json_lines_rows(path, text, image_column, label_column)
  else:
    rows = _csv_rows(path, text, image_column, label_column)
  if not rows:
    raise DataError(f'{path} holds no rows; write one row per image (path and label)')
  return rows


def _tags(cell: str, separated: bool) -> tuple[str, ...]:
  """A label cell's tags: split at ';' unless the column holds one label (SeveralTags if it holds
  several); blanks dropped."""
  pieces = cell.split(TAG_SEPARATOR) if separated else [one_label(cell)]
  return tuple(dict.fromkeys(piece.strip() for piece in pieces if piece.strip()))


class _Columns(NamedTuple):
  image: str
  label: str
  split: Optional[str]


def _columns(names: Sequence[str], where: str, image_column: str, label_column: str) -> _Columns:
  """Which of a label file's columns (or a JSON line's keys) hold the image, the label and the split.

  A column it would not read is an error (a misspelt `split` would otherwise be ignored), unless
  both columns are named in the config: then the others are the user's own.
  """
  image = pick_column(names, image_column, IMAGE_COLUMNS, 'image_column', 'image', where)
  label = pick_column(names, label_column, LABEL_COLUMNS, 'label_column', 'label', where)
  split = next((name for name in names if name.strip().lower() == SPLIT_COLUMN), None)
  unknown = [name for name in names if name not in (image, label, split)]
  if unknown and not (image_column and label_column):
    raise DataError(f'{where} has columns flaxtpu does not read: {", ".join(map(repr, unknown))}; it reads '
                    f'an image column ({", ".join(IMAGE_COLUMNS)}), a label column (label, or labels with '
                    f'tags separated by {TAG_SEPARATOR}) and {SPLIT_COLUMN}; rename or remove them, or name '
                    'the two columns with --config.dataset.image_column and --config.dataset.label_column '
                    'to ignore the rest')
  return _Columns(image, label, split)


def _csv_rows(path: str, text: str, image_column: str, label_column: str) -> list[LabelRow]:
  reader = csv.reader(io.StringIO(text), delimiter='\t' if path.lower().endswith('.tsv') else ',',
                      strict=True)
  records = []
  try:
    for cells in reader:
      if any(cell.strip() for cell in cells):
        records.append((reader.line_num, cells))
  except csv.Error as e:
    raise DataError(f'line {reader.line_num} of {path} is not valid CSV ({e}); fix the quoting') from None
  if not records:
    return []
  _, first = records[0]
  recognised = {*IMAGE_COLUMNS, *LABEL_COLUMNS, SPLIT_COLUMN,
                *(name.strip().lower() for name in (image_column, label_column) if name)}
  if not recognised & {cell.strip().lower() for cell in first}:
    if not first[0].strip().lower().endswith(IMAGE_EXTENSIONS):
      raise DataError(f'the first row of {path} ({", ".join(first[:4])}) is neither a header naming its '
                      f'columns ({"/".join(IMAGE_COLUMNS)}, label or labels, split) nor a row path,label '
                      f'(its first cell is not an image file name); add a header row')
    # Header-less: path,label[,label...]; every cell after the path holds tags.
    return [LabelRow(line, cells[0].strip(), _tags(TAG_SEPARATOR.join(cells[1:]), True), None)
            for line, cells in records]
  columns = _columns(first, path, image_column, label_column)
  at = {name: column for column, name in enumerate(first)}
  rows = []
  for line, cells in records[1:]:
    if len(cells) != len(first):
      raise DataError(f'line {line} of {path} has {len(cells)} cells but the header has {len(first)} '
                      'columns; quote cells that hold a comma ("a,b"), or fix the row')
    split = cells[at[columns.split]].strip() if columns.split else None
    if columns.split and not split:
      raise DataError(f'line {line} of {path} has no {columns.split}; give every row one (train, test, ...) '
                      'or remove the column')
    try:
      tags = _tags(cells[at[columns.label]], columns.label.strip().lower() != 'label')
    except SeveralTags as e:
      raise DataError(f'line {line} of {path}: {e}, but {several_tags(columns.label)}') from None
    rows.append(LabelRow(line, cells[at[columns.image]].strip(), tags, split))
  return rows


def _json_lines_rows(path: str, text: str, image_column: str, label_column: str) -> list[LabelRow]:
  rows, resolved = [], {}
  for line, content in enumerate(text.split('\n'), 1):
    if not content.strip():
      continue
    where = f'line {line} of {path}'
    try:
      record = json.loads(content)
    except json.JSONDecodeError as e:
      raise DataError(f'{where} is not valid JSON ({e.msg} at column {e.colno}); write one JSON object '
                      'per line') from None
    if not isinstance(record, dict):
      raise DataError(f'{where} is not a JSON object; write one per line, e.g. '
                      '{"path": "a.jpg", "label": "cat"}')
    keys = tuple(record)
    if keys not in resolved:
      resolved[keys] = _columns(keys, where, image_column, label_column)
    columns = resolved[keys]
    image, split = record[columns.image], record.get(columns.split) if columns.split else None
    if not isinstance(image, str):
      raise DataError(f'{where}: {columns.image!r} is {json.dumps(image)}, not a file path')
    if columns.split and (not isinstance(split, str) or not split.strip()):
      raise DataError(f'{where} has no {columns.split} name; give every line one (train, test, ...) '
                      'or leave the key out everywhere')
    try:
      values = label_values(record[columns.label], columns.label.strip().lower() != 'label')
    except SeveralTags as e:
      raise DataError(f'{where}: {e}, but {several_tags(columns.label)}') from None
    except ValueError as e:
      raise DataError(f'{where}: {e}; write a class name, a list of them, or null') from None
    rows.append(LabelRow(line, image.strip(), tuple(str(value) for value in values),
                         split.strip() if split else None))
  return rows


def _relative_image(root: str, root_real: str, image: str, where: str) -> str:
  """An image path of a label file as a path inside `root` (an absolute root), normalised."""
  if not image:
    raise DataError(f'{where} has no image path; write one (relative to the image folder) or remove the row')
  path = os.path.normpath(os.path.join(root, image))
  if inside(path, root):
    return os.path.relpath(path, root)
  real = os.path.realpath(path)  # an absolute path through a link to the folder
  if inside(real, root_real):
    return os.path.relpath(real, root_real)
  raise DataError(f'{where}: image {printable(image)} is outside the image folder {printable(root)}; write '
                  'paths inside it (relative to it), or set --config.dataset.folder to a folder that holds '
                  'every image')


class LabelFileSource(TaggedSource):
  """Images anywhere under a folder, labelled by a CSV or JSON Lines file (`dataset.labels`).

  The folder is `dataset.folder`, or the label file's own. Paths are checked once (inside the
  folder, each image once, each file there); the images stream or are cached as for folders.
  """
  kind, key, title = 'labels', 'labels', 'label file'

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    super().__init__(dataset, task)
    self.path = dataset.labels
    self.root = os.path.abspath(dataset.folder or os.path.dirname(os.path.abspath(self.path)))
    self._catalog, self._paths = None, None

  def catalog(self, split_names, optional):
    if self._catalog is None:
      self._catalog = self._read()
    return self._catalog

  def split(self, spec, positions, labels):
    return Split(name=spec, records=FileRecords(self.root, self._paths[positions]), labels=labels)

  def _read(self) -> Catalog:
    if not os.path.isfile(self.path):
      raise DataError(f'config.dataset.labels={self.path!r} is not a file; point it at a CSV or JSON Lines '
                      'file of image paths and labels')
    if not os.path.isdir(self.root):
      raise DataError(f'the image folder {self.root} (config.dataset.folder) is not a directory; set it to '
                      "the folder the label file's paths are relative to")
    root_real, seen, rows, missing = os.path.realpath(self.root), {}, [], []
    for row in read_label_file(self.path, self.image_column, self.label_column):
      relative = _relative_image(self.root, root_real, row.image, f'line {row.line} of {self.path}')
      if relative in seen:
        raise DataError(f'image {printable(relative)} is listed twice in {self.path}, on lines '
                        f'{seen[relative]} and {row.line}; keep one row per image')
      seen[relative] = row.line
      (rows if os.path.isfile(os.path.join(self.root, relative)) else missing).append((relative, row))
    if missing:
      relative, row = missing[0]
      problem = (f'image {printable(os.path.join(self.root, relative))} (line {row.line} of {self.path}) '
                 'does not exist')
      if not self.skip_corrupt:
        more = f' ({len(missing) - 1} more rows name missing images)' if len(missing) > 1 else ''
        raise DataError(f'{problem}; fix the path (relative to {self.root}) or remove the row, or set '
                        f'--config.dataset.skip_corrupt=true to skip such rows{more}')
      logging.warning('skipping %d rows of %s whose image does not exist (dataset.skip_corrupt), e.g. %s',
                      len(missing), self.path, problem)
    lines = [row.line for _, row in rows]
    self._paths = np.asarray([os.fsencode(relative) for relative, _ in rows])
    has_split = any(row.split is not None for _, row in rows)
    if has_split and (unsplit := next((row for _, row in rows if row.split is None), None)):
      raise DataError(f'line {unsplit.line} of {self.path} has no {SPLIT_COLUMN} while other lines have one; '
                      'give every line a split (train, test, ...) or none')
    tags = [row.tags for _, row in rows]
    return Catalog(
        what=self.path, tags=tags,
        split_of=np.asarray([row.split for _, row in rows], object) if has_split else None,
        class_names=sorted_classes(tag for row_tags in tags for tag in row_tags),
        where=lambda i: f'line {lines[i]} of {self.path} ({printable(os.fsdecode(self._paths[i]))})',
        absent=self._absent)

  def _absent(self, split: str, present: list) -> str:
    if present == [ALL]:
      return (f"{self.path} has no {SPLIT_COLUMN} column, so its one split is '{ALL}': hold out a part with "
              f"--config.dataset.train_split='{ALL}[:80%]' --config.dataset.eval_split='{ALL}[80%:]' "
              f'(or add a {SPLIT_COLUMN} column)')
    return (f'split {split!r} is not in {self.path}; its {SPLIT_COLUMN} column holds: {", ".join(present)} '
            '(set --config.dataset.train_split / eval_split)')
