"""Image folders: root/split/class/image (or root/class/image as split `all`), classes by folder name.

A local folder is walked here, following linked folders once each; a folder in an object store
(gs://) is listed by `remote.py`. Its records are file paths relative to the root.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional, Sequence

import numpy as np

from flaxtpu.data.preprocess import IMAGE_EXTENSIONS
from flaxtpu.data.sources import remote
from flaxtpu.data.sources.base import (
  ALL,
  UNKNOWN_CLASSES,
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
from flaxtpu.io import files, storage


@dataclasses.dataclass(frozen=True)
class FileRecords:
  """Image files: `paths` (bytes [N]) relative to `root`; a file in a bucket is read as bytes."""
  root: str
  paths: np.ndarray

  def __len__(self) -> int:
    return len(self.paths)

  def load(self, index: int) -> tuple[object, None]:
    item = os.path.join(self.root, os.fsdecode(self.paths[index]))
    if storage.is_remote(item):  # an object in a bucket: its bytes (a local file is opened lazily)
      item = files.open_bytes(item)
    return item, None

  def describe(self, index: int) -> str:
    return os.path.join(self.root, os.fsdecode(self.paths[index]))

  def subset(self, keep: np.ndarray) -> 'FileRecords':
    return dataclasses.replace(self, paths=self.paths[keep])


def folder_split(root: str, spec: str, class_names: Optional[Sequence[str]] = None,
                 unknown_classes: str = 'error') -> tuple[Split, tuple[str, ...]]:
  """A split of `root/split/class/image` and the class names its labels index.

  Without `class_names` (the training split) they are the first part's sorted
  class folders. Every other part, and a split given `class_names` (the
  training split's or a checkpoint's), is matched to them by folder name, so
  a label means the same class in every split. A folder of a class not in
  the list is a DataError naming it, or with `unknown_classes='drop'` its
  images are left out with a warning; a split may lack classes.
  """
  if not files.isdir(root):
    raise DataError(f'config.dataset.folder={root!r} is not a directory; point it at a folder '
                    'laid out as split/class/image')
  if unknown_classes not in UNKNOWN_CLASSES:
    raise DataError(f'config.dataset.unknown_classes={unknown_classes!r} is not one of '
                    f'{", ".join(UNKNOWN_CLASSES)}')
  paths, labels = [], []
  for split_name, start, stop in parse_spec(spec):
    images_by_class = _list_folder_split(root, split_name)
    if class_names is None:
      class_names = tuple(images_by_class)
    split_paths, split_labels = _match_classes(images_by_class, tuple(class_names), root, split_name,
                                               unknown_classes)
    order = stratified_order(np.asarray(split_labels))
    first, last = slice_bounds(start, stop, len(order))
    paths += [split_paths[i] for i in order[first:last]]
    labels += [split_labels[i] for i in order[first:last]]
  if not paths:
    raise DataError(f'split {spec!r} of {root} holds no examples; widen the slice')
  # fsencode: a file name that is not UTF-8 (a surrogate-escaped str) keeps its bytes.
  return Split(name=spec, records=FileRecords(root, np.asarray([os.fsencode(p) for p in paths])),
               labels=np.asarray(labels, np.int32)), tuple(class_names)


def _match_classes(images_by_class: dict[str, list[str]], class_names: tuple[str, ...], root: str,
                   split: str, unknown_classes: str) -> tuple[list[str], list[int]]:
  """(paths, labels) of a split's class folders, each labelled by its name's index in `class_names`."""
  index = {name: label for label, name in enumerate(class_names)}
  unknown = [name for name in images_by_class if name not in index]
  if unknown:
    shown = ', '.join(f'{printable(name)} ({len(images_by_class[name])} images)' for name in unknown[:5])
    more = f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''
    if unknown_classes != 'drop':
      raise DataError(f'split {split!r} of {root} has class folders the model is not trained on: '
                      f"{shown}{more}; the model's {len(class_names)} classes are {listed(class_names)}; "
                      'rename or remove them, or set --config.dataset.unknown_classes=drop to leave their '
                      'images out')
    logging.warning('leaving out class folders of split %r of %s that the model is not trained on '
                    '(dataset.unknown_classes=drop): %s%s', split, root, shown, more)
  paths, labels = [], []
  for name, images in images_by_class.items():
    if name in index:
      paths += images
      labels += [index[name]] * len(images)
  if not paths:
    raise DataError(f'split {split!r} of {root} has none of the model\'s classes '
                    f'({listed(class_names, 5)}); is it the right folder?')
  return paths, labels


def folder_classes(root: str, spec: str) -> Optional[tuple[str, ...]]:
  """The class names training on split `spec` gives (its first part's class folders); None when
  there is no such split (a folder holding only an eval split)."""
  try:
    return tuple(_class_dirs(root, parse_spec(spec)[0][0])[1])
  except DataError:
    return None


def _class_dirs(root: str, split: str) -> tuple[str, dict[str, str]]:
  """The split's folder and its class folders: name -> real path, in name order."""
  if storage.is_remote(root):
    return remote.class_dirs(root, split)
  # `all` is the root itself when it holds the class folders directly (root/class/image).
  split_dir = (root if split == ALL and not os.path.isdir(os.path.join(root, ALL))
               else os.path.join(root, split))
  if not os.path.isdir(split_dir):
    found = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if found and any(name.lower().endswith(IMAGE_EXTENSIONS)
                     for name in os.listdir(os.path.join(root, found[0]))):
      raise DataError(f'{root} holds class folders ({", ".join(found[:3])}, ...) with no split folders; '
                      f"hold out a part with --config.dataset.train_split='{ALL}[:80%]' "
                      f"--config.dataset.eval_split='{ALL}[80%:]'")
    raise DataError(f'{split_dir} does not exist; splits found in {root}: '
                    f'{", ".join(found) or "none"} (set config.dataset.train_split/eval_split)')
  split_real = os.path.realpath(split_dir)
  class_dirs = {}
  for name in sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d))):
    real = os.path.realpath(os.path.join(split_dir, name))
    if inside(split_real, real):  # a link to the split folder or above it: a loop, not a class
      logging.warning('not following %s -> %s: it leads back to the folder it is in (a loop)',
                      printable(os.path.join(split_dir, name)), printable(real))
    else:
      class_dirs[name] = real
  if not class_dirs:
    raise DataError(f'{split_dir} has no class folders; expected {split_dir}/<class>/<image>')
  return split_dir, class_dirs


