"""What label files, tar shards and parquet share: sources whose labels are known before an image
is opened. Each reads its examples into a `Catalog` (tags as written, split, where each came
from); splits, slices, class names and the label arrays are then made the same way for all of
them (`TaggedSource`). Also the file patterns shards and parquet take ('s-{000..127}.tar')."""

from __future__ import annotations

import collections
import dataclasses
import difflib
import functools
import glob
import logging
import os
import re
from typing import Callable, Optional, Sequence

import ml_collections
import numpy as np

from flaxtpu.data.sources.base import (
  ALL,
  DataError,
  Source,
  Split,
  listed,
  parse_spec,
  printable,
  slice_bounds,
  stratified_order,
  warn_missing_classes,
)

TAG_SEPARATOR = ';'  # between the tags of a `labels` cell
LABEL_COLUMNS = ('label', 'labels')  # label: one per row; labels (or a set label_column): tags
SPLIT_MISSPELLING = 0.75  # difflib's ratio from which a split value is a misspelt split name
_INTEGER = re.compile(r'-?\d+')
_BRACES = re.compile(r'\{(\d+)\.\.(\d+)\}|\{([^{}]*,[^{}]*)\}')


@dataclasses.dataclass
class Catalog:
  """Every example of a labelled source, before splits and slices."""
  what: str  # how messages name the dataset
  tags: list  # per example: its class names (tuple of str), first tag first; () = untagged
  split_of: Optional[np.ndarray]  # per example: its split (str); None = one split, 'all'
  class_names: tuple[str, ...]  # the dataset's own classes (every split's), for strata and messages
  where: Callable[[int], str]  # example -> 'line 7 of labels.csv (cat/1.jpg)', for messages
  absent: Callable[[str, list], str]  # (split, the splits there are) -> why it is not there
  # (split, its class names) of each file that lists them (a classes.txt, a ClassLabel), in file order
  class_lists: list = dataclasses.field(default_factory=list)

  def classes_of(self, split_names: Sequence[str]) -> tuple[str, ...]:
    """The classes of the splits `split_names` (training's, whole): the names their files list (the
    first file's order), then the other names their examples use, in `class_names` order. Never
    another split's: its names are matched to these by name (`_encoded`)."""
    listed_names = dict.fromkeys(name for split, names in self.class_lists if split in split_names
                                 for name in names)
    used = {tag for split in split_names for row in self.rows(split) for tag in self.tags[row]}
    return tuple(listed_names) + tuple(name for name in self.class_names
                                       if name in used and name not in listed_names)

  @functools.cached_property
  def strata(self) -> np.ndarray:
    """Each example's first tag as an index into the dataset's own classes (-1: untagged): what a
    slice keeps in proportion, whichever classes a model was given."""
    index = {name: label for label, name in enumerate(self.class_names)}
    return np.asarray([index.get(tags[0], -1) if tags else -1 for tags in self.tags], np.int64)

  def rows(self, split: str) -> np.ndarray:
    """The examples of `split`, in storage order; a DataError naming the splits there are if none."""
    if self.split_of is None:
      if split != ALL:
        raise DataError(self.absent(split, [ALL]))
      return np.arange(len(self.tags))
    rows = np.flatnonzero(self.split_of == split)
    if not len(rows):
      raise DataError(self.absent(split, sorted(set(self.split_of.tolist()))))
    return rows

  def check_tags(self, multilabel: bool) -> None:
    """Multiclass: exactly one label per example (multilabel takes any number, none included)."""
    if multilabel:
      return
    for position, tags in enumerate(self.tags):
      if not tags:
        raise DataError(f'{self.where(position)} has no label; give every image one (or remove it), or set '
                        '--config.task=multilabel for images with any number of tags, none included')
      if len(tags) > 1:
        shown = TAG_SEPARATOR.join(printable(tag) for tag in tags[:5])
        raise DataError(f'{self.where(position)} has {len(tags)} labels ({shown}); a multiclass model takes '
                        'one per image: set --config.task=multilabel for images with several tags')


