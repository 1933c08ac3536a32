"""Where a run starts: a fresh state (fitted to the data, loaded from `init_from`) or the newest readable
checkpoint of its workdir, and what each checkpoint records besides the arrays.

A resume checks the checkpoint against the config first (resume_changes.py:
what it refuses, what it applies and says) and brings back the train metrics
window saved with it, so a run stopped between two log lines logs what an
unstopped one would.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, NamedTuple, Optional

import ml_collections
import numpy as np

from flaxtpu.data import loaders, pipeline
from flaxtpu.data.spec import saved_config
from flaxtpu.io import metrics
from flaxtpu.loop import resume_changes
from flaxtpu.loop.progress import Progress
from flaxtpu.optimizers import optim
from flaxtpu.settings.lengths import RunLength
from flaxtpu.step import placing, steps
from flaxtpu.transfer import distill, finetune
from flaxtpu.validation import workdir_config
from flaxtpu.weights import checkpoint


def checkpoint_record(config: ml_collections.ConfigDict, task: steps.Task, step: int,
                      dataset: pipeline.Dataset, progress: dict) -> dict:
  """What a checkpoint says besides the arrays: what it is, the data position, the config,
  and the run's progress (`Progress.to_json()`), from which results.json can be rebuilt.

  Evaluation and prediction rebuild the model from it without the train split.
  """
  return {**checkpoint.expected_record(config, task.num_classes, task.image_shape),
          'class_names': list(dataset.class_names),
          'num_train_examples': len(dataset.train),
          'normalization': {'mean': dataset.mean.tolist(), 'std': dataset.std.tolist()},
          'data_position': {'seed': config.seed, 'next_step': step},
          'progress': progress,
          'distill': distill.record_of(task.teacher),
          'config': saved_config(config, dataset.image_shape[-1])}


def load_teacher(config: ml_collections.ConfigDict, dataset: pipeline.Dataset, mesh,
                 checkpoints: checkpoint.Checkpoints) -> tuple[Optional[distill.Teacher], Any]:
  """distill.teacher and its weights (None, None without one); a resumed run reads the teacher step
  it started with, whatever `best` or `latest` means now."""
  if not config.distill.teacher:
    return None, None
  started_step, latest = None, checkpoints.latest_step()
  if latest is not None:
    with contextlib.suppress(checkpoint.UnreadableCheckpoint):  # the restore names it if it matters
      started_step = distill.recorded_step(checkpoints.read_record(latest), config.distill.teacher)
  return distill.load_teacher(config, dataset.class_names, dataset.image_shape, mesh, started_step)


class Start(NamedTuple):
  """Where a run begins: a fresh state at step 0, or the newest readable checkpoint's."""
  state: Any
  step: int
  window: Any  # the train metrics since the last log line before the checkpoint, merged (None: none)
  progress: Progress  # the checkpoint's (metrics, time); empty for a fresh run
  initialised_from: Optional[dict]  # what init_from loaded, kept in every checkpoint record of the run


def start_or_resume(config: ml_collections.ConfigDict, task: steps.Task, placement: placing.Placement,
                    checkpoints: checkpoint.Checkpoints, dataset: pipeline.Dataset, length: RunLength,
                    num_train_examples: int) -> Start:
  """The state to train from: the newest readable checkpoint's when there is one, else a fresh one
  (fitted to the train images, then loaded from `init_from`, where the config asks). A resume with a
  changed config refuses what the checkpoint cannot take and logs what it applies (resume_changes.py)."""
  if checkpoints.latest_step() is None:
    fitted = None  # parameters set from the train images (a whitening stem)
    if steps.fits_to_data(task):
      sample = np.stack(loaders.train_sample(dataset, steps.DATA_FIT_IMAGES))
      fitted = steps.fit_to_data(task, sample)
      logging.info('fitted %s to %d train images', ', '.join(fitted), len(sample))
      if any(task.param_groups.label(name) != optim.FROZEN for name in fitted):
        logging.warning('%s will train (and decay) from its fitted value; airbench freezes it: '
                        "--config.optimizer.freeze='^stem/kernel$' (as configs/cifar10_fast.py)",
                        ', '.join(fitted))
    state, initialised_from = placing.create_state(task, placement, config.seed, fitted), None
    if config.init_from.checkpoint:
      state, initialised_from = finetune.init_from(config, task, placement, state, dataset.class_names)
    return Start(state, 0, None, Progress(), initialised_from)

  # A resumed run continues from its own checkpoint, never from init_from again.
  current = saved_config(config, dataset.image_shape[-1])
  with contextlib.suppress(checkpoint.UnreadableCheckpoint):  # newest_readable below says which it takes
    latest = checkpoints.latest_step()
    resume_changes.check(checkpoints.read_record(latest).get('config', {}), config, current, latest,
                         checkpoints.directory)
  expected = checkpoint.expected_record(config, task.num_classes, task.image_shape)
  latest, (saved, record) = checkpoints.newest_readable(
      lambda step: checkpoints.restore_train_state(step, placement.abstract_state, expected, config),
      set_aside=True)
  legacy = {key: value for key, value in workdir_config.legacy_options(record.get('config', {})).items()
            if config.model[key] != value}
  if legacy:  # same arrays, another function: a run saved before an option keeps what it computed
    raise checkpoint.CheckpointError(
        f'checkpoint step {latest} in {checkpoints.directory} was trained before config.model.'
        f'{", ".join(legacy)} existed, computing what {", ".join(f"{k}={v}" for k, v in legacy.items())} '
        f'computes; resume with {" ".join(f"--config.model.{k}={v}" for k, v in legacy.items())} '
        'or use another --workdir')
  saved_accumulation = record.get('config', {}).get('optimizer', {}).get('accumulate_steps', 1)
  if saved_accumulation != config.optimizer.accumulate_steps:
    # Same arrays, other meaning: the optimizer's update count and the schedule assume the old k.
    raise checkpoint.CheckpointError(
        f'checkpoint step {latest} in {checkpoints.directory} was trained with optimizer.accumulate_steps='
        f'{saved_accumulation}, and its optimizer state counts updates of that many batches; resume with '
        f'--config.optimizer.accumulate_steps={saved_accumulation} or use another --workdir')
  logging.info('resuming from step %d (%s)', latest, os.path.join(checkpoints.directory, str(latest)))
  resume_changes.check(record.get('config', {}), config, current, latest, checkpoints.directory)
  resume_changes.log_applied(record.get('config', {}), current, config, latest, num_train_examples, length,
                             task.schedule)
  saved_window = metrics.window_from_json(record.get('train_metrics_window'),
                                          steps.train_metrics_collection(task))
  window = placement.from_saveable(saved_window) if saved_window is not None else None
  return Start(placement.from_saveable(saved), latest, window, Progress.from_json(record.get('progress')),
               record.get('init_from'))
