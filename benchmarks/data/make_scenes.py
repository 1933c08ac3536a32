"""Writes a generated multi-label scene set: small images holding 0-3 of 10 shapes, and labels.csv.

    python -m benchmarks.data.make_scenes --out /data/scenes                      # 20,000 train + 2,000 test
    python -m benchmarks.data.make_scenes --out /tmp/scenes --train 500 --test 100 # a smoke test
    python -m benchmarks.data.make_scenes --out /data/scenes --single labels_single.csv

Layout: `OUT/train/000000.png ... OUT/test/...` and `OUT/labels.csv` with the
header `path,labels,split`: `train/000000.png,circle;star,train` (the tags in
SHAPES order, ';'-separated; empty for an image without shapes), what
`--config.dataset.labels=OUT/labels.csv --config.task=multilabel` reads.
`--single FILE` also writes OUT/FILE with only the images that hold exactly
one shape (both splits, the same columns): the single-label subset a softmax
model can train on.

Each image has a background of two random colours blended along a random
direction, plus pixel noise; on it 0-3 distinct shapes (`--count-probs`, by
default 10% none, 30% each of one, two and three) of random colour (one
kept apart from the background's, up to 30 draws), size (radius 16-30% of
the side) and position. A shape may partly cover another: its centre is
drawn (up to 30 times) until it lies at least 0.7 x the sum of the radii
from every earlier shape's: partly covered, rarely hidden.
Shapes are told apart by form, not colour: circle, square (axis-aligned),
triangle (any rotation), cross (an X), ring, star (five points, any rotation),
diamond (a square on its corner), bar (long and thin, horizontal or vertical),
ellipse (half as high as wide, either way) and plus (a +); the axis-bound ones
tilt by at most 10 degrees, so a square never turns into a diamond nor a plus
into a cross. Shapes are drawn 4x larger and averaged down (anti-aliased).

Image i of a split depends only on (--seed, split, i): the output is the same
for any --workers, a rerun skips images that exist (their labels are drawn
again, cheaply), and a set made with --train 500 holds the first 500 images of
one made with --train 20000.
"""

from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import os
import time

import numpy as np

SHAPES = ('circle', 'square', 'triangle', 'cross', 'ring', 'star', 'diamond', 'bar', 'ellipse', 'plus')
SPLITS = ('train', 'test')
SUPERSAMPLE = 4  # shapes are drawn this many times larger, then averaged down
TILT = math.radians(10)  # most an axis-bound shape turns
CHUNK = 250  # images per task handed to a worker process


def relative_path(split: str, index: int, image_format: str) -> str:
  return f'{split}/{index:06d}.{image_format}'


def scene(seed: int, split: int, index: int, size: int, count_probs) -> dict:
  """Everything random about one image, from its own generator: the background and each shape's
  (name, centre, radius, angle, colour). Cheap: no pixels."""
  rng = np.random.default_rng([seed, split, index])
  background = rng.integers(0, 256, (2, 3)).astype(np.float32)
  direction = rng.uniform(0, 2 * math.pi)
  noise_seed = int(rng.integers(2**31))
  count = int(rng.choice(len(count_probs), p=count_probs))
  names = sorted(rng.choice(len(SHAPES), count, replace=False).tolist())
  mean_background = background.mean(0)
  shapes, placed = [], []
  for name in names:
    radius = rng.uniform(0.16, 0.3) * size
    for _ in range(30):  # a place that leaves every earlier shape mostly visible
      centre = rng.uniform(radius * 0.8, size - radius * 0.8, 2)
      if all(np.hypot(*(centre - c)) >= 0.7 * (radius + r) for c, r in placed):
        break
    placed.append((centre, radius))
    for _ in range(30):  # a colour that stands out from the background
      colour = rng.integers(0, 256, 3).astype(np.float32)
      if np.linalg.norm(colour - mean_background) > 90:
        break
    if SHAPES[name] in ('triangle', 'star'):
      angle = rng.uniform(0, 2 * math.pi)
    elif SHAPES[name] in ('bar', 'ellipse'):  # lying or standing
      angle = rng.uniform(-TILT, TILT) + rng.integers(2) * math.pi / 2
    else:
      angle = rng.uniform(-TILT, TILT)
    shapes.append({'name': SHAPES[name], 'centre': centre, 'radius': radius, 'angle': angle,
                   'colour': colour})
  return {'background': background, 'direction': direction, 'noise_seed': noise_seed, 'shapes': shapes}


