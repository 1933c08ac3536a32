"""Peak memory of --mode=audit on generated folders of tiny images: it streams, so 10x the images
should cost about the same memory (hashes are kept, never pixels).

    python benchmarks/input/audit_memory.py 2000 20000 [100000]   # prints one line per folder size

Each audit runs in its own process (the CLI, as a user runs it); its peak RSS is that child's
ru_maxrss. Folders are generated under /tmp (16x16 PNGs of 10 classes, 80% train, 20% test).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_folder(root: str, count: int, seed: int = 0) -> None:
  rng = np.random.default_rng(seed)
  for index in range(count):
    split = 'train' if (index // 10) % 5 else 'test'
    folder = os.path.join(root, split, f'class{index % 10}')
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(
        os.path.join(folder, f'{index:06d}.png'))


def audit_peak_rss(folder: str, workdir: str) -> tuple[float, float]:
  """(peak RSS in MiB, seconds) of one `--mode=audit` process on `folder`."""
  started = time.time()
  result = subprocess.run([sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10.py',
                           f'--workdir={workdir}', '--mode=audit', f'--config.dataset.folder={folder}',
                           '--config.compilation_cache_dir=none'], cwd=ROOT, capture_output=True, text=True)
  if result.returncode:
    raise SystemExit(result.stderr[-2000:])
  return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, time.time() - started


def main(counts: list[int]) -> None:
  for count in counts:
    with tempfile.TemporaryDirectory() as scratch:
      folder = os.path.join(scratch, 'images')
      make_folder(folder, count)
      # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: run the sizes smallest first.
      peak, seconds = audit_peak_rss(folder, os.path.join(scratch, 'run'))
      print(f'{count} images: peak RSS {peak:.0f} MiB, {seconds:.0f} s ({count / seconds:.0f} images/s)',
            flush=True)


if __name__ == '__main__':
  main(sorted(int(arg) for arg in sys.argv[1:]) or [2000, 20000])
