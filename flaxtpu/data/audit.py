"""The data audit's findings (`--mode=audit`, run by flaxtpu/modes/audit.py): exact and near duplicates,
copies across splits, unreadable files and suspected wrong labels. No JAX here.

It streams: each file is read once, by a few threads, and only its SHA-256, its 64-bit perceptual hash
(`imagehash.phash`: the signs of the 8x8 lowest DCT frequencies of a 32x32 grayscale copy, which a
resize or a JPEG re-encoding barely changes) and its label are kept, never its pixels. Near copies are
pairs of hashes within `near_distance` bits, found without comparing every pair: by the pigeonhole
principle two hashes that close agree exactly on one of `near_distance + 1` bands of their bits, so
only images sharing a band are compared.

Wrong labels are found by confident learning (Northcutt, Jiang and Chuang 2021) from out-of-sample
probabilities (`flaxtpu/modes/audit_folds.py` makes them: each image scored by a model that never saw it):
per-class thresholds (the mean probability of a class over the images labelled with it), a confident
joint of given and likely labels, and cleanlab's rules for which images to flag (`find_label_issues`,
`RULES`), ranked by the normalised margin of their label. Implemented here in numpy, step for step as
`cleanlab.filter.find_label_issues` (cleanlab 2.9), which the tests compare it with.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from typing import Iterator, Optional, Sequence

import numpy as np

from flaxtpu.io import files, storage

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


def copy_groups(result: Scan, near_distance: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per readable image of a scan: the first image of its content, its group of exact copies and its
  group of exact or near copies (int [N] each)."""
  count = len(result.paths)
  content = {}
  same = np.asarray([content.setdefault(digest, index) for index, digest in enumerate(result.sha)],
                    np.int64).reshape(count)
  exact_pairs = np.stack([np.arange(count), same], axis=1)[same != np.arange(count)]
  exact = _components(count, exact_pairs)
  # Near copies: among one image per content, so an exact copy is never also called a near one.
  firsts = np.flatnonzero(same == np.arange(count))
  near = near_pairs(np.asarray([result.phash[i] for i in firsts], np.uint64), near_distance)
  near = firsts[near] if len(near) else np.zeros((0, 2), np.int64)
  return same, exact, _components(count, np.concatenate([exact_pairs, near]))


def duplicates(result: Scan, near_distance: int, eval_split: str) -> dict:
  """exact_duplicates, near_duplicates and leaks (train path, eval path) of a scan, paths sorted."""
  count = len(result.paths)
  if not count:
    return {'exact_duplicates': [], 'near_duplicates': [], 'leaks': []}
  same, exact, both = copy_groups(result, near_distance)

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


# --- suspected wrong labels: confident learning (Northcutt, Jiang and Chuang 2021) -------------

RULES = ('prune_by_noise_rate', 'confident_learning')  # audit.rule: cleanlab's `filter_by` of that name
LARGE = ('auto', 'features', 'sample')  # audit.large: how an audit over audit.fold_limit images scores
NEAR = 1e-6  # cleanlab's FLOATING_POINT_COMPARISON: a probability this close to a threshold reaches it
MISSING_CLASS_THRESHOLD = 2.0  # a class no example is labelled with: no probability reaches it


@dataclasses.dataclass(frozen=True)
class LabelIssues:
  """Confident learning's verdict on N examples of K classes."""
  ranked: np.ndarray  # int [S]: the suspects, most suspect first (lowest normalised margin)
  quality: np.ndarray  # float [N]: normalised margin (p(label) - max other p + 1) / 2; 0 = surely wrong
  likely: np.ndarray  # int [N]: the most probable class (for a suspect, never its label)
  thresholds: np.ndarray  # float [K]: per-class thresholds, the mean self-confidence of the class
  joint: np.ndarray  # int [K, K]: the confident joint, [given label, likely true label]


def confident_thresholds(labels: np.ndarray, probabilities: np.ndarray) -> np.ndarray:
  """t_j: the mean probability of class j over the examples labelled j (2 where none is)."""
  thresholds = np.full(probabilities.shape[1], MISSING_CLASS_THRESHOLD)
  order = np.argsort(labels, kind='stable')
  starts = np.flatnonzero(np.r_[True, labels[order][1:] != labels[order][:-1]]) if len(order) else []
  for start, end in zip(starts, np.r_[starts[1:], len(order)]):
    label = labels[order[start]]
    thresholds[label] = np.mean(probabilities[order[start:end], label])
  return np.maximum(thresholds, 2 * NEAR)