def check_split_values(catalog: Catalog, configured: Sequence[str]) -> None:
  """A split column's values that no configured split (train_split, eval_split, eval_splits, those
  asked for) names exactly leave their examples out, never silently. A value that differs from a
  configured name only in case ('Train') or is a close misspelling of one ('tset', 'valid' for
  'val') is a DataError naming the values, the file and the splits asked for, with the close match;
  other values are splits of their own the run does not use ('val' beside train and test): a
  warning counts the examples left out."""
  if catalog.split_of is None:
    return
  configured = list(dict.fromkeys(configured))
  unused = collections.Counter(value for value in catalog.split_of.tolist() if value not in configured)
  if not unused:
    return
  lowered = {name.lower(): name for name in configured}
  close = {value: lowered.get(value.lower()) or next(iter(difflib.get_close_matches(value, configured, 1,
                                                                                    SPLIT_MISSPELLING)), None)
           for value in unused}
  if mistakes := [value for value in unused if close[value]]:
    shown = ', '.join(f'{printable(value)!r} ({unused[value]} examples; {close[value]!r}?)'
                      for value in mistakes)
    raise DataError(f'{catalog.what} has split values that are not a split this run reads but look like one: '
                    f'{shown}; split names match exactly, and the run reads {listed(configured)}: fix the '
                    'values in the file, or set --config.dataset.train_split / eval_split to them')
  logging.warning('%s: leaving out the examples of splits this run does not read (it reads %s): %s',
                  catalog.what, listed(configured),
                  ', '.join(f'{printable(value)!r} ({count} examples)'
                            for value, count in unused.most_common()))


def _sliced(catalog: Catalog, spec: str) -> np.ndarray:
  """The examples `spec` names ('train[:80%]+val'). Each part's slice is taken along the fixed
  stratified order (as for folders), so it keeps the class proportions, then put back in storage
  order, so that reading a split goes through its files front to back."""
  parts = []
  for split_name, start, stop in parse_spec(spec):
    rows = catalog.rows(split_name)
    order = rows[stratified_order(catalog.strata[rows])]
    first, last = slice_bounds(start, stop, len(order))
    parts.append(np.sort(order[first:last]))
  positions = np.concatenate(parts)
  if not len(positions):
    raise DataError(f'split {spec!r} of {catalog.what} holds no examples; widen the slice')
  return positions


def _encoded(catalog: Catalog, positions: np.ndarray, class_names: Sequence[str], multilabel: bool,
             unknown_classes: str, spec: str) -> tuple[np.ndarray, np.ndarray]:
  """(the positions kept, their labels): int32 class indices, or uint8 multi-hot rows [N, C], by
  name in `class_names` (a checkpoint's may lack some of the file's classes: those stop here,
  or with unknown_classes=drop their examples are left out -- multilabel: only those tags)."""
  index = {name: label for label, name in enumerate(class_names)}
  unknown = collections.Counter(tag for position in positions for tag in catalog.tags[position]
                                if tag not in index)
  if unknown:
    shown = ', '.join(f'{printable(name)} ({count} examples)' for name, count in unknown.most_common(5))
    more = f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''
    if unknown_classes != 'drop':
      raise DataError(f'split {spec!r} of {catalog.what} has labels the model is not trained on: '
                      f"{shown}{more}; the model's {len(class_names)} classes are "
                      f'{listed(class_names)}; fix the labels, or set '
                      '--config.dataset.unknown_classes=drop to leave them out')
    logging.warning('leaving out the %s of split %r of %s with classes the model is not trained on '
                    '(dataset.unknown_classes=drop): %s%s', 'tags' if multilabel else 'examples', spec,
                    catalog.what, shown, more)
  if multilabel:
    labels = np.zeros((len(positions), len(class_names)), np.uint8)
    for row, position in enumerate(positions):
      labels[row, [index[tag] for tag in catalog.tags[position] if tag in index]] = 1
    return positions, labels
  positions = positions[[catalog.tags[position][0] in index for position in positions]]
  if not len(positions):
    raise DataError(f"split {spec!r} of {catalog.what} has none of the model's classes "
                    f'({listed(class_names, 5)}); is it the right dataset?')
  return positions, np.asarray([index[catalog.tags[position][0]] for position in positions], np.int32)


