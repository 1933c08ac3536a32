"""Split-conformal prediction sets with adaptive scores (numpy only): APS and RAPS.

APS (Romano, Sesia, Candes 2020): a class's score is the probability mass of the classes ranked above
it plus its own (times U ~ Uniform(0, 1) when randomised). RAPS (Angelopoulos et al. 2021) adds
lambda * max(0, rank - k) so that unlikely classes join late. `threshold` is the conformal quantile of
the calibration split's true-class scores: a new example's set (every class scoring at most the
threshold) holds its true class with probability >= coverage, in expectation over the calibration split
(exchangeable data). Confident examples get small sets, hard ones large.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

SCORES = ('aps', 'raps')
_CHUNK = 4096  # rows per pass: [N, C] scores are never held whole


class SetRule(NamedTuple):
  """How sets are made: the threshold and the score that fitted it."""
  threshold: float
  score: str = 'aps'
  randomize: bool = True
  raps_lambda: float = 0.0
  raps_k: int = 0
  seed: int = 0


def uniforms(count: int, rule: SetRule) -> np.ndarray:
  """U per example (its index order), from the rule's seed; 1 everywhere when not randomised."""
  if not rule.randomize:
    return np.ones(count)
  return np.random.default_rng(rule.seed).random(count)


def class_scores(probabilities: np.ndarray, u: np.ndarray, rule: SetRule) -> np.ndarray:
  """[N, C]: the score each class would have as the answer (higher = less plausible)."""
  probabilities = np.asarray(probabilities, np.float64)
  order = np.argsort(-probabilities, axis=1, kind='stable')
  ranked = np.take_along_axis(probabilities, order, axis=1)
  # Mass of the classes above, plus U times the class's own: cum - (1 - U) p.
  ranked_scores = np.cumsum(ranked, axis=1) - (1.0 - u[:, None]) * ranked
  if rule.score == 'raps':
    ranks = np.arange(1, probabilities.shape[1] + 1)
    ranked_scores = ranked_scores + rule.raps_lambda * np.maximum(0, ranks - rule.raps_k)[None]
  scores = np.empty_like(ranked_scores)
  np.put_along_axis(scores, order, ranked_scores, axis=1)
  return scores


def true_class_scores(probabilities: np.ndarray, labels: np.ndarray, rule: SetRule) -> np.ndarray:
  """[N]: each example's score of its true class (what the threshold is the quantile of)."""
  u = uniforms(len(labels), rule)
  out = np.empty(len(labels))
  for start in range(0, len(labels), _CHUNK):
    rows = slice(start, start + _CHUNK)
    out[rows] = class_scores(probabilities[rows], u[rows], rule)[np.arange(len(out[rows])), labels[rows]]
  return out


def threshold(scores: np.ndarray, coverage: float) -> float:
  """The k-th smallest of n calibration scores, k = ceil((n + 1) coverage) (inf when k > n, too few
  scores for the coverage: then every set holds every class)."""
  n = len(scores)
  k = math.ceil((n + 1) * coverage)
  if k > n:
    return math.inf
  return float(np.partition(np.asarray(scores, np.float64), k - 1)[k - 1])


def prediction_sets(probabilities: np.ndarray, rule: SetRule, logits: bool = False) -> np.ndarray:
  """bool [N, C]: the classes of each example's set (score <= threshold). With `logits`, the first
  argument is logits, turned into probabilities a block of rows at a time (no [N, C] float copy)."""
  u = uniforms(len(probabilities), rule)
  sets = np.empty(np.shape(probabilities), bool)
  for start in range(0, len(probabilities), _CHUNK):
    rows = slice(start, start + _CHUNK)
    block = np.asarray(probabilities[rows], np.float64)
    if logits:
      block = np.exp(block - block.max(axis=1, keepdims=True))
      block /= block.sum(axis=1, keepdims=True)
    sets[rows] = class_scores(block, u[rows], rule) <= rule.threshold
  return sets


def set_summary(sets: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """Coverage (the fraction of sets holding the true class) and mean set size."""
  return {'set_coverage': float(sets[np.arange(len(labels)), labels].mean()),
          'set_size': float(sets.sum(axis=1).mean())}
