"""Parquet files (`dataset.parquet`), e.g. a Hugging Face datasets copy: an image column and a
label column; labels read for every row at once, images by row group when used."""

from __future__ import annotations

import glob
import json
import os
import re
import threading
from typing import Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu.data.sources.base import ALL, DataError, IndexedRecords, Split
from flaxtpu.data.sources.tagged import (
  LABEL_COLUMNS,
  Catalog,
  SeveralTags,
  TaggedSource,
  label_values,
  pattern_files,
  pick_column,
  several_tags,
  tags_of_files,
)

PARQUET_IMAGE_COLUMNS = ('image', 'img', 'path')
_row_group: dict = {}  # (path, row group, column) -> its cells: this process's last row group read
_row_group_lock = threading.Lock()


class _ParquetImages:
  """The image cells of parquet files read by row (the store of a Split's `IndexedRecords`). A row group
  is read whole (Parquet's smallest read), so each process keeps its last one."""

  def __init__(self, files: tuple[str, ...], column: str, file_of: np.ndarray, row_of: np.ndarray,
               group_starts: tuple[np.ndarray, ...]):
    self.files, self.column, self.file_of, self.row_of = files, column, file_of, row_of
    self.group_starts = group_starts  # per file: the first row of each row group

  def __len__(self) -> int:
    return len(self.file_of)

  def __getitem__(self, index: int) -> tuple[object, None]:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    path, row = self.files[self.file_of[index]], int(self.row_of[index])
    starts = self.group_starts[self.file_of[index]]
    group = int(np.searchsorted(starts, row, side='right')) - 1
    key = (path, group, self.column)
    with _row_group_lock:
      if key not in _row_group:
        _row_group.clear()
        _row_group[key] = pq.ParquetFile(path).read_row_group(group, columns=[self.column]).column(0)
      cell = _row_group[key][row - int(starts[group])].as_py()
    if isinstance(cell, dict):  # a Hugging Face Image: {bytes, path}
      cell = cell.get('bytes') or cell.get('path')
    if isinstance(cell, str) and cell:
      cell = os.path.join(os.path.dirname(path), cell)  # relative to the parquet file
    if not cell:
      raise ValueError(f'its {self.column!r} cell holds no image')
    return cell, None

  def describe(self, index: int) -> str:
    return f'row {int(self.row_of[index])} of {self.files[self.file_of[index]]}'


def _hf_class_names(metadata: Optional[dict], column: str) -> Optional[list[str]]:
  """The class names a Hugging Face `datasets` parquet file keeps for `column`: a ClassLabel, or a
  Sequence (List) of ClassLabel for multi-label, in the schema metadata b'huggingface'."""
  try:
    feature = json.loads(metadata[b'huggingface'])['info']['features'][column]
  except (KeyError, TypeError, ValueError):
    return None
  if isinstance(feature, list) and len(feature) == 1:  # [ClassLabel]: the list shorthand
    feature = feature[0]
  if isinstance(feature, dict) and isinstance(feature.get('feature'), dict):  # Sequence / List
    feature = feature['feature']
  if isinstance(feature, dict) and feature.get('_type') == 'ClassLabel' and 'names' in feature:
    return [str(name) for name in feature['names']]
  return None


def _hf_split(path: str) -> str:
  """A Hugging Face file's split: train-00000-of-00004.parquet -> train; default/test/0000.parquet
  -> test."""
  word = re.split(r'[-.]', os.path.basename(path))[0]
  return os.path.basename(os.path.dirname(path)) if word.isdigit() else word


