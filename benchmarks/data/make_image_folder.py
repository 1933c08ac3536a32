"""Writes a generated image folder (split/class/image.jpg, mixed sizes) for the input benchmarks.

    python -m benchmarks.data.make_image_folder --out /data/gen1000  # 100,000 train JPEGs
    python -m benchmarks.data.make_image_folder --out /data/gen1000_small --train-per-class 10  # 10,000
    python -m benchmarks.data.make_image_folder --out /tmp/tiny --classes 5 --train-per-class 20  # smoke test

Layout `OUT/train/class_0000/00000.jpg ... OUT/test/...`, what `--config.dataset.folder`
reads. Each image has its own width and height (uniform in [--min-side, --max-side],
so aspect ratios vary too) and shows its class's two-colour gradient at the
class's angle, with stripes at the class's frequency, a per-image colour jitter and
pixel noise: learnable, cheap to make, and JPEG-encoded at --quality like a photo
(though smaller than ImageNet's ~400x350 average, so decoding costs less per image).

Image i of a class and split depends only on (--seed, split, class, i): the
output is the same for any --workers, a rerun skips files that exist (an
interrupted run resumes; partial files are written under a temporary name and
renamed), and a folder made with `--train-per-class 10` holds exactly the first
10 train images per class of one made with 100 (the test splits are identical).
"""

import argparse
import math
import multiprocessing
import os
import time

import numpy as np

SPLITS = ('train', 'test')


def class_name(label: int) -> str:
  return f'class_{label:04d}'


def class_style(seed: int, label: int) -> dict:
  """What every image of a class shares: two colours, the gradient angle, stripe frequency and strength."""
  rng = np.random.default_rng([seed, 1_000_003, label])
  return {'colours': rng.integers(0, 256, (2, 3)).astype(np.float32),
          'angle': rng.uniform(0, math.pi),
          'frequency': rng.uniform(1.0, 8.0),
          'stripes': rng.uniform(10.0, 50.0)}


def make_image(seed: int, split: int, label: int, index: int, min_side: int, max_side: int) -> np.ndarray:
  """uint8 [H, W, 3]: the class pattern at a random size, jittered, with noise."""
  style = class_style(seed, label)
  rng = np.random.default_rng([seed, split, label, index])
  width, height = (int(side) for side in rng.integers(min_side, max_side + 1, 2))
  angle = style['angle'] + rng.normal(0, 0.15)
  y, x = np.meshgrid(np.linspace(0, 1, height, dtype=np.float32),
                     np.linspace(0, 1, width, dtype=np.float32), indexing='ij')
  along = (math.cos(angle) * x + math.sin(angle) * y) / (abs(math.cos(angle)) + abs(math.sin(angle)))
  across = -math.sin(angle) * x + math.cos(angle) * y
  low, high = style['colours'] + rng.normal(0, 12, (2, 3)).astype(np.float32)
  image = low + (high - low) * along[..., None]
  stripes = np.sin(2 * math.pi * style['frequency'] * across + rng.uniform(0, 2 * math.pi))
  image += (style['stripes'] * stripes)[..., None]
  image += rng.normal(0, 6, image.shape).astype(np.float32)
  return np.clip(image, 0, 255).astype(np.uint8)


def write_class(task: tuple) -> tuple[int, int, int]:
  """Writes one class of one split; returns (images written, images already there, bytes written)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  out, seed, split, label, count, min_side, max_side, quality = task
  directory = os.path.join(out, SPLITS[split], class_name(label))
  os.makedirs(directory, exist_ok=True)
  written = skipped = size = 0
  for index in range(count):
    path = os.path.join(directory, f'{index:05d}.jpg')
    if os.path.exists(path):
      skipped += 1
      continue
    partial = os.path.join(directory, f'.{index:05d}.jpg.partial')  # not an image extension: never listed
    Image.fromarray(make_image(seed, split, label, index, min_side, max_side)).save(
        partial, format='JPEG', quality=quality)
    size += os.path.getsize(partial)
    os.replace(partial, path)
    written += 1
  return written, skipped, size


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--classes', type=int, default=1000)
  parser.add_argument('--train-per-class', type=int, default=100)
  parser.add_argument('--test-per-class', type=int, default=10)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--min-side', type=int, default=64)
  parser.add_argument('--max-side', type=int, default=320)
  parser.add_argument('--quality', type=int, default=85)
  parser.add_argument('--workers', type=int, default=os.cpu_count() or 1,
                      help='processes (default: every core)')
  args = parser.parse_args()
  if not 0 < args.min_side <= args.max_side:
    parser.error('need 0 < --min-side <= --max-side')
  tasks = [(args.out, args.seed, split, label, count, args.min_side, args.max_side, args.quality)
           for split, count in enumerate((args.train_per_class, args.test_per_class))
           for label in range(args.classes) if count > 0]
  total = args.classes * (args.train_per_class + args.test_per_class)
  print(f'{args.out}: {args.classes} classes x ({args.train_per_class} train + {args.test_per_class} test) '
        f'= {total:,} JPEGs, sides {args.min_side}..{args.max_side}, quality {args.quality}, '
        f'{args.workers} processes', flush=True)
  started = last_report = time.perf_counter()
  written = skipped = size = 0
  with multiprocessing.get_context('spawn').Pool(args.workers) as pool:
    for done, (w, s, b) in enumerate(pool.imap_unordered(write_class, tasks), 1):
      written, skipped, size = written + w, skipped + s, size + b
      if time.perf_counter() - last_report > 10 and done < len(tasks):
        last_report = time.perf_counter()
        rate = written / (last_report - started)
        print(f'  {written + skipped:,}/{total:,} ({skipped:,} already there)  {rate:,.0f} images/s',
              flush=True)
  seconds = time.perf_counter() - started
  print(f'wrote {written:,} images ({size / 2**20:,.1f} MiB, {size / max(written, 1) / 1024:.1f} KiB each), '
        f'skipped {skipped:,} already there, in {seconds:.1f} s: {written / seconds:,.0f} images/s '
        f'with {args.workers} processes')


if __name__ == '__main__':
  main()
