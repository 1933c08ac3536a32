"""The probability each tag must reach in --mode=predict (and in the export): chosen by an evaluation.

--mode=eval and the end of a run write thresholds*.json (`report.tables`); `tag_thresholds` picks the one
that matches the checkpoint predicted with.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from flaxtpu.evaluation.evaluate import report_about
from flaxtpu.io import files
from flaxtpu.report import metrics as report_metrics
from flaxtpu.report import tables


def tag_thresholds(config: ml_collections.ConfigDict, workdir: str, step: int,
                   class_names: list[str]) -> tuple[np.ndarray, str]:
  """(the probability each tag must reach in --mode=predict, where it comes from).

  `eval.threshold` when set (the user's choice wins); else the per-class thresholds of an
  evaluation saved in WORKDIR/thresholds*.json: the one made of this step, these weights and this
  TTA, the run's own final evaluation (thresholds.json) first; else 0.5.
  """
  if config.eval.threshold:
    return np.full(len(class_names), config.eval.threshold), f'eval.threshold={config.eval.threshold:g}'
  wanted = report_about(config, step)
  candidates = []
  for name in sorted(files.listdir(workdir)) if files.isdir(workdir) else []:
    if not (name.startswith('thresholds') and name.endswith('.json')):
      continue
    saved = tables.read_thresholds(os.path.join(workdir, name), class_names)  # checked: a person may edit it
    if saved is None:
      continue  # another model's classes
    fit = tuple(saved.get(key) == wanted[key] for key in ('step', 'weights', 'tta'))
    candidates.append((fit + (name == tables.THRESHOLDS_FILE,), name, saved))
  if not candidates:
    return (np.full(len(class_names), report_metrics.DEFAULT_THRESHOLD),
            f'{report_metrics.DEFAULT_THRESHOLD:g} for every tag: no evaluation has chosen thresholds (run '
            '--mode=eval, or set --config.eval.threshold)')
  _, name, saved = max(candidates, key=lambda candidate: candidate[0])
  source = (f'per-class thresholds from {name} ({saved.get("chosen_by")}, {saved.get("split")} at step '
            f'{saved.get("step")}, {saved.get("weights")} weights)')
  if saved.get('step') != step:
    source += f'; predicting with step {step}: --mode=eval of it would choose its own'
  return np.array([saved['class_thresholds'][c] for c in class_names], np.float64), source
