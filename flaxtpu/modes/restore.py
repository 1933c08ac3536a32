"""Restore a checkpoint for a mode: parameters (and BatchNorm statistics) only, on whatever devices are here.

Every mode that reads a trained run (eval, predict, export) starts with `restore`, naming the results it
would replace: when `latest` had to fall back past damaged checkpoints, a result of a newer step (or of an
unknown one) is never replaced by the older step's unless that step is asked for by number (`keep_newer`).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import ml_collections

from flaxtpu.evaluation.evaluate import tta_name
from flaxtpu.io import files
from flaxtpu.optimizers import swa
from flaxtpu.report import calibration
from flaxtpu.settings.errors import UserError
from flaxtpu.step import parallel, placing, steps
from flaxtpu.transfer import finetune
from flaxtpu.weights import checkpoint, pretrained


def restore(config: ml_collections.ConfigDict, workdir: str, replaces: Sequence[str] = (),
            calibrated: bool = True):
  """The model of `config.eval.checkpoint` (latest | best | STEP), laid out for these devices.

  Returns (placement, model state, step, record). Only parameters and
  BatchNorm statistics are read: no optimizer is built. The model is checked
  against the checkpoint's own record (model, classes, image shape);
  normalisation statistics come from the checkpoint. A workdir without
  checkpoints and a config whose init_from names published weights gives
  the published model, its head and classes kept.

  `replaces`: the results the mode writes (files or directories); see `keep_newer`.
  `calibrated`: WORKDIR/calibration.json of this checkpoint (`calibration.for_checkpoint`), when there
  is one, divides the logits by its temperature; the record's 'calibration' holds it (else None).
  """
  if (config.init_from.checkpoint and pretrained.is_published(config.init_from.checkpoint)
      and not files.isdir(os.path.join(workdir, 'checkpoints'))):
    return finetune.published_model(config)
  checkpoints = checkpoint.Checkpoints(workdir, config, read_only=True)
  mesh = parallel.make_mesh(config)
  # Classes and image shape come from the checkpoint; a softmax head read as sigmoids (or back) is refused.
  expected = {'model': config.model.name, 'task': config.task}

  def read(step: int):
    """The placement its record describes, and the model state of `step` laid out by it."""
    record = checkpoints.read_record(step)
    about = {'step': step, 'weights': swa.weights_name(config.eval), 'tta': tta_name(config.eval)}
    fitted = calibration.for_checkpoint(workdir, about, record['num_classes']) if calibrated else None
    if config.eval.ema and not record.get('config', {}).get('ema', {}).get('decay'):
      raise checkpoint.CheckpointError(
          f'config.eval.ema=True but the run in {workdir} was trained without an EMA of its weights '
          '(ema.decay=0); drop --config.eval.ema or train with --config.ema.decay=0.999')
    if config.eval.swa and not record.get('config', {}).get('swa', {}).get('every'):
      raise checkpoint.CheckpointError(
          f'config.eval.swa=True but the run in {workdir} was trained without an SWA of its weights '
          '(swa.every=0); drop --config.eval.swa or train with --config.swa.every=50')
    task = steps.create_task(config, num_classes=record['num_classes'],
                             image_shape=tuple(record['image_shape']),
                             mean=record['normalization']['mean'], std=record['normalization']['std'],
                             temperature=fitted['temperature'] if fitted else 1.0)
    placement = placing.place(task, mesh, config)
    model = placement.abstract_state
    if config.eval.swa:  # the saved state's `swa` subtree: its mean and recomputed BatchNorm statistics
      averaged = {'swa': {'params': model.params, 'batch_stats': model.batch_stats}}
      saved, record = checkpoints.restore(step, averaged, expected, config=config, subset=True)
      return placement, steps.ModelState(**saved['swa']), {**record, 'calibration': fitted}
    if not config.eval.ema:
      saved, record = checkpoints.restore(step, model, expected, config=config, subset=True)
      return placement, saved, {**record, 'calibration': fitted}
    # The saved state's `ema` subtree, read into a ModelState's layout.
    ema = {'ema': {'params': model.params, 'batch_stats': model.batch_stats}}
    saved, record = checkpoints.restore(step, ema, expected, config=config, subset=True)
    return placement, steps.ModelState(**saved['ema']), {**record, 'calibration': fitted}

  # An unreadable latest checkpoint falls back to the newest readable one; one that a live run
  # rotates away while it is read is listed again.
  listed = max(checkpoints.all_steps(), default=None)  # before reading: a live run may save newer ones
  step, (placement, saved, record) = checkpoints.restore_which(str(config.eval.checkpoint), read)
  checkpoints.close()
  if str(config.eval.checkpoint) == 'latest' and listed is not None and step < listed:  # fell back
    keep_newer(workdir, step, listed, replaces)
  if config.eval.swa:
    logging.info('using the SWA weights of checkpoint step %d', step)
  if config.eval.ema:
    logging.info('using the EMA weights of checkpoint step %d', step)
  return placement, placement.from_saveable(saved), step, record


def keep_newer(workdir: str, step: int, damaged: int, replaces: Sequence[str]) -> None:
  """Refuses to write the fallback `step`'s result over one made of a newer step (or of an unknown one).

  The one rule for every mode that writes from a checkpoint it fell back to: a newer result is kept
  unless the older step is asked for by number (--config.eval.checkpoint=STEP restores no fallback).
  """
  for path in replaces:
    if not path or not files.exists(path):
      continue
    made_of = result_step(path)
    if made_of is not None and made_of <= step:
      continue
    of = f'step {made_of}' if made_of is not None else 'a step it does not record'
    damaged_path = os.path.join(workdir, 'checkpoints', str(damaged))
    raise UserError(f'checkpoint {damaged_path} cannot be read, so this would write step {step}\'s result '
                    f'over {path}, which holds {of}; repair or remove the damaged checkpoint, or pass '
                    f'--config.eval.checkpoint={step} to replace it with step {step}\'s')


def result_step(path: str) -> Optional[int]:
  """The step a result was made of: a JSON file's `step`, a directory's export.json's; None if unknown."""
  if files.isdir(path):
    path = os.path.join(path, 'export.json')
  if not path.endswith('.json'):
    return None
  step = (files.read_json(path) or {}).get('step')
  return step if isinstance(step, int) and not isinstance(step, bool) else None