def outline(name: str) -> list[tuple[np.ndarray, int]]:
  """The shape in unit coordinates (radius 1, centred, unturned): polygons with the value they paint
  into the mask (255 fills, 0 cuts out: the ring's hole)."""

  def ellipse(rx: float, ry: float, points: int = 64):
    t = np.linspace(0, 2 * math.pi, points, endpoint=False)
    return np.stack([rx * np.cos(t), ry * np.sin(t)], 1)

  def rectangle(half_width: float, half_height: float):
    return np.array([[-half_width, -half_height], [half_width, -half_height], [half_width, half_height],
                     [-half_width, half_height]])

  def turned(points, angle):
    c, s = math.cos(angle), math.sin(angle)
    return points @ np.array([[c, s], [-s, c]])

  if name == 'circle':
    return [(ellipse(1, 1), 255)]
  if name == 'ring':
    return [(ellipse(1, 1), 255), (ellipse(0.6, 0.6), 0)]
  if name == 'square':
    return [(rectangle(0.8, 0.8), 255)]
  if name == 'diamond':
    return [(np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]), 255)]
  if name == 'triangle':
    t = -math.pi / 2 + np.arange(3) * 2 * math.pi / 3
    return [(np.stack([np.cos(t), np.sin(t)], 1), 255)]
  if name == 'star':
    t = -math.pi / 2 + np.arange(10) * math.pi / 5
    r = np.where(np.arange(10) % 2 == 0, 1.0, 0.42)
    return [(np.stack([r * np.cos(t), r * np.sin(t)], 1), 255)]
  if name == 'plus':
    return [(rectangle(1, 0.24), 255), (rectangle(0.24, 1), 255)]
  if name == 'cross':
    return [(turned(rectangle(1, 0.22), math.pi / 4), 255), (turned(rectangle(1, 0.22), -math.pi / 4), 255)]
  if name == 'bar':
    return [(rectangle(1, 0.2), 255)]
  if name == 'ellipse':
    return [(ellipse(1, 0.5), 255)]
  raise ValueError(name)


OUTLINES = {name: outline(name) for name in SHAPES}


def render(spec: dict, size: int) -> np.ndarray:
  """uint8 [size, size, 3]: the background, each shape composited through its anti-aliased mask, noise."""
  from PIL import Image, ImageDraw  # pylint: disable=g-import-not-at-top
  y, x = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
  along = math.cos(spec['direction']) * (x - 0.5) + math.sin(spec['direction']) * (y - 0.5) + 0.5
  low, high = spec['background']
  image = low + (high - low) * np.clip(along, 0, 1)[..., None]
  big = size * SUPERSAMPLE
  for shape in spec['shapes']:
    mask = Image.new('L', (big, big), 0)
    draw = ImageDraw.Draw(mask)
    c, s = math.cos(shape['angle']), math.sin(shape['angle'])
    for points, value in OUTLINES[shape['name']]:
      placed = (points @ np.array([[c, s], [-s, c]]) * shape['radius'] + shape['centre']) * SUPERSAMPLE
      draw.polygon([tuple(p) for p in placed], fill=value)
    alpha = np.asarray(mask.reduce(SUPERSAMPLE), np.float32)[..., None] / 255
    image = image * (1 - alpha) + shape['colour'] * alpha
  noise = np.random.default_rng(spec['noise_seed']).normal(0, 8, image.shape).astype(np.float32)
  return np.clip(image + noise, 0, 255).round().astype(np.uint8)


