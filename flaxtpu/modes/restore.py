"""Restore a checkpoint for a mode: parameters (and BatchNorm statistics) only, on whatever devices are here.

Every mode that reads a trained run (eval, predict, export) starts with `restore`.
"""

from __future__ import annotations

import logging
import os

import ml_collections

from flaxtpu import checkpoint, files, finetune, parallel, pretrained, steps


def restore(config: ml_collections.ConfigDict, workdir: str):
  """The model of `config.eval.checkpoint` (latest | best | STEP), laid out for these devices.

  Returns (placement, model state, step, record). Only parameters and
  BatchNorm statistics are read: no optimizer is built. The model is checked
  against the checkpoint's own record (model, classes, image shape);
  normalisation statistics come from the checkpoint. A workdir without
  checkpoints and a config whose init_from names published weights gives
  the published model, its head and classes kept.
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
    if config.eval.ema and not record.get('config', {}).get('ema', {}).get('decay'):
      raise checkpoint.CheckpointError(
          f'config.eval.ema=True but the run in {workdir} was trained without an EMA of its weights '
          '(ema.decay=0); drop --config.eval.ema or train with --config.ema.decay=0.999')
    task = steps.create_task(config, num_classes=record['num_classes'],
                             image_shape=tuple(record['image_shape']),
                             mean=record['normalization']['mean'], std=record['normalization']['std'])
    placement = steps.place(task, mesh, config)
    model = placement.abstract_state
    if not config.eval.ema:
      return placement, *checkpoints.restore(step, model, expected, config=config, subset=True)
    # The saved state's `ema` subtree, read into a ModelState's layout.
    ema = {'ema': {'params': model.params, 'batch_stats': model.batch_stats}}
    saved, record = checkpoints.restore(step, ema, expected, config=config, subset=True)
    return placement, steps.ModelState(**saved['ema']), record

  # An unreadable latest checkpoint falls back to the newest readable one; one that a live run
  # rotates away while it is read is listed again.
  step, (placement, saved, record) = checkpoints.restore_which(str(config.eval.checkpoint), read)
  checkpoints.close()
  if config.eval.ema:
    logging.info('using the EMA weights of checkpoint step %d', step)
  return placement, placement.from_saveable(saved), step, record
