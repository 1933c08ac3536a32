"""Early stopping: the evaluations without improvement of the watched metric, counted in the run's
progress; at `early_stopping.patience` of them the run stops, and one line says why and which
checkpoint is the best."""

from __future__ import annotations

import logging

import ml_collections

from flaxtpu.loop.progress import Progress
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.metric_names import best_metric, metric_mode


def update(config: ml_collections.ConfigDict, progress: Progress, step: int, metric: str,
           results: dict) -> None:
  """Counts the evaluations without improvement of `metric`; at `patience` of them, the run stops
  (`progress.stopped_early` is set)."""
  if metric not in results:
    raise UserError(f'config.early_stopping.metric={metric!r} is not among the eval metrics '
                    f'({", ".join(sorted(results))}); pick one of them')
  stopping, value = config.early_stopping, float(results[metric])
  counters = progress.early_stopping
  best = counters.get('best')
  sign = 1.0 if metric_mode(metric, stopping.mode) == 'max' else -1.0
  if best is None or sign * (value - best) > stopping.min_delta:
    progress.early_stopping = {'best': value, 'best_step': step, 'evaluations_without_improvement': 0}
    return
  counters['evaluations_without_improvement'] += 1
  if counters['evaluations_without_improvement'] >= stopping.patience:
    progress.stopped_early = {'step': step, 'metric': metric, 'value': value, 'best': best,
                              'best_step': counters['best_step'], 'patience': stopping.patience}


def log_stop(config: ml_collections.ConfigDict, stopped: dict, checkpoints) -> None:
  """One line: why the run stopped early and which checkpoint is the best."""
  kept_by = best_metric(config)
  if not kept_by:
    best = "no best checkpoint is kept (checkpoint.best_metric='')"
  else:
    best_step = checkpoints.best_step()
    best = (f'the best checkpoint by {kept_by} is step {best_step} in {checkpoints.directory}'
            + (f' (checkpoint.best_metric={kept_by} is not early_stopping.metric={stopped["metric"]}: set it '
               f'to keep the best by {stopped["metric"]})' if kept_by != stopped['metric'] else ''))
  logging.info('stopped early at step %d: %s has not improved on its best, %.4g at step %d, for %d '
               'evaluations (early_stopping.patience); %s', stopped['step'], stopped['metric'],
               stopped['best'], stopped['best_step'], stopped['patience'], best)