def write_chunk(task: tuple) -> tuple[list[tuple[int, int, list[str]]], int, int]:
  """Draws and writes images [start, stop) of a split; returns (split, index, tags) per image, and how many
  were written and how many bytes."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  out, seed, split, start, stop, size, count_probs, image_format, quality = task
  rows, written, size_bytes = [], 0, 0
  for index in range(start, stop):
    spec = scene(seed, split, index, size, count_probs)
    rows.append((split, index, [shape['name'] for shape in spec['shapes']]))
    path = os.path.join(out, relative_path(SPLITS[split], index, image_format))
    if os.path.exists(path):
      continue
    partial = path + '.partial'  # not an image extension: never listed
    options = {'format': 'JPEG', 'quality': quality} if image_format == 'jpg' else {'format': 'PNG'}
    Image.fromarray(render(spec, size)).save(partial, **options)
    size_bytes += os.path.getsize(partial)
    os.replace(partial, path)
    written += 1
  return rows, written, size_bytes


def write_labels(path: str, rows, image_format: str) -> None:
  """`path,labels,split` rows, the tags in SHAPES order."""
  with open(path + '.partial', 'w', newline='', encoding='utf-8') as f:
    writer = csv.writer(f)
    writer.writerow(['path', 'labels', 'split'])
    for split, index, tags in rows:
      writer.writerow([relative_path(SPLITS[split], index, image_format), ';'.join(tags), SPLITS[split]])
  os.replace(path + '.partial', path)


def single_label_rows(labels_csv: str) -> list[dict]:
  """The rows of a labels.csv whose image holds exactly one shape."""
  with open(labels_csv, newline='', encoding='utf-8') as f:
    return [row for row in csv.DictReader(f) if row['labels'] and ';' not in row['labels']]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True, help='folder for train/, test/ and labels.csv')
  parser.add_argument('--train', type=int, default=20000, help='train images')
  parser.add_argument('--test', type=int, default=2000, help='test images')
  parser.add_argument('--size', type=int, default=32, help='image side in pixels')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--count-probs', type=float, nargs=4, default=(0.1, 0.3, 0.3, 0.3),
                      metavar=('P0', 'P1', 'P2', 'P3'), help='how often an image holds 0, 1, 2, 3 shapes')
  parser.add_argument('--format', choices=('png', 'jpg'), default='png')
  parser.add_argument('--quality', type=int, default=90, help='JPEG quality (--format jpg)')
  parser.add_argument('--single', default='', metavar='FILE',
                      help='also write OUT/FILE: the rows of images holding exactly one shape')
  parser.add_argument('--workers', type=int, default=os.cpu_count() or 1,
                      help='processes (default: every core)')
  args = parser.parse_args()
  count_probs = np.asarray(args.count_probs, np.float64)
  if (count_probs < 0).any() or not math.isclose(count_probs.sum(), 1.0, abs_tol=1e-6):
    parser.error('--count-probs must be 4 non-negative numbers summing to 1')
  count_probs = tuple(count_probs / count_probs.sum())
  for split in SPLITS:
    os.makedirs(os.path.join(args.out, split), exist_ok=True)
  tasks = [(args.out, args.seed, split, start, min(start + CHUNK, count), args.size, count_probs, args.format,
            args.quality)
           for split, count in enumerate((args.train, args.test)) for start in range(0, count, CHUNK)]
  total = args.train + args.test
  print(f'{args.out}: {args.train:,} train + {args.test:,} test {args.size}x{args.size} '
        f'{args.format.upper()}s, '
        f'{len(SHAPES)} shapes, {args.workers} processes', flush=True)
  started = time.perf_counter()
  rows, written, size_bytes = [], 0, 0
  if args.workers > 1:
    with multiprocessing.get_context('spawn').Pool(args.workers) as pool:
      results = list(pool.imap(write_chunk, tasks))
  else:
    results = [write_chunk(task) for task in tasks]
  for chunk_rows, w, b in results:
    rows += chunk_rows
    written, size_bytes = written + w, size_bytes + b
  write_labels(os.path.join(args.out, 'labels.csv'), rows, args.format)
  seconds = time.perf_counter() - started
  counts = np.bincount([len(tags) for _, _, tags in rows], minlength=4)
  per_shape = {name: sum(name in tags for _, _, tags in rows) for name in SHAPES}
  print(f'wrote {written:,} images ({size_bytes / 2**20:,.1f} MiB), skipped {total - written:,} already '
        'there, '
        f'in {seconds:.1f} s ({written / max(seconds, 1e-9):,.0f} images/s); labels.csv: '
        f'{", ".join(f"{n} shapes {c:,}" for n, c in enumerate(counts))}')
  print('images per shape: ' + ', '.join(f'{name} {count:,}' for name, count in per_shape.items()))
  if args.single:
    single = single_label_rows(os.path.join(args.out, 'labels.csv'))
    path = os.path.join(args.out, args.single)
    with open(path + '.partial', 'w', newline='', encoding='utf-8') as f:
      writer = csv.DictWriter(f, ['path', 'labels', 'split'])
      writer.writeheader()
      writer.writerows(single)
    os.replace(path + '.partial', path)
    in_split = {split: sum(row['split'] == split for row in single) for split in SPLITS}
    print(f'{path}: {len(single):,} single-shape images ({in_split["train"]:,} train, '
          f'{in_split["test"]:,} test)')


if __name__ == '__main__':
  main()
