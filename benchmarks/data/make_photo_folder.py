"""Builds a "user's photo folder" from CIFAR-10 test images, for the Keras-vs-flaxtpu photo benchmark.

Takes `--per-class` images of each of `--classes` from the CIFAR-10 *test*
split of an image folder (`DIR/test/<class>/<file>.jpg`, so none of them is
in the training copy of CIFAR), upscales each one (bicubic) to a random size
(both sides 96..400 pixels, aspect ratio 3:4..4:3) and saves it the way a
real photo folder mixes files: RGB JPEG (quality 70-95, as .jpg, .jpeg or
.JPG), RGB PNG, grayscale ('L') JPEG and PNG, CMYK JPEG, palette ('P') PNG
and RGBA PNG (opaque alpha), plus a few `.DS_Store` junk files that loaders
must skip. Everything is decided by `--seed`, so the same flags give the same
bytes.

Writes two layouts of the same files:

    OUT/<class>/<file>                      one folder of classes, like the Keras
                                            tutorial's flower_photos
    OUT_split/{train,test}/<class>/<file>   a fixed, per-class 80/20 split (hard
                                            links to OUT's files; copies when
                                            the file system refuses links)

and `OUT_manifest.json` beside them (source image, size, format, mode and
split of every file).

    python -m benchmarks.data.make_photo_folder --cifar /path/to/cifar10 --out /tmp/photos
    FLAXTPU_CIFAR10=/path/to/cifar10 python -m benchmarks.data.make_photo_folder \\
        --out /tmp/photos --classes 2 --per-class 60      # a small one for smoke tests
    # -> /tmp/photos/<class>/..., /tmp/photos_split/{train,test}/<class>/..., /tmp/photos_manifest.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import shutil
import statistics
import sys

import numpy as np
from PIL import Image

CIFAR_ENV = 'FLAXTPU_CIFAR10'
SIDE_RANGE = (96, 400)  # inclusive, both sides
ASPECT_RANGE = (3 / 4, 4 / 3)  # width / height
JPEG_QUALITY = (70, 95)  # inclusive
TEST_FRACTION = 0.2
# (kind, weight): what share of the files each format/mode gets.
KINDS = (
    ('jpeg_rgb', 0.52),
    ('png_rgb', 0.14),
    ('jpeg_gray', 0.06),
    ('png_gray', 0.05),
    ('jpeg_cmyk', 0.08),
    ('png_palette', 0.08),
    ('png_rgba', 0.07),
)
JPEG_EXTENSIONS = (('.jpg', 0.8), ('.jpeg', 0.1), ('.JPG', 0.1))  # cameras write .JPG
JUNK_NAME = '.DS_Store'
JUNK_CLASS_FRACTION = 0.5  # share of class folders that get a .DS_Store


def split_dir(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name + '_split')


def manifest_path(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name + '_manifest.json')


def choose_classes(available: list[str], spec: list[str]) -> list[str]:
  """`--classes 5` -> the first 5 sorted class names; `--classes cat dog` -> those (sorted)."""
  if len(spec) == 1 and spec[0].isdigit():
    count = int(spec[0])
    if not 1 <= count <= len(available):
      raise ValueError(f'--classes {count}: the folder has {len(available)} classes ({", ".join(available)})')
    return available[:count]
  missing = sorted(set(spec) - set(available))
  if missing:
    raise ValueError(f'--classes: no class folder {", ".join(missing)}; found {", ".join(available)}')
  return sorted(set(spec))


def random_size(rng: np.random.Generator) -> tuple[int, int]:
  """(width, height), both in SIDE_RANGE, with width/height log-uniform in ASPECT_RANGE."""
  low, high = SIDE_RANGE
  while True:
    aspect = math.exp(rng.uniform(math.log(ASPECT_RANGE[0]), math.log(ASPECT_RANGE[1])))
    width = int(rng.integers(low, high + 1))
    height = round(width / aspect)
    if low <= height <= high:
      return width, height


def weighted_choice(rng: np.random.Generator, options: tuple[tuple[str, float], ...]) -> str:
  names, weights = zip(*options)
  weights = np.asarray(weights) / sum(weights)
  return names[int(rng.choice(len(names), p=weights))]


def save_photo(image: Image.Image, kind: str, stem: pathlib.Path, rng: np.random.Generator) -> dict:
  """Saves the RGB `image` as `kind`; returns the file's manifest entry (without the source)."""
  if kind.startswith('jpeg'):
    extension = weighted_choice(rng, JPEG_EXTENSIONS)
    quality = int(rng.integers(JPEG_QUALITY[0], JPEG_QUALITY[1] + 1))
    mode = {'jpeg_rgb': 'RGB', 'jpeg_gray': 'L', 'jpeg_cmyk': 'CMYK'}[kind]
    path = stem.with_suffix(extension)
    image.convert(mode).save(path, format='JPEG', quality=quality)
    extra = {'quality': quality}
  else:
    path = stem.with_suffix('.png')
    if kind == 'png_palette':
      converted, mode = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT), 'P'
    else:
      mode = {'png_rgb': 'RGB', 'png_gray': 'L', 'png_rgba': 'RGBA'}[kind]
      converted = image.convert(mode)  # RGBA: alpha 255 everywhere
    converted.save(path, format='PNG')
    extra = {}
  return {'file': path.name, 'kind': kind, 'format': 'JPEG' if kind.startswith('jpeg') else 'PNG',
          'mode': mode, 'width': image.width, 'height': image.height, 'bytes': path.stat().st_size,
          **extra}


