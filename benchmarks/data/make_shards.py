"""Writes an image folder or a label file as WebDataset-style tar shards, for `dataset.shards`.

    python -m benchmarks.data.make_shards /data/gen1000 --out /data/gen1000_shards --shards 64
    python -m benchmarks.data.make_shards --labels /data/photos/labels.csv --out /data/photo_shards

The source is a folder laid out as split/class/image (or class/image: split `all`), or a
CSV / JSON Lines label file as `dataset.labels` reads it (images relative to --folder,
else the file's folder). Each split becomes --shards files `OUT/{split}-0000.tar ...`; the
command prints the `--config.dataset.shards` pattern that reads them. Every example is
`KEY.<its extension>` (the image file's bytes, unchanged) with `KEY.cls` (its class index in
`OUT/classes.txt`), or `KEY.json` ({"labels": [names]}) when some image has no tag or several.

Deterministic: a split's examples are shuffled by (--seed, split) -- so each shard mixes the
classes, as shard-wise sampling needs -- then cut into --shards runs of consecutive examples;
tar headers carry no time, owner or mode of the machine. The same input gives the same bytes.
"""

import argparse
import io
import json
import multiprocessing
import os
import tarfile
import zlib

import numpy as np

from flaxtpu.data import preprocess
from flaxtpu.data.sources import base, label_file, tagged
from flaxtpu.data.sources import folder as folder_source
from flaxtpu.data.sources import shards as shard_source


def folder_examples(root: str) -> tuple[dict[str, list[tuple[str, tuple[str, ...]]]], tuple[str, ...]]:
  """{split: [(image path, (class,))]} of an image folder, and the class names (every split's)."""
  folders = sorted(name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name)))
  class_layout = folders and any(name.lower().endswith(preprocess.IMAGE_EXTENSIONS)
                                 for name in os.listdir(os.path.join(root, folders[0])))
  splits = [base.ALL] if class_layout else folders
  class_names = tuple(sorted({name for split in splits
                             for name in folder_source.folder_classes(root, split) or ()}))
  examples = {}
  for split in splits:
    listed, _ = folder_source.folder_split(root, split, class_names)
    examples[split] = sorted((os.path.join(root, os.fsdecode(path)), (class_names[label],))
                             for path, label in zip(listed.records.paths, listed.labels))
  return examples, class_names


def label_file_examples(path: str, folder: str) -> tuple[dict, tuple[str, ...]]:
  """{split: [(image path, tags)]} of a label file (split `all` without a split column), and the
  class names (sorted as `dataset.labels` sorts them)."""
  root = folder or os.path.dirname(os.path.abspath(path))
  examples: dict = {}
  for row in label_file.read_label_file(path):
    examples.setdefault(row.split or base.ALL, []).append((os.path.join(root, row.image), row.tags))
  tags = (tag for rows in examples.values() for _, row_tags in rows for tag in row_tags)
  return examples, tagged.sorted_classes(tags)


def write_shard(task: tuple) -> tuple[str, int, int]:
  """Writes one shard (under a temporary name, then renamed); returns (path, examples, bytes)."""
  path, first_key, examples, class_names, as_json = task
  index = {name: label for label, name in enumerate(class_names)}
  partial = path + '.partial'
  with tarfile.open(partial, 'w', format=tarfile.USTAR_FORMAT) as tar:
    for number, (image_path, tags) in enumerate(examples):
      key = f'{first_key + number:08d}'
      with open(image_path, 'rb') as f:
        _add(tar, key + os.path.splitext(image_path)[1].lower(), f.read())
      label = (json.dumps({'labels': list(tags)}) if as_json else str(index[tags[0]])).encode()
      _add(tar, f'{key}.json' if as_json else f'{key}.cls', label)
  os.replace(partial, path)
  return path, len(examples), os.path.getsize(path)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
  info = tarfile.TarInfo(name)
  info.size, info.mode, info.mtime = len(data), 0o644, 0  # nothing of this machine or this moment
  tar.addfile(info, io.BytesIO(data))


def make_shards(examples: dict, class_names: tuple[str, ...], out: str, shards: int = 64, seed: int = 0,
                workers: int = 1) -> str:
  """Writes `examples` ({split: [(image path, tags)]}) as `shards` tar files per split and
  classes.txt under `out`; returns the `dataset.shards` pattern that reads them."""
  as_json = any(len(tags) != 1 for rows in examples.values() for _, tags in rows)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, shard_source.SHARD_CLASSES), 'w', encoding='utf-8') as f:
    f.write(''.join(f'{name}\n' for name in class_names))
  width = max(4, len(str(shards - 1)))
  tasks = []
  for split, rows in examples.items():
    order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(rows))
    first_key = 0  # keys number a split's examples in shard order
    for shard, part in enumerate(np.array_split(order, shards)):
      path = os.path.join(out, f'{split}-{shard:0{width}d}.tar')
      tasks.append((path, first_key, [rows[i] for i in part], class_names, as_json))
      first_key += len(part)
  with multiprocessing.Pool(workers) if workers > 1 else _Serial() as pool:
    written = list(pool.imap(write_shard, tasks))
  print(f'{sum(count for _, count, _ in written)} examples of {len(class_names)} classes in '
        f'{len(written)} shards ({sum(size for *_, size in written) / 2**20:.1f} MiB) under {out}')
  split = '{split}' if list(examples) != [base.ALL] else base.ALL
  return os.path.join(out, split) + f'-{{{0:0{width}d}..{shards - 1:0{width}d}}}.tar'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('folder', nargs='?', default='',
                      help='image folder (split/class/image); with --labels, the root of its paths')
  parser.add_argument('--labels', default='',
                      help='a CSV or JSON Lines label file instead of class folders')
  parser.add_argument('--out', required=True, help='folder for the shards and classes.txt')
  parser.add_argument('--shards', type=int, default=64, help='shards per split')
  parser.add_argument('--seed', type=int, default=0,
                      help='the shuffle before the examples are cut into shards')
  parser.add_argument('--workers', type=int, default=1, help='processes writing shards (same output)')
  args = parser.parse_args()
  if args.labels:
    examples, class_names = label_file_examples(args.labels, args.folder)
  elif args.folder:
    examples, class_names = folder_examples(args.folder)
  else:
    parser.error('give an image folder, or --labels FILE')
  pattern = make_shards(examples, class_names, args.out, args.shards, args.seed, args.workers)
  print(f"--config.dataset.shards='{pattern}'")


class _Serial:
  """A one-process stand-in for multiprocessing.Pool."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def imap(self, function, items):
    return map(function, items)


if __name__ == '__main__':
  main()
