"""The data audit's findings (`--mode=audit`, run by flaxtpu/modes/audit.py): exact and near duplicates,
copies across splits, unreadable files and suspected wrong labels. No JAX here.

It streams: each file is read once, by a few threads, and only its SHA-256, its 64-bit perceptual hash
(`imagehash.phash`: the signs of the 8x8 lowest DCT frequencies of a 32x32 grayscale copy, which a
resize or a JPEG re-encoding barely changes) and its label are kept, never its pixels. Near copies are
pairs of hashes within `near_distance` bits, found without comparing every pair: by the pigeonhole
principle two hashes that close agree exactly on one of `near_distance + 1` bands of their bits, so
only images sharing a band are compared. Wrong labels are found by confident learning (Northcutt et
al. 2021) from a trained model's probabilities: per-class thresholds (the mean probability of a class
over the images labelled with it), and an image is suspect when the most probable class above its
threshold is not its label; the most suspect (lowest probability of their label) come first.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from typing import Iterator, Optional, Sequence

import numpy as np

from flaxtpu import files, storage

CHUNK = 512  # files handed to the threads at a time: memory holds one chunk's bytes, never a split's
HASH_SIDE = 64  # a JPEG decodes at the smallest DCT scale that still covers this (pHash reads 32x32)


@dataclasses.dataclass
class Scan:
  """What the audit keeps of every file: its path, split, label, content and perceptual hashes."""
  paths: list = dataclasses.field(default_factory=list)
  splits: list = dataclasses.field(default_factory=list)  # the split's name ('train')
  labels: list = dataclasses.field(default_factory=list)
  sha: list = dataclasses.field(default_factory=list)  # bytes (32) or None when unreadable
  phash: list = dataclasses.field(default_factory=list)  # int (64 bits) or None when unreadable
  unreadable: list = dataclasses.field(default_factory=list)  # [path, reason]


def _read(path: str) -> bytes:
  if storage.is_remote(path):
    return files.open_bytes(path)
  with open(path, 'rb') as f:
    return f.read()


def file_hashes(path: str) -> tuple[Optional[bytes], Optional[int], str]:
  """(SHA-256 of the bytes, 64-bit pHash of the decoded image, '') or (.., None, the reason it cannot
  be decoded)."""
  import io  # pylint: disable=g-import-not-at-top

  import imagehash  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  try:
    data = _read(path)
  except OSError as e:
    return None, None, f'cannot be read ({e.strerror or e})'
  digest = hashlib.sha256(data).digest()
  try:
    with Image.open(io.BytesIO(data)) as image:
      if image.format == 'JPEG':
        image.draft('L', (HASH_SIDE, HASH_SIDE))
      image.load()
      bits = imagehash.phash(image.convert('L')).hash.ravel()
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else ''
    return digest, None, f'cannot be decoded ({type(e).__name__}{": " + first if first else ""})'
  return digest, int(np.packbits(bits).view('>u8')[0]), ''


def scan(splits: Sequence[tuple[str, Sequence[str], Sequence[int]]], workers: int) -> Scan:
  """Hashes every file of the (split name, paths, labels) given, `workers` threads at a time; a path
  listed by two splits is kept once, under the first."""
  result, seen = Scan(), set()
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    for chunk in _chunks(splits, seen):
      for (split, path, label), (digest, phash, problem) in zip(
          chunk, pool.map(file_hashes, [path for _, path, _ in chunk])):
        if problem:
          result.unreadable.append([path, problem])
          continue
        result.paths.append(path)
        result.splits.append(split)
        result.labels.append(int(label))
        result.sha.append(digest)
        result.phash.append(phash)
  return result


def _chunks(splits, seen: set) -> Iterator[list]:
  chunk = []
  for name, paths, labels in splits:
    for path, label in zip(paths, labels):
      if path in seen:
        continue
      seen.add(path)
      chunk.append((name, path, label))
      if len(chunk) == CHUNK:
        yield chunk
        chunk = []
  if chunk:
    yield chunk


def _components(count: int, pairs: np.ndarray) -> np.ndarray:
  """The connected component of each of `count` nodes joined by the edges `pairs` [E, 2] (scipy)."""
  from scipy.sparse import coo_matrix  # pylint: disable=g-import-not-at-top
  from scipy.sparse.csgraph import connected_components  # pylint: disable=g-import-not-at-top
  pairs = pairs.reshape(-1, 2)
  graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(count, count))
  return connected_components(graph, directed=False)[1]


def near_pairs(hashes: np.ndarray, distance: int) -> np.ndarray:
  """[E, 2] index pairs of uint64 `hashes` at most `distance` bits apart (each pair once, i < j).

  Splits the bits into distance + 1 bands: two such hashes agree on at least one, so only hashes
  sharing a band's value (a sort away) are compared.
  """
  hashes = np.asarray(hashes, np.uint64)
  bands = distance + 1
  edges = np.linspace(0, 64, bands + 1).astype(int)
  found = []
  for low, high in zip(edges[:-1], edges[1:]):
    keys = (hashes >> np.uint64(low)) & np.uint64((1 << (high - low)) - 1)
    order = np.argsort(keys, kind='stable')
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    ends = np.r_[starts[1:], len(order)]
    for start, end in zip(starts, ends):
      if end - start < 2:
        continue
      members = order[start:end]
      close = np.bitwise_count(hashes[members][:, None] ^ hashes[members][None, :]) <= distance
      first, second = np.nonzero(np.triu(close, 1))
      found.append(np.stack([members[first], members[second]], axis=1))
  if not found:
    return np.zeros((0, 2), np.int64)
  pairs = np.concatenate(found)
  pairs = np.sort(pairs, axis=1)
  return np.unique(pairs, axis=0)


def duplicates(result: Scan, near_distance: int, eval_split: str) -> dict:
  """exact_duplicates, near_duplicates and leaks (train path, eval path) of a scan, paths sorted."""
  count = len(result.paths)
  if not count:
    return {'exact_duplicates': [], 'near_duplicates': [], 'leaks': []}
  content = {}
  same = np.asarray([content.setdefault(digest, index) for index, digest in enumerate(result.sha)])
  exact_pairs = np.stack([np.arange(count), same], axis=1)[same != np.arange(count)]
  exact = _components(count, exact_pairs)
  # Near copies: among one image per content, so an exact copy is never also called a near one.
  firsts = np.flatnonzero(same == np.arange(count))
  near = near_pairs(np.asarray([result.phash[i] for i in firsts], np.uint64), near_distance)
  near = firsts[near] if len(near) else np.zeros((0, 2), np.int64)
  both = _components(count, np.concatenate([exact_pairs, near]))

  def groups(labels: np.ndarray, distinct: bool) -> list[list[int]]:
    order = np.argsort(labels, kind='stable')
    starts = np.flatnonzero(np.r_[True, labels[order][1:] != labels[order][:-1]])
    found = []
    for start, end in zip(starts, np.r_[starts[1:], count]):
      members = order[start:end]
      if len(members) > 1 and (not distinct or len(np.unique(same[members])) > 1):
        found.append(members)
    return found

  named = lambda found: sorted(sorted(result.paths[i] for i in members) for members in found)
  leaks = []
  for members in groups(both, distinct=False):
    evaluated = sorted(result.paths[i] for i in members if result.splits[i] == eval_split)
    trained = sorted(result.paths[i] for i in members if result.splits[i] != eval_split)
    leaks += [[train, evaluated_path] for train in trained for evaluated_path in evaluated]
  return {'exact_duplicates': named(groups(exact, distinct=False)),
          'near_duplicates': named(groups(both, distinct=True)), 'leaks': sorted(leaks)}


def suspected_mislabels(labels: np.ndarray, label_probability: np.ndarray, top_classes: np.ndarray,
                        top_probabilities: np.ndarray, num_classes: int) -> list[tuple[int, int, float]]:
  """Confident learning's label issues, most suspect first: (example, the class it likely is, score).

  `label_probability` [N]: each example's probability of its own label; `top_classes`/`top_probabilities`
  [N, K]: its K most probable classes (the rest cannot be the most probable class above its threshold
  in practice). The threshold of class j is the mean probability of j over the examples labelled j; an
  example is suspect when the most probable class whose probability reaches its threshold is another
  than its label. Score: 1 - the probability of its label (1 = surely wrong).
  """
  labels = np.asarray(labels)
  thresholds = np.full(num_classes, np.inf)
  for j in range(num_classes):
    if np.any(labels == j):
      thresholds[j] = label_probability[labels == j].mean()
  above = top_probabilities >= thresholds[top_classes]
  ranked = np.where(above, top_probabilities, -1.0)
  best = np.argmax(ranked, axis=1)
  confident = ranked[np.arange(len(labels)), best] >= 0
  likely = top_classes[np.arange(len(labels)), best]
  suspects = np.flatnonzero(confident & (likely != labels))
  suspects = suspects[np.argsort(label_probability[suspects], kind='stable')]
  return [(int(i), int(likely[i]), float(1.0 - label_probability[i])) for i in suspects]


def class_counts(result: Scan, class_names: Sequence[str]) -> dict:
  """{split: {class: readable images}}, every class listed in every split."""
  counts = {}
  for split, label in zip(result.splits, result.labels):
    counts.setdefault(split, dict.fromkeys(class_names, 0))[class_names[label]] += 1
  return counts


def summary(report: dict) -> str:
  """The audit in a few lines for the log."""
  mislabels = report['suspected_mislabels']
  lines = [f'audit of {report["images"]} images ({", ".join(report["splits"])}):',
           f'  exact duplicates: {len(report["exact_duplicates"])} groups '
           f'({sum(len(g) for g in report["exact_duplicates"])} files)',
           f'  near duplicates:  {len(report["near_duplicates"])} groups '
           f'({sum(len(g) for g in report["near_duplicates"])} files, pHash within '
           f'{report["near_distance"]} bits)',
           f'  leaks (train copy of an eval image): {len(report["leaks"])} pairs',
           f'  unreadable: {len(report["unreadable"])} files']
  lines.append(f'  suspected mislabels: {len(mislabels)}' + (
      f' (most suspect: {os.path.basename(mislabels[0]["path"])} labelled {mislabels[0]["label"]}, '
      f'looks like {mislabels[0]["predicted"]})' if mislabels else f' ({report["mislabels_note"]})'))
  for split, counts in report['class_counts'].items():
    shown = ', '.join(f'{name} {count}' for name, count in list(counts.items())[:8])
    lines.append(f'  {split}: {shown}{", ..." if len(counts) > 8 else ""}')
  return '\n'.join(lines)


def check_config(config) -> None:
  """config.audit's keys, for config.validate."""
  from flaxtpu.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if not 0 <= config.audit.near_distance <= 32:
    raise ConfigError(f'config.audit.near_distance={config.audit.near_distance} must lie in [0, 32] bits '
                      'of the 64-bit perceptual hash (6 finds resized and re-encoded copies)')
  if not config.audit.workers > 0:
    raise ConfigError(f'config.audit.workers={config.audit.workers!r} must be > 0')