def _list_folder_split(root: str, split: str) -> dict[str, list[str]]:
  """Class folder name -> its image paths (relative to `root`, sorted), in class-name order."""
  split_dir, class_dirs = _class_dirs(root, split)
  if storage.is_remote(root):
    prefix = len(root.rstrip('/')) + 1
    return {name: sorted(path[prefix:] for path in remote.image_files(class_dir)) or _no_images(class_dir)
            for name, class_dir in class_dirs.items()}
  split_real = os.path.realpath(split_dir)
  prefix = os.path.join(root, '')  # what every path found below starts with: cut, not relpath (60k: 1 s)
  images_by_class = {}
  for name in class_dirs:
    class_dir = os.path.join(split_dir, name)
    others = [real for other, real in class_dirs.items() if other != name]
    images = sorted(path[len(prefix):] if path.startswith(prefix) else os.path.relpath(path, root)
                    for path in image_files(class_dir, split_real, others))
    if not images:
      raise DataError(f'class folder {class_dir} has no images ({", ".join(IMAGE_EXTENSIONS)}); '
                      'add images or remove the folder')
    images_by_class[name] = images
  return images_by_class


def _no_images(class_dir: str):
  raise DataError(f'class folder {class_dir} has no images ({", ".join(IMAGE_EXTENSIONS)}); '
                  'add images or remove the folder')


def image_files(top: str, split_real: str = '', other_classes: Sequence[str] = ()) -> list[str]:
  """The image files under `top` (its path joined to theirs), following linked folders once each.

  A linked folder is not followed (a warning names it) when it was read
  already -- a loop such as a link to `..` or between sibling folders, or a
  second link to one folder -- when it holds `top` or the split folder
  `split_real` (a link to the dataset root or `/`), or when it is inside, or
  holds, another class's folder (`other_classes`, real paths), whose images
  would be labelled twice.
  """
  top_real = os.path.realpath(top)
  walked = {top_real}
  found = []
  for directory, subdirectories, names in os.walk(top, followlinks=True):
    kept = []
    for name in subdirectories:
      path = os.path.join(directory, name)
      real = os.path.realpath(path)
      if real in walked:
        why = 'it leads to a folder read already (a loop, or a second link to it)'
      elif os.path.islink(path) and (inside(top_real, real) or (split_real and inside(split_real, real))):
        why = 'it leads back to a folder that holds it (a loop)'
      elif os.path.islink(path) and any(inside(real, other) or inside(other, real)
                                        for other in other_classes):
        why = "it leads into another class's folder"
      else:
        walked.add(real)
        kept.append(name)
        continue
      logging.warning('not following %s -> %s: %s', printable(path), printable(real), why)
    subdirectories[:] = kept  # os.walk descends only into these
    found += [os.path.join(directory, name) for name in names
              if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith('._')]
  return found


def inside(path: str, folder: str) -> bool:
  """Whether `path` is `folder` or below it (both real paths)."""
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class FolderSource(Source):
  """root/split/class/image (or root/class/image as split `all`): classes matched by folder name."""
  kind, key, fallback, lists_labels, title = 'folder', 'folder', True, True, 'image folder'

  @classmethod
  def selects(cls, dataset) -> bool:
    return bool(dataset.folder)

  @classmethod
  def create(cls, dataset, task: str) -> 'FolderSource':
    del task  # a folder's classes are single labels
    return cls(dataset.folder, dataset.train_split, dataset.unknown_classes)

  def __init__(self, root: str, train_spec: str, unknown_classes: str = 'error'):
    self.root, self.train_spec, self.unknown_classes = root, train_spec, unknown_classes

  def splits(self, train_spec, eval_spec, class_names):
    train = None
    if train_spec is not None:
      train, class_names = folder_split(self.root, train_spec, class_names, self.unknown_classes)
    elif class_names is None:  # evaluating alone: the classes training on train_spec gives
      class_names = folder_classes(self.root, self.train_spec)
    evaluation, class_names = folder_split(self.root, eval_spec, class_names, self.unknown_classes)
    warn_missing_classes(evaluation, class_names)
    return train, evaluation, class_names
