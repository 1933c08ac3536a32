"""A study's trial (config.search, set by `python -m flaxtpu.sweep --trials=N`) reports each evaluation's
checkpoint.best_metric to its study; where Optuna's pruner says so, the run stops as early stopping
stops it: saved, results.json marked `pruned`, exit 0.

The report goes straight to the study's storage (see flaxtpu/sweep/study.py for why). A storage that
cannot be reached never stops training: one warning line, then the run goes on unpruned.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from flaxtpu.loop.progress import Progress
from flaxtpu.settings.metric_names import best_metric


class Pruning:
  """The trial's link to its study, opened at the first evaluation (None where the run is no trial)."""

  def __init__(self, config: ml_collections.ConfigDict):
    self._search = config.search
    self._metric = best_metric(config) or 'eval_accuracy'
    self._trial: Any = None
    self._broken = False

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> Optional[Pruning]:
    return cls(config) if config.search.storage and config.search.trial >= 0 else None

  def update(self, progress: Progress, step: int, results: dict) -> None:
    """Reports `results`' metric at `step`; sets `progress.stopped_early` where the trial is pruned.
    Every process reaches this: process 0 asks the study and tells the others."""
    value = results.get(self._metric)
    prune = False
    if jax.process_index() == 0 and value is not None and not self._broken:
      try:
        trial = self._open()
        trial.report(float(value), step)
        prune = trial.should_prune()
      except Exception as error:  # a database or disk that went away must not stop training
        self._broken = True
        logging.warning('search: cannot report to study %r in %s (%s: %s); training goes on unpruned',
                        self._search.study, self._search.storage, type(error).__name__,
                        str(error).splitlines()[0] if str(error) else '')
    if jax.process_count() > 1:
      prune = bool(multihost_utils.broadcast_one_to_all(np.array(prune)))
    if prune:
      progress.stopped_early = {'step': step, 'metric': self._metric, 'value': float(value), 'pruned': True,
                                'trial': self._search.trial}

  def _open(self):
    if self._trial is None:
      from flaxtpu.sweep import study as studies  # pylint: disable=g-import-not-at-top
      study = studies.study_pruner(self._search.storage, self._search.study)
      trial_id = study._storage.get_trial_id_from_study_id_trial_number(  # pylint: disable=protected-access
          study._study_id, self._search.trial)  # pylint: disable=protected-access
      self._trial = studies.optuna().trial.Trial(study, trial_id)
    return self._trial


def log_pruned(stopped: dict) -> None:
  logging.info('pruned at step %d: the study\'s pruner stopped trial %d (%s %.4g); a checkpoint is saved and '
               'results.json is marked pruned', stopped['step'], stopped['trial'], stopped['metric'],
               stopped['value'])
