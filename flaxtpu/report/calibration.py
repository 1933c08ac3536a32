"""WORKDIR/calibration.json: the temperature and the prediction-set threshold that --mode=calibrate fits.

No JAX (numpy and scipy): `fit_temperature` minimises the NLL over log T with scipy; `read` checks the
file as strictly as the config (a person may edit it); `for_checkpoint` is the one rule for which
checkpoint a file applies to. `modes.restore` reads it, so the temperature reaches `steps.logits_fn`,
which eval, predict and export share. The prediction sets' math is `report.conformal`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Optional

import ml_collections
import numpy as np

from flaxtpu.io import files
from flaxtpu.report import conformal
from flaxtpu.settings.errors import ConfigError, UserError

CALIBRATION_FILE = 'calibration.json'
LOG_T_BOUNDS = (math.log(1e-2), math.log(1e2))  # temperatures searched: 0.01 .. 100


def nll(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> float:
  """Mean negative log-likelihood of the true classes under softmax(logits / temperature)."""
  import scipy.special  # pylint: disable=g-import-not-at-top  (config.py imports this module: no scipy there)
  log_probs = scipy.special.log_softmax(np.asarray(logits, np.float64) / temperature, axis=-1)
  return float(-np.mean(log_probs[np.arange(len(labels)), labels]))


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
  """The temperature T > 0 minimising the NLL of softmax(logits / T) (Guo et al. 2017), found by
  scipy's bounded scalar search over log T (the NLL is convex in 1/T)."""
  import scipy.optimize  # pylint: disable=g-import-not-at-top
  result = scipy.optimize.minimize_scalar(lambda log_t: nll(logits, labels, math.exp(log_t)),
                                          bounds=LOG_T_BOUNDS, method='bounded', options={'xatol': 1e-6})
  return float(math.exp(result.x))


def check_config(config: ml_collections.ConfigDict) -> None:
  """config.calibrate's checks (config.validate runs them)."""
  calibrate = config.calibrate
  if not 0.0 < calibrate.coverage < 1.0:
    raise ConfigError(f'config.calibrate.coverage={calibrate.coverage!r} must be between 0 and 1, e.g. 0.9')
  if calibrate.score not in conformal.SCORES:
    raise ConfigError(f'config.calibrate.score={calibrate.score!r} is not valid; choose one of: '
                      + ', '.join(repr(s) for s in conformal.SCORES))
  if calibrate.raps_lambda < 0 or calibrate.raps_k < 0:
    raise ConfigError('config.calibrate.raps_lambda and raps_k must be >= 0 (e.g. 0.01 and 1)')


def path_of(workdir: str) -> str:
  return os.path.join(workdir, CALIBRATION_FILE)


_FIX = 're-run --mode=calibrate to rewrite it, or delete it to evaluate uncalibrated'


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# Each key of the file: (its check, what it must be).
_KEYS = {
    'temperature': (lambda v: _number(v) and v > 0, 'a positive finite number'),
    'step': (_whole, 'a checkpoint step (a whole number >= 0)'),
    'weights': (lambda v: v in ('raw', 'ema', 'swa'), '"raw", "ema" or "swa"'),
    'tta': (lambda v: isinstance(v, str) and bool(v), 'the test-time augmentation\'s name, e.g. "none"'),
    'num_classes': (lambda v: _whole(v) and v >= 2, 'the model\'s class count'),
    'coverage': (lambda v: _number(v) and 0 < v < 1, 'a number between 0 and 1, e.g. 0.9'),
    'set_threshold': (lambda v: _number(v) or v == 'inf', 'a finite number (or "inf": every class)'),
    'set_score': (lambda v: v in conformal.SCORES, ' or '.join(f'"{s}"' for s in conformal.SCORES)),
    'randomize': (lambda v: isinstance(v, bool), 'true or false'),
    'raps_lambda': (lambda v: _number(v) and v >= 0, 'a number >= 0'),
    'raps_k': (_whole, 'a whole number >= 0'),
    'seed': (_whole, 'a whole number >= 0'),
}


def read(path: str) -> dict[str, Any]:
  """calibration.json, each key checked; anything wrong is one UserError line naming the file, the key
  and the fix."""
  try:
    with files.open_file(path, encoding='utf-8') as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f'{path} cannot be read as JSON ({type(e).__name__}: {" ".join(str(e).split())}); '
                    f'{_FIX}') from None
  if not isinstance(record, dict):
    raise UserError(f'{path} holds no JSON object; {_FIX}')
  for key, (check, wanted) in _KEYS.items():
    if key not in record:
      raise UserError(f'{path} has no "{key}" ({wanted}); {_FIX}')
    if not check(record[key]):
      raise UserError(f'{path}: "{key}" is {json.dumps(record[key])}, not {wanted}; fix it, or {_FIX}')
  return record


def set_parameters(record: dict[str, Any]) -> conformal.SetRule:
  """How a calibration record's prediction sets are made (`report.conformal.prediction_sets`)."""
  threshold = math.inf if record['set_threshold'] == 'inf' else float(record['set_threshold'])
  return conformal.SetRule(threshold=threshold, score=record['set_score'], randomize=record['randomize'],
                           raps_lambda=float(record['raps_lambda']), raps_k=int(record['raps_k']),
                           seed=int(record['seed']))


def for_checkpoint(workdir: str, about: dict[str, Any], num_classes: int) -> Optional[dict[str, Any]]:
  """WORKDIR/calibration.json when it was fitted on the model restored (`about`: its step, weights and
  TTA, `evaluate.report_about`); None without one. A file of another step, weights or TTA is another
  model's scores: a one-line warning, and the model is used uncalibrated (its temperature and threshold
  would not hold their guarantee). A file that is not well-formed is an error (`read`)."""
  path = path_of(workdir)
  if not workdir or not files.isfile(path):
    return None
  record = read(path)
  differs = [f'{key} {record[key]} (this model: {about[key]})' for key in ('step', 'weights', 'tta')
             if record[key] != about[key]]
  if differs:
    logging.warning('%s was fitted on another model (%s): not applied, scores are uncalibrated; '
                    're-run --mode=calibrate for this checkpoint', path, ', '.join(differs))
    return None
  if record['num_classes'] != num_classes:
    raise UserError(f'{path} was fitted for {record["num_classes"]} classes but the checkpoint has '
                    f'{num_classes}; {_FIX}')
  return record