def sorted_classes(names) -> tuple[str, ...]:
  """Class names in order: numerically when every name is an integer ('2' before '10')."""
  names = set(names)
  if names and all(_INTEGER.fullmatch(name) for name in names):
    return tuple(sorted(names, key=lambda name: (int(name), name)))
  return tuple(sorted(names))


class SeveralTags(ValueError):
  """A one-label cell (a `label` column, a KEY.cls) that holds `;`-separated tags: multi-label tags
  written where one class is read would otherwise become one class named 'cat;outdoor'."""


def one_label(cell: str) -> str:
  """A cell of a one-label column, as written; SeveralTags when it holds TAG_SEPARATOR."""
  if TAG_SEPARATOR in cell and len([tag for tag in cell.split(TAG_SEPARATOR) if tag.strip()]) > 1:
    raise SeveralTags(f'{printable(cell.strip())!r} holds tags separated by {TAG_SEPARATOR!r}')
  return cell


def several_tags(column: str) -> str:
  """The fix for SeveralTags in a label column named `column`."""
  return (f'a {column!r} column holds one class per image: name it labels for tags separated by '
          f"'{TAG_SEPARATOR}' (with --config.task=multilabel), or name the column to read with "
          '--config.dataset.label_column')


def label_values(value, separated: bool = True) -> list:
  """A label as written (a class index or name, a list of them, a `;`-separated string, or None)
  -> its class indices (int) and names (str), in order, once each. A bad value is a ValueError;
  a `;`-separated string where one label is read (not `separated`) is SeveralTags."""
  if value is None:
    items = []
  elif isinstance(value, list):
    items = value
  elif isinstance(value, str) and separated:
    items = value.split(TAG_SEPARATOR)
  else:
    items = [one_label(value) if isinstance(value, str) else value]
  values = []
  for item in items:
    if isinstance(item, float) and item.is_integer():
      item = int(item)
    if isinstance(item, str):
      item = item.strip()
      if not item:
        continue
      item = int(item) if _INTEGER.fullmatch(item) else item
    if isinstance(item, bool) or not isinstance(item, (int, str)):
      raise ValueError(f'label {item!r} is not a class index or name')
    if isinstance(item, int) and item < 0:
      raise ValueError(f'class index {item} is negative')
    if item not in values:
      values.append(item)
  return values


def tags_of_values(values: list, names: Optional[Sequence[str]], where: Callable[[int], str],
                    what: str, names_from: str) -> tuple[list, tuple[str, ...]]:
  """Tags (class names) of labels written as class indices or names, and the class names: `names`
  (a classes.txt, a ClassLabel feature) when given, else the names used (sorted), or '0'..'K-1'
  for indices."""
  if names is None:
    kinds = {type(value) for labels in values for value in labels}
    if kinds == {int, str}:
      first = next(i for i, labels in enumerate(values) if any(isinstance(v, int) for v in labels))
      raise DataError(f'{what} mixes class indices ({where(first)}) with class names; write names '
                      f'only, or indices with their names in {names_from}')
    if kinds == {int}:
      names = tuple(str(label) for label in range(max(max(labels, default=0) for labels in values) + 1))
      return [tuple(str(value) for value in labels) for labels in values], names
    return [tuple(labels) for labels in values], sorted_classes(v for labels in values for v in labels)
  known = set(names)
  tags = []
  for position, labels in enumerate(values):
    for value in labels:
      if isinstance(value, int) and value >= len(names):
        raise DataError(f'{where(position)} has class index {value}, but {names_from} names '
                        f'{len(names)} classes (0-{len(names) - 1}); fix the label or the names')
      if isinstance(value, str) and value not in known:
        raise DataError(f'{where(position)} has class {printable(value)!r}, which {names_from} lacks; '
                        'add it there or fix the label')
    tags.append(tuple(names[value] if isinstance(value, int) else value for value in labels))
  return tags, tuple(names)


