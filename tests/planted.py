"""A generated image folder with planted problems, and how to score an audit against them (issue 40).

Images are smooth random patterns (an 8x8 random field enlarged) tinted by their class's colour, so a
small CNN learns the class from the colour and two different images have unrelated perceptual hashes.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
from PIL import Image

TINTS = {'red': (1.0, 0.35, 0.35), 'green': (0.35, 1.0, 0.35), 'blue': (0.35, 0.35, 1.0)}


def pattern(rng: np.random.Generator, label: int, size: int = 32) -> np.ndarray:
  """A uint8 [size, size, 3] image of class `label`: a smooth random field in the class's colour."""
  field = np.asarray(Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).resize(
      (size, size), Image.BICUBIC), np.float32)
  tint = np.asarray(list(TINTS.values())[label], np.float32)
  return np.uint8(np.clip(30 + 0.8 * field[..., None] * tint, 0, 255))


def make_planted_folder(root: str, *, train_per_class: int = 40, test_per_class: int = 15, copies: int = 6,
                        seed: int = 0) -> dict:
  """root/{train,test}/{red,green,blue}/*.png plus planted problems; returns the truth:

  exact: [original, copy] pairs within train; near: [original, resized+JPEG copy] pairs within train;
  leaks: [train copy, test original] pairs (half exact, half near copies); unreadable: paths;
  flipped: train paths filed under a wrong class.
  """
  rng = np.random.default_rng(seed)
  names = list(TINTS)
  paths = {'train': [], 'test': []}
  for split, count in (('train', train_per_class), ('test', test_per_class)):
    for label, name in enumerate(names):
      os.makedirs(os.path.join(root, split, name), exist_ok=True)
      for i in range(count):
        path = os.path.join(root, split, name, f'{split}{label}_{i:04d}.png')
        Image.fromarray(pattern(rng, label)).save(path)
        paths[split].append((path, label))
  truth = {'exact': [], 'near': [], 'leaks': [], 'unreadable': [], 'flipped': []}
  picks = rng.permutation(len(paths['train']))
  originals = [paths['train'][i] for i in picks[:2 * copies]]

  def near_copy(source: str, target: str, index: int) -> None:
    image = Image.open(source)
    side = (24, 48, 40, 28)[index % 4]  # smaller and larger, re-encoded as JPEG
    image.resize((side, side), Image.BILINEAR).save(target, quality=(70, 85, 60, 90)[index % 4])

  for index, (path, label) in enumerate(originals[:copies]):
    target = os.path.join(os.path.dirname(path), f'copy_{index}.png')
    shutil.copyfile(path, target)
    truth['exact'].append([path, target])
  for index, (path, label) in enumerate(originals[copies:]):
    target = os.path.join(os.path.dirname(path), f'near_{index}.jpg')
    near_copy(path, target, index)
    truth['near'].append([path, target])
  test_picks = rng.permutation(len(paths['test']))[:copies]
  for index, position in enumerate(test_picks):
    path, label = paths['test'][position]
    train_dir = os.path.join(root, 'train', names[label])
    if index % 2:
      target = os.path.join(train_dir, f'leak_near_{index}.jpg')
      near_copy(path, target, index)
      truth['near'].append([target, path])
    else:
      target = os.path.join(train_dir, f'leak_exact_{index}.png')
      shutil.copyfile(path, target)
      truth['exact'].append([target, path])
    truth['leaks'].append([target, path])
  for index in range(copies):
    target = os.path.join(root, 'train', names[index % 3], f'broken_{index}' + ('.png', '.jpg')[index % 2])
    if index % 2:
      data = b'\xff\xd8\xff\xe0 not really a JPEG'
    else:
      buffer = Image.fromarray(pattern(rng, 0))
      buffer.save(target)
      data = open(target, 'rb').read()[:60]  # cut off: a truncated PNG
    with open(target, 'wb') as f:
      f.write(data)
    truth['unreadable'].append(target)
  for index in range(2 * copies):  # fresh images filed under the next class
    label = index % 3
    target = os.path.join(root, 'train', names[(label + 1) % 3], f'flipped_{index}.png')
    Image.fromarray(pattern(rng, label)).save(target)
    truth['flipped'].append(target)
  return truth


def _rates(found: int, planted: int, correct: int, reported: int) -> dict:
  return {'recall': found / planted if planted else 1.0, 'precision': correct / reported if reported else 1.0,
          'planted': planted, 'reported': reported}


def score(report: dict, truth: dict) -> dict:
  """Recall and precision per kind of an audit.json against `make_planted_folder`'s truth.

  A duplicate pair is found when one reported group holds both; a reported group is correct when it
  holds a planted pair (and nothing else).
  """
  def groups(kind: str, planted: list) -> dict:
    reported = [set(group) for group in report[kind]]
    found = sum(any(set(pair) <= group for group in reported) for pair in planted)
    correct = sum(any(set(pair) == group for pair in planted) for group in reported)
    return _rates(found, len(planted), correct, len(reported))

  leaks = {tuple(pair) for pair in report['leaks']}
  planted_leaks = {tuple(pair) for pair in truth['leaks']}
  unreadable, planted_unreadable = set(report['unreadable']), set(truth['unreadable'])
  suspects = {row['path'] for row in report['suspected_mislabels']}
  flipped = set(truth['flipped'])
  return {'exact_duplicates': groups('exact_duplicates', truth['exact']),
          'near_duplicates': groups('near_duplicates', truth['near']),
          'leaks': _rates(len(leaks & planted_leaks), len(planted_leaks), len(leaks & planted_leaks),
                          len(leaks)),
          'unreadable': _rates(len(unreadable & planted_unreadable), len(planted_unreadable),
                               len(unreadable & planted_unreadable), len(unreadable)),
          'suspected_mislabels': _rates(len(suspects & flipped), len(flipped), len(suspects & flipped),
                                        len(suspects))}


def make_digits_folder(root: str, *, count: int = 1000, flips: int = 10, seed: int = 0) -> list[str]:
  """root/train/<digit>/*.png: `count` of the embedded 8x8 digits (flaxtpu/datasets), `flips` of them
  (at random) filed under another digit, also at random. Returns the flipped files' paths.

  Real handwriting: some genuine digits look like others, so the flips must outrank honest
  ambiguity, unlike the tinted patterns above.
  """
  from flaxtpu.data.sources.embedded import embedded_arrays  # pylint: disable=g-import-not-at-top
  images, labels, names = embedded_arrays('digits', 'train')
  rng = np.random.default_rng(seed)
  chosen = rng.permutation(len(labels))[:count]
  flipped = set(rng.choice(chosen, flips, replace=False).tolist())
  paths = []
  for index in chosen:
    label = int(labels[index])
    if index in flipped:
      label = (label + rng.integers(1, len(names))) % len(names)
    folder = os.path.join(root, 'train', names[label])
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f'{index:04d}.png')
    Image.fromarray(images[index][..., 0]).save(path)
    if index in flipped:
      paths.append(path)
  return paths


@contextlib.contextmanager
def compilation_cache_in(folder: str):
  """JAX's persistent compilation cache in `folder`, every program kept, as the CLI sets it
  (flaxtpu/main.py); the settings before it, and no cache object, afterwards."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
  names = {'jax_compilation_cache_dir': folder, 'jax_persistent_cache_min_compile_time_secs': 0.0,
           'jax_persistent_cache_min_entry_size_bytes': 0}
  before = {name: getattr(jax.config, name) for name in names}
  compilation_cache.reset_cache()
  for name, value in names.items():
    jax.config.update(name, value)
  try:
    yield
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()