def confident_joint(labels: np.ndarray, probabilities: np.ndarray,
                    thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(C [K, K] with C[i, j] the examples labelled i confidently of class j, each example's confident
  class, whether it has one).

  An example's confident classes are those whose probability reaches their threshold; of two or more
  it counts under its most probable class (cleanlab: its argmax, whether confident or not); of none it
  is not counted. Every class keeps at least 1 on the diagonal.
  """
  count = probabilities.shape[1]
  confident = probabilities >= thresholds - NEAR
  bins = confident.sum(axis=1)
  guess = np.where(bins > 1, probabilities.argmax(axis=1), confident.argmax(axis=1))
  some = bins > 0
  joint = np.zeros((count, count), np.int64)
  np.add.at(joint, (labels[some], guess[some]), 1)
  np.fill_diagonal(joint, np.maximum(joint.diagonal(), 1))
  return joint, guess, some


def round_keeping_sum(values: np.ndarray) -> np.ndarray:
  """Integers near `values` with the same (rounded) sum: the entries furthest from their rounding
  take the difference (cleanlab's round_preserving_sum)."""
  values = np.asarray(values, np.float64)
  rounded = values.round()
  target = values.sum().round()
  while abs(rounded.sum().round() - target) > NEAR:
    difference = np.round(target - rounded.sum().round())
    step = -1 if difference < 0 else 1
    changes = min(int(abs(difference)), len(values))
    for i in np.argsort(values - rounded)[::-step][:changes]:
      rounded[i] += step
  return rounded.astype(np.int64)


def calibrated_joint(joint: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """The confident joint rescaled so that row i sums to the examples labelled i (and all to N)."""
  counts = np.bincount(labels, minlength=len(joint)).astype(np.float64)
  scaled = (joint.T / np.maximum(joint.sum(axis=1), 1e-100) * counts).T
  scaled = scaled / max(scaled.sum(), 1e-100) * counts.sum()
  return np.stack([round_keeping_sum(row) for row in scaled])


def prune_counts(joint: np.ndarray, keep: int = 1) -> np.ndarray:
  """[true class j, given label k]: how many examples labelled k to prune as truly j, each label
  keeping at least `keep` examples (cleanlab's _keep_at_least_n_per_class at frac_noise=1, which
  truncates to integers)."""
  counts = joint.T.astype(np.float64)
  diagonal = np.diagonal(counts)
  wanted = np.maximum(diagonal, keep)
  spread = np.maximum(np.count_nonzero(counts, axis=0) - 1.0, 1.0)
  counts = counts - (wanted - diagonal) / spread
  counts[counts < 0] = 0
  np.fill_diagonal(counts, wanted)
  return counts.astype(np.int64)


def find_label_issues(labels: Sequence[int], probabilities: np.ndarray,
                      rule: str = 'prune_by_noise_rate') -> LabelIssues:
  """Confident learning on out-of-sample `probabilities` [N, K] of examples labelled `labels` [N].

  `confident_learning`: a suspect is an example whose confident class (`confident_joint`) is not its
  label. `prune_by_noise_rate` (cleanlab's default): the calibrated confident joint estimates how
  many examples labelled k are truly j; that many of the examples labelled k with the largest margin
  p_j - p_k are suspects. Both then spare an example whose label is its most probable class, and rank
  the suspects by the normalised margin of their label, lowest first. This follows
  `cleanlab.filter.find_label_issues(labels, pred_probs, filter_by=rule,
  return_indices_ranked_by='normalized_margin')` step by step (cleanlab 2.9).
  """
  if rule not in RULES:
    raise ValueError(f'rule {rule!r}: one of {RULES}')
  labels = np.asarray(labels, np.int64)
  probabilities = np.asarray(probabilities)
  rows = np.arange(len(labels))
  thresholds = confident_thresholds(labels, probabilities)
  joint, guess, some = confident_joint(labels, probabilities, thresholds)
  if rule == 'confident_learning':
    suspect = some & (guess != labels)
  else:
    joint = calibrated_joint(joint, labels)
    prune = prune_counts(joint)
    suspect = np.zeros(len(labels), bool)
    for given in range(probabilities.shape[1]):
      members = np.flatnonzero(labels == given)
      if len(members) <= 1:  # cleanlab's min_examples_per_class=1
        continue
      for true in np.flatnonzero(prune[:, given]):
        if true != given:
          margin = probabilities[members, true] - probabilities[members, given]
          suspect[members[np.argsort(-margin)[:prune[true, given]]]] = True
  nudged = probabilities.copy()  # in their own dtype, as cleanlab computes
  nudged[rows, labels] += NEAR
  suspect &= nudged.argmax(axis=1) != labels
  others = probabilities.copy()
  others[rows, labels] = -np.inf
  quality = (probabilities[rows, labels] - others.max(axis=1) + 1) / 2
  candidates = np.flatnonzero(suspect)
  ranked = candidates[np.argsort(quality[candidates])]
  return LabelIssues(ranked=ranked, quality=quality, likely=probabilities.argmax(axis=1),
                     thresholds=thresholds, joint=joint)


def assign_folds(labels: np.ndarray, groups: np.ndarray, folds: int, seed: int) -> np.ndarray:
  """Each example's fold in [0, folds): stratified by label, and the members of a group (exact and
  near copies) in one fold, so no fold model has seen a copy of an image it scores."""
  labels, groups = np.asarray(labels), np.asarray(groups)
  rng = np.random.default_rng(seed)
  _, first = np.unique(groups, return_index=True)  # one representative per group
  fold_of_group, offset = {}, 0
  for label in np.unique(labels[first]):
    representatives = rng.permutation(first[labels[first] == label])
    for position, member in enumerate(representatives):
      fold_of_group[groups[member]] = (offset + position) % folds
    offset += len(representatives)  # the next class starts where this one stopped: balanced folds
  return np.asarray([fold_of_group[group] for group in groups], np.int64)


def choose_method(count: int, folds: int, fold_limit: int, large: str, backbone: str) -> tuple[str, str]:
  """(method, why) of the mislabel search over `count` images: `folds` (K fold models trained on all
  of them), `sample` (fold models on a stratified sample of `fold_limit`), `features` (a linear probe
  per fold on frozen embeddings of every image; `backbone` names where they come from, '' = none) or
  `none` (audit.folds=0)."""
  if folds == 0:
    return 'none', 'audit.folds=0: not looked for'
  if count <= fold_limit:
    return 'folds', (f'{count:,} images <= audit.fold_limit={fold_limit:,}: {folds} runs of the '
                     f'recipe, each on {folds - 1} of {folds} folds, score the fold they did not see')
  over = f'{count:,} images > audit.fold_limit={fold_limit:,}'
  if large == 'features' or (large == 'auto' and backbone):
    return 'features', (f'{over} and audit.large={large}: a linear probe per fold on the frozen '
                        f'embeddings of {backbone} scores every image out of fold')
  why = ('no frozen backbone (no config.init_from.checkpoint, no trained run in the workdir)'
         if large == 'auto' else 'audit.large=sample')
  return 'sample', (f'{over} and {why}: {folds} runs of the recipe on a stratified sample of '
                    f'{fold_limit:,} images score that sample out of fold')

# --- can the fold models tell? ------------------------------------------------------------------

CHANCE_FACTOR = 1.5  # fold models whose mean held-out accuracy is under this x chance are near chance
# Suspects over this share of the scored images are refused: not wrong labels. On 2,000 CIFAR-10 images with
# 1-5% flips, fold models at 2.5-5x chance flagged 37-48% (precision 0.01-0.07); digits with 1-10% flips,
# fold models at 9x chance, flagged about the share flipped (experiments/audit_real_data.py).
MOST_SUSPECTS = 0.25


def chance(labels: np.ndarray, num_classes: int) -> dict:
  """What a model that learnt nothing scores on `labels`: `uniform` (1 / num_classes: a guess) and
  `majority` (the share of the most common label: always guessing it); `chance` is the larger."""
  labels = np.asarray(labels, np.int64)
  uniform = 1.0 / max(1, num_classes)
  majority = float(np.bincount(labels).max() / len(labels)) if len(labels) else uniform
  return {'chance': round(max(uniform, majority), 4), 'uniform_chance': round(uniform, 4),
          'majority_share': round(majority, 4)}


def fold_accuracies(labels: np.ndarray, probabilities: np.ndarray, folds: np.ndarray) -> list[float]:
  """Each fold model's accuracy on the fold it did not see (its labels as given, flips included)."""
  labels, folds = np.asarray(labels), np.asarray(folds)
  right = np.asarray(probabilities).argmax(axis=1) == labels
  return [round(float(right[folds == k].mean()), 4) for k in range(int(folds.max()) + 1)
          if np.any(folds == k)]


def learnt_threshold(chance_accuracy: float) -> float:
  """The mean held-out accuracy fold models must reach to be trusted: CHANCE_FACTOR x chance, but at most
  halfway from chance to 1 (a majority class of 2/3 or more would otherwise ask for more than 100%)."""
  return min(CHANCE_FACTOR * chance_accuracy, (1 + chance_accuracy) / 2)


def verdict(accuracies: Sequence[float], chance_accuracy: float, suspects: int, scored: int,
            advice: str) -> tuple[str, str]:
  """('listed', '') when the fold models' suspects may be listed; else ('near_chance' or 'too_many',
  the one line that says why none are and what to change: `advice`).

  near_chance: the mean held-out accuracy is under `learnt_threshold(chance)`: the models' disagreements
  with the labels are their own guesses. too_many: the suspects would be over MOST_SUSPECTS of the scored
  images: more than could be wrong labels (a model that disagrees with that many labels is weak, not the
  labels); refused, not cut to the most suspect, since the ranking of such a model is noise too."""
  mean = float(np.mean(accuracies)) if len(accuracies) else 0.0
  threshold = learnt_threshold(chance_accuracy)
  if mean < threshold:
    return 'near_chance', (
        f'no suspected mislabels listed: the fold models\' mean held-out accuracy {mean:.3f} is near chance '
        f'{chance_accuracy:.3f} (under {threshold:.3f}, {CHANCE_FACTOR}x chance), so they cannot tell a '
        f'wrong label from their own mistakes; {advice}')
  if suspects > MOST_SUSPECTS * scored:
    return 'too_many', (
        f'no suspected mislabels listed: confident learning flags {suspects:,} of {scored:,} images '
        f'({suspects / max(scored, 1):.0%} > {MOST_SUSPECTS:.0%}), more than could be wrong labels: the fold '
        f'models (mean held-out accuracy {mean:.3f}, chance {chance_accuracy:.3f}) disagree with too many '
        f'labels; refused, not cut short; {advice}')
  return 'listed', ''


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
  search = report['mislabel_search']
  lines.append(f'  suspected mislabels: {len(mislabels)}' + (
      f' (most suspect: {os.path.basename(mislabels[0]["path"])} labelled {mislabels[0]["label"]}, '
      f'looks like {mislabels[0]["predicted"]})' if mislabels else ''))
  lines.append(f'    by {search["method"]}'
               + (f' ({search.get("scored", 0)} images scored out of fold, '
                  f'{"read back" if search.get("reused") else "computed"} in {search.get("directory")})'
                  if search['method'] != 'none' else '') + f': {search["why"]}')
  if 'fold_accuracies' in search:
    run = search.get('run_eval_accuracy')
    accuracies = ', '.join(f'{a:.3f}' for a in search['fold_accuracies'])
    lines.append(f'    fold models\' held-out accuracy: {accuracies} '
                 f'(mean {search["held_out_accuracy"]:.3f}); chance {search["chance"]:.3f} '
                 f'(1/{search["classes"]} classes {search["uniform_chance"]:.3f}, majority class '
                 f'{search["majority_share"]:.3f})'
                 + (f'; the run\'s own eval accuracy {run:.3f}' if run is not None else '; no trained run'))
  if search.get('note'):
    lines.append(f'    {search["note"]}')
  for split, counts in report['class_counts'].items():
    shown = ', '.join(f'{name} {count}' for name, count in list(counts.items())[:8])
    lines.append(f'  {split}: {shown}{", ..." if len(counts) > 8 else ""}')
  return '\n'.join(lines)


def check_config(config) -> None:
  """config.audit's keys, for config.validate."""
  from flaxtpu.settings.errors import ConfigError  # pylint: disable=g-import-not-at-top
  settings = config.audit
  if not 0 <= settings.near_distance <= 32:
    raise ConfigError(f'config.audit.near_distance={settings.near_distance} must lie in [0, 32] bits '
                      'of the 64-bit perceptual hash (6 finds resized and re-encoded copies)')
  if not settings.workers > 0:
    raise ConfigError(f'config.audit.workers={settings.workers!r} must be > 0')
  if settings.folds != 0 and not 2 <= settings.folds <= 50:
    raise ConfigError(f'config.audit.folds={settings.folds!r} must be 0 (no search for wrong labels) or '
                      '2..50 fold models (5 scores each image with a model trained on 80% of the others)')
  if not 0 < settings.steps_fraction <= 10:
    raise ConfigError(f'config.audit.steps_fraction={settings.steps_fraction!r} must lie in (0, 10]: '
                      "each fold model trains this multiple of the run's own length (1 = as long as the run)")
  if not 0 <= settings.min_epochs <= 1000:
    raise ConfigError(f'config.audit.min_epochs={settings.min_epochs!r} must lie in [0, 1000]: the fewest '
                      'epochs a fold model trains over its folds (0 = the run\'s length alone)')
  if not settings.fold_limit >= 2 * max(settings.folds, 1):
    raise ConfigError(f'config.audit.fold_limit={settings.fold_limit!r} must be at least 2 x audit.folds '
                      'images')
  if settings.large not in LARGE:
    raise ConfigError(f'config.audit.large={settings.large!r} must be one of {", ".join(LARGE)}')
  if settings.rule not in RULES:
    raise ConfigError(f'config.audit.rule={settings.rule!r} must be one of {", ".join(RULES)}')