def tags_of_files(values: list, file_of: np.ndarray, lists: Sequence[Optional[Sequence[str]]],
                  sources: Sequence[str], where: Callable[[int], str], what: str,
                  lacking: str) -> tuple[list, tuple[str, ...]]:
  """`tags_of_values` of labels read from several files, each of which may list its own class names
  (`lists[f]`, from `sources[f]`: the classes.txt beside a shard, a parquet file's ClassLabel). A
  file's class indices are decoded with ITS names, never another file's, so files that list the
  classes in other orders agree by name. A file that lists none takes the one list the others
  share; when their lists differ, its indices are a DataError (`lacking`: 'no classes.txt beside
  it'). The class names: every file's, in file order."""
  given = list(dict.fromkeys(tuple(names) for names in lists if names is not None))
  if len(given) <= 1:  # no list, or one that every file shares
    return tags_of_values(values, given[0] if given else None, where, what,
                          next((s for s, names in zip(sources, lists) if names is not None), sources[0]))
  tags, class_names = [None] * len(values), {}
  file_of = np.asarray(file_of, np.int64)
  order, ends = np.argsort(file_of, kind='stable'), np.cumsum(np.bincount(file_of, minlength=len(lists)))
  for number, names in enumerate(lists):
    positions = order[(ends[number - 1] if number else 0):ends[number]]  # this file's examples
    source = sources[number]
    if names is None:
      first = next((p for p in positions if any(isinstance(v, int) for v in values[p])), None)
      if first is not None:
        index = next(v for v in values[first] if isinstance(v, int))
        raise DataError(f'{where(first)} has class index {index} but {lacking}, and the class lists of the '
                        'other files differ '
                        f'({", ".join(dict.fromkeys(s for s, n in zip(sources, lists) if n is not None))}); '
                        'give it its own list, or write class names')
    file_tags, file_names = tags_of_values([values[p] for p in positions], names,
                                           lambda i, positions=positions: where(positions[i]), what, source)
    for position, row_tags in zip(positions, file_tags):
      tags[position] = row_tags
    class_names.update(dict.fromkeys(file_names))
  return tags, tuple(class_names)


def pick_column(names: Sequence[str], configured: str, candidates: Sequence[str], key: str, what: str,
                 where: str) -> str:
  """Which of `names` is the image (or label) column: `configured` (config.dataset.KEY), else the
  first of `candidates` present; names compare without case."""
  lowered = {name.strip().lower(): name for name in names}
  if configured:
    if configured.strip().lower() in lowered:
      return lowered[configured.strip().lower()]
    raise DataError(f'{where} has no column {configured!r} (config.dataset.{key}); its columns: '
                    f'{", ".join(map(str, names))}')
  for candidate in candidates:
    if candidate in lowered:
      return lowered[candidate]
  raise DataError(f'{where} has no {what} column (its columns: {", ".join(map(str, names)) or "none"}); '
                  f'name it {" or ".join(candidates)}, or set --config.dataset.{key}')


