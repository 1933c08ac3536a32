"""--mode=calibrate: a checkpoint's temperature and prediction-set threshold -> WORKDIR/calibration.json.

Fitted on `calibrate.split` (a split the run did not train on; default the eval split, with a warning),
from the checkpoint's uncalibrated logits: the temperature minimising the NLL (`calibration`), then the
split-conformal threshold of the calibrated probabilities' APS/RAPS scores (`report.conformal`). From
then on `modes.restore` applies both to that checkpoint in eval, predict and export.
"""

from __future__ import annotations

import logging
import os

import jax
import ml_collections
import numpy as np

from flaxtpu.data import pipeline
from flaxtpu.data.sources import base
from flaxtpu.data.spec import DatasetSpec
from flaxtpu.evaluation.evaluate import evaluate, report_about
from flaxtpu.io import files
from flaxtpu.modes.restore import restore
from flaxtpu.report import calibration, conformal
from flaxtpu.report import metrics as report_metrics
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size


def _overlaps(train: tuple[str, str, str], other: tuple[str, str, str]) -> bool:
  """Whether two parsed split parts (`sources.base.parse_spec`) share examples: the same split, and
  either is whole or their slices intersect (slices of different units, % and counts, pass)."""
  if train[0] != other[0]:
    return False
  if not any(train[1:]) or not any(other[1:]):
    return True
  units = {bound.endswith('%') for bound in (*train[1:], *other[1:]) if bound}
  if len(units) > 1:
    return False
  size = 10_000 if units == {True} else 10**12  # percentages to 0.01%; counts as they are
  (a, b), (c, d) = base.slice_bounds(*train[1:], size), base.slice_bounds(*other[1:], size)
  return max(a, c) < min(b, d)


def calibration_split(config: ml_collections.ConfigDict) -> str:
  """The split calibrate fits on; one that is (or holds all of) the training split is refused."""
  split = config.calibrate.split or config.dataset.eval_split
  if not config.calibrate.split:
    logging.warning('calibrate.split is empty: calibrating on the eval split %r, so eval scores on it '
                    '(ECE, set coverage) become optimistic; set --config.calibrate.split=%s[:50%%] and '
                    'evaluate on %s[50%%:]', split, split, split)
  if any(_overlaps(trained, part) for trained in base.parse_spec(config.dataset.train_split)
         for part in base.parse_spec(split)):
    raise UserError(f'config.calibrate.split={split!r} overlaps the training split '
                    f'{config.dataset.train_split!r}, whose scores are overconfident; calibrate on a split '
                    'the run did not train on, e.g. '
                    f'--config.calibrate.split="{config.dataset.eval_split}[:50%]"')
  return split


def calibrate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """--mode=calibrate: fits and writes WORKDIR/calibration.json; returns its record."""
  if config.task == 'multilabel':
    raise UserError('--mode=calibrate fits a softmax temperature and single-class prediction sets, but this '
                    'run is task=multilabel; its per-tag thresholds (thresholds.json of --mode=eval) are '
                    'what predict and export apply')
  if jax.process_count() > 1:
    raise UserError('--mode=calibrate runs on one process; start it without --num_processes')
  split = calibration_split(config)
  path = calibration.path_of(workdir)
  if (reason := files.unwritable(workdir)) is not None:
    raise UserError(f'--mode=calibrate writes {path}, but {workdir} refuses files ({reason}); copy the run '
                    'to a writable directory and calibrate there')
  placement, state, step, record = restore(config, workdir, replaces=[path], calibrated=False)
  dataset = pipeline.load(DatasetSpec.of(config).replace(eval_split=split), need_train=False,
                          class_names=record.get('class_names'))
  if dataset.num_classes != record['num_classes'] or dataset.image_shape != tuple(record['image_shape']):
    raise UserError(f'calibrate.split {split!r} has {dataset.num_classes} classes of {dataset.image_shape} '
                    f'images but checkpoint step {step} takes {record["num_classes"]} classes of '
                    f'{tuple(record["image_shape"])}; calibrate on data like the training data')
  _, predictions = evaluate(placement, state, dataset, resolved_eval_batch_size(config), keep_logits=True)
  logits, labels = predictions.logits.astype(np.float64), predictions.labels.astype(np.int64)
  temperature = calibration.fit_temperature(logits, labels)
  ece_before, _ = report_metrics.confidence_calibration(logits, labels)
  ece_after, _ = report_metrics.confidence_calibration(logits / temperature, labels)
  settings = config.calibrate
  rule = conformal.SetRule(threshold=0.0, score=settings.score, randomize=settings.randomize,
                           raps_lambda=settings.raps_lambda if settings.score == 'raps' else 0.0,
                           raps_k=settings.raps_k, seed=config.seed)
  probabilities = report_metrics.softmax(logits / temperature)
  threshold = conformal.threshold(conformal.true_class_scores(probabilities, labels, rule), settings.coverage)
  here = conformal.set_summary(conformal.prediction_sets(probabilities, rule._replace(threshold=threshold)),
                               labels)
  fitted = {**report_about(config, step, split), 'num_classes': int(record['num_classes']),
            'num_examples': int(len(labels)), 'temperature': temperature,
            'ece_before': ece_before, 'ece_after': ece_after, 'nll_before': calibration.nll(logits, labels),
            'nll_after': calibration.nll(logits, labels, temperature),
            'accuracy': float((logits.argmax(axis=1) == labels).mean()), 'coverage': float(settings.coverage),
            'set_threshold': threshold if np.isfinite(threshold) else 'inf', 'set_score': rule.score,
            'randomize': rule.randomize, 'raps_lambda': rule.raps_lambda, 'raps_k': rule.raps_k,
            'seed': rule.seed,
            # on the calibration split itself (optimistic there; --mode=eval on another split says what holds)
            'calibration_set_coverage': here['set_coverage'], 'calibration_set_size': here['set_size'],
            'checkpoint': os.path.join(workdir, 'checkpoints', str(step))}
  with files.writing(path, 'free disk space or choose a writable --workdir'):
    files.write_json(path, fitted)  # through a temporary file: never half-written
  logging.info('calibrated step %d on %s (%d examples): temperature %.4f, ECE %.4f -> %.4f, NLL %.4f -> '
               '%.4f; %s sets for %.0f%% coverage: threshold %.4f, mean size %.2f here; wrote %s', step,
               split, len(labels), temperature, fitted['ece_before'], fitted['ece_after'],
               fitted['nll_before'], fitted['nll_after'], rule.score.upper(), 100 * fitted['coverage'],
               threshold, fitted['calibration_set_size'], path)
  print(f'temperature {temperature:.4f}: ECE {fitted["ece_before"]:.4f} -> {fitted["ece_after"]:.4f}, '
        f'NLL {fitted["nll_before"]:.4f} -> {fitted["nll_after"]:.4f} on {split}; wrote {path}')
  return fitted
