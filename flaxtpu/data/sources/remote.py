"""Image folders in an object store (gs://, s3://): split and class folders listed through etils.

No links there to follow or refuse; `folder.py` asks these where its root is remote.
"""

from __future__ import annotations

import posixpath

from flaxtpu.data.preprocess import IMAGE_EXTENSIONS
from flaxtpu.data.sources.base import ALL, DataError
from flaxtpu.io import files


def class_dirs(root: str, split: str) -> tuple[str, dict[str, str]]:
  """folder._class_dirs of a folder in an object store (no links there to follow or refuse)."""
  split_dir = root if split == ALL and not files.isdir(files.join(root, ALL)) else files.join(root, split)
  if not files.isdir(split_dir):
    found = sorted(name for name in files.listdir(root) if files.isdir(files.join(root, name)))
    raise DataError(f'{split_dir} does not exist; splits found in {root}: '
                    f'{", ".join(found) or "none"} (set config.dataset.train_split/eval_split)')
  class_dirs = {name: files.join(split_dir, name) for name in sorted(files.listdir(split_dir))
                if files.isdir(files.join(split_dir, name))}
  if not class_dirs:
    raise DataError(f'{split_dir} has no class folders; expected {split_dir}/<class>/<image>')
  return split_dir, class_dirs


def image_files(top: str) -> list[str]:
  """folder.image_files of a folder in an object store."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  top = top.rstrip('/')
  found = []
  for directory, _, names in epath.Path(top).walk():
    # gcsfs names the folders it walks without their gs://, TensorFlow's gfile with it.
    below = str(directory).split('://', 1)[-1][len(top.split('://', 1)[-1]):].strip('/')
    found += [posixpath.join(top, below, name) for name in names
              if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith('._')]
  return found