class TaggedSource(Source):
  """A source whose labels are known without opening an image: a `Catalog` of its examples,
  split and sliced the same way whatever the kind (label file, tar shards, parquet)."""
  multilabel = lists_labels = True

  def __init__(self, dataset: ml_collections.ConfigDict, task: str):
    self.multilabel = task == 'multilabel'
    self.train_spec, self.unknown_classes = dataset.train_split, dataset.unknown_classes
    # Every split the config names: a split column's other values are checked against them.
    self.configured_specs = (dataset.train_split, dataset.get('eval_split', ''),
                             *dataset.get('eval_splits', ()))
    self.skip_corrupt = dataset.skip_corrupt
    self.image_column, self.label_column = dataset.get('image_column', ''), dataset.get('label_column', '')

  def catalog(self, split_names: Sequence[str], optional: Sequence[str]) -> Catalog:
    """The examples of at least the splits `split_names` (and of `optional` ones if they exist)."""
    raise NotImplementedError

  def split(self, spec: str, positions: np.ndarray, labels: np.ndarray) -> Split:
    """The catalog's examples at `positions` as a Split."""
    raise NotImplementedError

  def splits(self, train_spec, eval_spec, class_names):
    names = lambda spec: [split for split, _, _ in parse_spec(spec)] if spec else []
    # Evaluating alone without the classes: those training on train_split gives.
    optional = names(self.train_spec) if train_spec is None and class_names is None else []
    catalog = self.catalog(list(dict.fromkeys(names(train_spec) + names(eval_spec))), optional)
    check_split_values(catalog, [name for spec in (*self.configured_specs, train_spec, eval_spec)
                                 for name in names(spec)])
    catalog.check_tags(self.multilabel)
    if not catalog.class_names:
      raise DataError(f'{catalog.what} has no labels at all; label its images')
    if class_names is None:  # training's classes; other splits are matched to them by name
      try:
        class_names = catalog.classes_of(names(train_spec if train_spec is not None else self.train_spec))
      except DataError:  # evaluating alone on data without the training split: every split's
        class_names = catalog.class_names
    class_names = tuple(class_names)
    loaded = []
    for spec in (train_spec, eval_spec):
      if spec is not None:
        positions = _sliced(catalog, spec)
        loaded.append(self.split(spec, *_encoded(catalog, positions, class_names, self.multilabel,
                                                 self.unknown_classes, spec)))
    warn_missing_classes(loaded[-1], class_names)
    return (loaded[0] if train_spec is not None else None), loaded[-1], class_names


def expand_braces(pattern: str) -> list[str]:
  """'a-{00..02}.tar' -> a-00.tar, a-01.tar, a-02.tar (zero padding kept); '{x,y}' -> x, y. Several
  braces multiply, the leftmost slowest; other braces ('{split}') stay."""
  match = _BRACES.search(pattern)
  if not match:
    return [pattern]
  if match[3] is not None:
    values = match[3].split(',')
  else:
    first, last = match[1], match[2]
    padded = any(len(bound) > 1 and bound.startswith('0') for bound in (first, last))
    width = max(len(first), len(last)) if padded else 0
    step = 1 if int(last) >= int(first) else -1
    values = [str(number).zfill(width) for number in range(int(first), int(last) + step, step)]
  head, tails = pattern[:match.start()], expand_braces(pattern[match.end():])
  return [head + value + tail for value in values for tail in tails]


def pattern_files(pattern: str, key: str, split: Optional[str] = None) -> list[str]:
  """The files `pattern` names (config.dataset.KEY, `{split}` replaced), in pattern order: brace
  ranges first, then globs (sorted); a file named outright must exist."""
  files = []
  for path in expand_braces(pattern.replace('{split}', split) if split is not None else pattern):
    if glob.has_magic(path):
      files += sorted(glob.glob(path))
    elif os.path.isfile(path):
      files.append(path)
    else:
      raise DataError(f'{path} (from config.dataset.{key}={pattern!r}) does not exist; fix the pattern')
  if not files:
    found = split_values(pattern)
    raise DataError(f'config.dataset.{key}={pattern!r} matches no file'
                    + (f' for split {split!r}; splits found: {", ".join(found) or "none"}' if split else '')
                    + '; fix the pattern or the split names')
  return list(dict.fromkeys(files))


def split_values(pattern: str) -> list[str]:
  """The values `{split}` takes in the files that match `pattern`, for messages."""
  pieces = re.split(r'(\{split\}|\{[^{}]*\}|[*?]|\[[^\]]*\])', pattern)
  regex = ''.join('(?P<split>[^/]+)' if piece == '{split}' and index == pieces.index('{split}') else
                  '(?P=split)' if piece == '{split}' else
                  '.*' if piece[:1] in ('{', '*', '?', '[') else re.escape(piece)
                  for index, piece in enumerate(pieces))
  wildcard = ''.join('*' if piece[:1] in ('{', '*', '?', '[') else piece for piece in pieces)
  return sorted({match['split'] for path in glob.glob(wildcard) if (match := re.fullmatch(regex, path))})
