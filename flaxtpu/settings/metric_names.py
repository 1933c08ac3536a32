"""The names of the eval metrics a run watches: an extra eval split's prefix, the metric that keeps
the best checkpoint and the one early stopping follows, and whether each is kept at its max or min.
The extra eval splits' names are checked here not to clash.

No JAX: the config checks, the checkpoint manager and the loop all read these.
"""

from __future__ import annotations

import re

import ml_collections

from flaxtpu.settings.errors import ConfigError


def eval_metric_prefix(split: str, first: bool) -> str:
  """'eval_' for the first eval split; 'eval_train_5000_' for 'train[:5000]' among the others."""
  return 'eval_' if first else 'eval_' + re.sub(r'[^\w]+', '_', split).strip('_') + '_'


def check_eval_split_names(first: str, others) -> None:
  """The extra eval splits' metric names must differ from each other and from the first split's."""
  seen = {}
  for split in others:
    prefix = eval_metric_prefix(split, first=False)
    if prefix in seen or prefix.startswith(('eval_top5_', 'eval_loss_', 'eval_accuracy_', 'eval_balanced_',
                                            'eval_map_', 'eval_f1_', 'eval_threshold_')):
      clash = f'with {seen[prefix]!r} ' if prefix in seen else ''
      raise ConfigError(f'config.dataset.eval_splits entry {split!r} would log as {prefix}accuracy, '
                        f'which clashes {clash}with another metric; list each split once, written so the '
                        "names differ (e.g. 'train[:5000]', 'train[45000:]')")
    seen[prefix] = split


def metric_mode(metric: str, mode: str = 'auto') -> str:
  """'min' or 'max' for a watched eval metric: `mode`, or where 'auto', min for a *loss and max otherwise."""
  return mode if mode != 'auto' else ('min' if re.sub('_(ema|swa)$', '', metric).endswith('loss') else 'max')


def early_stopping_metric(config: ml_collections.ConfigDict) -> str:
  """early_stopping.metric, 'auto' resolved to the checkpoint's best metric ('' = off)."""
  metric = config.early_stopping.metric
  return metric if metric != 'auto' else best_metric(config)


def best_metric(config: ml_collections.ConfigDict) -> str:
  """checkpoint.best_metric, 'auto' resolved: eval_map for task=multilabel (the ranking quality, which
  no threshold sways), else eval_accuracy. Both are kept at their maximum."""
  metric = config.checkpoint.best_metric
  if metric != 'auto':
    return metric
  return 'eval_map' if config.task == 'multilabel' else 'eval_accuracy'