class ParquetSource(TaggedSource):
  """Parquet files (`dataset.parquet`) with an image column and a label column.

  A file or a glob is one split, `all`; a folder's files are split by name as Hugging Face lays
  them out (data/train-00000-of-00004.parquet); `{split}` names the split. Labels are read for
  every row at once (one column), images by row when used.
  """
  kind, key, title = 'parquet', 'parquet', 'parquet'

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    super().__init__(dataset, task)
    self.pattern = dataset.parquet
    self.images = None

  def split(self, spec, positions, labels):
    return Split(name=spec, records=IndexedRecords(self.images, positions), labels=labels)

  def _files(self, split_names: Sequence[str], optional: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    """(file, split) of the files to read; split None where there is one split, `all`."""
    if '{split}' in self.pattern:
      files = [(path, name) for name in split_names for path in pattern_files(self.pattern, 'parquet', name)]
      for name in (name for name in optional if name not in split_names):
        try:
          files += [(path, name) for path in pattern_files(self.pattern, 'parquet', name)]
        except DataError:
          pass  # evaluating alone on data without the training split
      return files
    if os.path.isdir(self.pattern):
      found = sorted(glob.glob(os.path.join(self.pattern, '**', '*.parquet'), recursive=True))
      if not found:
        raise DataError(f'config.dataset.parquet={self.pattern!r} holds no .parquet files; point it at a '
                        'parquet file, a folder of them or a glob')
      return [(path, _hf_split(path)) for path in found]
    return [(path, None) for path in pattern_files(self.pattern, 'parquet')]

  def catalog(self, split_names, optional):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    files = self._files(split_names, optional)
    values, file_of, row_of, starts, column, lists = [], [], [], [], None, []
    for number, (path, _) in enumerate(files):
      try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        image = pick_column(schema.names, self.image_column, PARQUET_IMAGE_COLUMNS, 'image_column', 'image',
                             path)
        label = pick_column(schema.names, self.label_column, LABEL_COLUMNS, 'label_column', 'label', path)
        image_type = schema.field(image).type
        if not (pa.types.is_binary(image_type) or pa.types.is_large_binary(image_type)
                or pa.types.is_string(image_type) or pa.types.is_large_string(image_type)
                or pa.types.is_struct(image_type) and image_type.get_field_index('bytes') >= 0):
          raise DataError(f'column {image!r} of {path} holds {image_type}, not images (encoded bytes, a '
                          "path, or Hugging Face's {bytes, path}); set --config.dataset.image_column")
        if column not in (None, image):
          raise DataError(f'{path} keeps its images in column {image!r}, {files[0][0]} in {column!r}; give '
                          'the files one layout')
        column = image
        cells = parquet.read(columns=[label]).column(0).to_pylist()
        groups = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
      except (pa.ArrowException, OSError) as e:
        raise DataError(f'{path} is not a readable parquet file ({type(e).__name__}: '
                        f'{" ".join(str(e).split())}); replace it') from None
      lists.append(_hf_class_names(schema.metadata, label))  # this file's: its indices name these
      for row, cell in enumerate(cells):
        try:
          values.append(label_values(None if cell == -1 else cell, label.strip().lower() != 'label'))
        except SeveralTags as e:  # -1 above: no label
          raise DataError(f'row {row} of {path}: {e}, but {several_tags(label)}') from None
        except ValueError as e:
          raise DataError(f'row {row} of {path}: {e}; labels are class indices or names, or lists of '
                          'them') from None
      file_of += [number] * len(cells)
      row_of.append(np.arange(len(cells)))
      starts.append(np.cumsum([0] + groups[:-1]))
    paths = tuple(path for path, _ in files)
    file_of = np.asarray(file_of, np.int32)
    row_of = np.concatenate(row_of)
    self.images = _ParquetImages(paths, column, file_of, row_of, tuple(starts))
    where = lambda i: f'row {row_of[i]} of {paths[file_of[i]]}'
    tags, class_names = tags_of_files(values, file_of, lists,
                                      [f'the ClassLabel feature of {path}' for path in paths], where,
                                      f'parquet {self.pattern}', 'its file has no ClassLabel names')
    split_of = None
    if files[0][1] is not None:
      split_of = np.asarray([name for _, name in files], object)[file_of]
    return Catalog(what=f'parquet {self.pattern}', tags=tags, split_of=split_of, class_names=class_names,
                   where=where, absent=self._absent,
                   class_lists=[(split or ALL, names) for (_, split), names in zip(files, lists) if names])

  def _absent(self, split: str, present: list) -> str:
    if present == [ALL]:
      return (f"config.dataset.parquet={self.pattern!r} is one split, '{ALL}': hold out a part with "
              f"--config.dataset.train_split='{ALL}[:80%]' --config.dataset.eval_split='{ALL}[80%:]' (or "
              'point it at a folder of split-named files, or use {split})')
    return (f'no parquet file of {self.pattern} is of split {split!r}; its files are of: '
            f'{", ".join(present)} (set --config.dataset.train_split / eval_split)')