def link_or_copy(source: pathlib.Path, target: pathlib.Path) -> bool:
  """Hard-links `source` to `target` (copies when linking fails); True when it linked."""
  try:
    os.link(source, target)
    return True
  except OSError:
    shutil.copy2(source, target)
    return False


def build(cifar: pathlib.Path, out: pathlib.Path, classes: list[str], per_class: int, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  split_root = split_dir(out)
  entries = []
  linked = copied = 0
  for class_name in classes:
    source_dir = cifar / 'test' / class_name
    sources = sorted(p for p in source_dir.iterdir() if p.suffix.lower() in ('.jpg', '.jpeg', '.png'))
    if len(sources) < per_class:
      raise ValueError(f'{source_dir} has {len(sources)} images, fewer than --per-class {per_class}')
    picked = [sources[i] for i in sorted(rng.choice(len(sources), per_class, replace=False))]
    # The fixed split: a seeded permutation of this class's files, the first 20% are test.
    num_test = round(per_class * TEST_FRACTION)
    test_members = set(rng.permutation(per_class)[:num_test].tolist())
    class_dir = out / class_name
    class_dir.mkdir(parents=True)
    for split in ('train', 'test'):
      (split_root / split / class_name).mkdir(parents=True)
    for index, source in enumerate(picked):
      with Image.open(source) as original:
        original = original.convert('RGB')
      image = original.resize(random_size(rng), Image.Resampling.BICUBIC)
      kind = weighted_choice(rng, KINDS)
      entry = save_photo(image, kind, class_dir / f'IMG_{index:04d}', rng)
      split = 'test' if index in test_members else 'train'
      if link_or_copy(class_dir / entry['file'], split_root / split / class_name / entry['file']):
        linked += 1
      else:
        copied += 1
      entries.append({'class': class_name, 'split': split, 'source': str(source.relative_to(cifar)), **entry})
    if rng.random() < JUNK_CLASS_FRACTION:
      junk = class_dir / JUNK_NAME
      junk.write_bytes(b'\x00\x00\x00\x01Bud1' + rng.bytes(64))  # what Finder leaves behind, more or less
      (split_root / 'train' / class_name / JUNK_NAME).write_bytes(junk.read_bytes())
  # Junk at the top level too: beside the class folders, and beside the split folders.
  for directory in (out, split_root, split_root / 'train'):
    (directory / JUNK_NAME).write_bytes(b'\x00\x00\x00\x01Bud1' + rng.bytes(64))
  return {'entries': entries, 'linked': linked, 'copied': copied}


def summarize(entries: list[dict]) -> dict:
  widths = [e['width'] for e in entries]
  heights = [e['height'] for e in entries]
  per_class = collections.Counter(e['class'] for e in entries)
  per_split = collections.Counter((e['split'], e['class']) for e in entries)
  return {
      'images': len(entries),
      'bytes': sum(e['bytes'] for e in entries),
      'per_class': dict(sorted(per_class.items())),
      'per_split': {split: {c: n for (s, c), n in sorted(per_split.items()) if s == split}
                    for split in ('train', 'test')},
      'kinds': dict(collections.Counter(e['kind'] for e in entries).most_common()),
      'extensions': dict(collections.Counter(pathlib.Path(e['file']).suffix for e in entries).most_common()),
      'width': {'min': min(widths), 'median': statistics.median(widths), 'max': max(widths)},
      'height': {'min': min(heights), 'median': statistics.median(heights), 'max': max(heights)},
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog='\n'.join(__doc__.splitlines()[2:]))
  parser.add_argument('--cifar', type=pathlib.Path, default=os.environ.get(CIFAR_ENV) or None,
                      help=f'CIFAR-10 image folder with test/<class>/*.jpg (default: ${CIFAR_ENV})')
  parser.add_argument('--out', type=pathlib.Path, required=True,
                      help='the photo folder to create; OUT_split/ and OUT_manifest.json go beside it')
  parser.add_argument('--classes', nargs='+', default=['5'],
                      help='a count (the first N classes, sorted) or class names (default: 5)')
  parser.add_argument('--per-class', type=int, default=600, help='images per class (default: 600)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--force', action='store_true',
                      help='replace OUT and OUT_split when an earlier run of this script made them')
  args = parser.parse_args()
  if args.cifar is None:
    parser.error(f'give the CIFAR-10 image folder with --cifar DIR or ${CIFAR_ENV}')
  if not (args.cifar / 'test').is_dir():
    parser.error(f'--cifar {args.cifar} has no test/ folder (expected test/<class>/<file>.jpg)')
  if args.per_class < 5:
    parser.error('--per-class must be at least 5 (the 80/20 split needs a test image per class)')
  available = sorted(d.name for d in (args.cifar / 'test').iterdir() if d.is_dir())
  try:
    classes = choose_classes(available, args.classes)
  except ValueError as e:
    parser.error(str(e))

  out = args.out
  targets = [out, split_dir(out)]
  existing = [t for t in targets if t.exists()]
  if existing:
    if not args.force:
      parser.error(f'{", ".join(map(str, existing))} already exists; pick another --out or pass --force')
    if not manifest_path(out).is_file():
      parser.error(f'--force: {manifest_path(out)} is missing, so {out} was not made by this script; '
                   'not deleting it')
    for target in existing:
      shutil.rmtree(target)
    manifest_path(out).unlink()

  try:
    built = build(args.cifar, out, classes, args.per_class, args.seed)
  except ValueError as e:
    sys.exit(f'error: {e}')
  summary = summarize(built['entries'])
  manifest = {
      'cifar': str(args.cifar.resolve()), 'classes': classes, 'per_class': args.per_class,
      'seed': args.seed, 'test_fraction': TEST_FRACTION, 'folder': str(out.resolve()),
      'split_folder': str(split_dir(out).resolve()), 'hard_linked': built['linked'],
      'copied': built['copied'], 'summary': summary, 'files': built['entries'],
  }
  manifest_path(out).write_text(json.dumps(manifest, indent=1) + '\n')

  print(f'{summary["images"]} images of {len(classes)} classes ({", ".join(classes)}), '
        f'{summary["bytes"] / 1e6:.1f} MB, from {args.cifar / "test"}')
  print(f'  {out}/<class>/: ' + ', '.join(f'{c} {n}' for c, n in summary['per_class'].items()))
  for split in ('train', 'test'):
    counts = summary['per_split'][split]
    print(f'  {split_dir(out)}/{split}/: {sum(counts.values())} '
          f'({", ".join(f"{c} {n}" for c, n in counts.items())})')
  print('  kinds: ' + ', '.join(f'{k} {n}' for k, n in summary['kinds'].items()))
  print('  extensions: ' + ', '.join(f'{k} {n}' for k, n in summary['extensions'].items()))
  for side in ('width', 'height'):
    s = summary[side]
    print(f'  {side}: min {s["min"]}, median {s["median"]:g}, max {s["max"]}')
  print(f'  split files: {built["linked"]} hard links, {built["copied"]} copies; '
        f'{JUNK_NAME} junk files added')
  print(f'wrote {out}, {split_dir(out)}, {manifest_path(out)}')


if __name__ == '__main__':
  main()
