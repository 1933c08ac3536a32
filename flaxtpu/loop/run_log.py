"""What a run logs at its start: the config as HParams, the parameter table and the first augmented
images (TensorBoard), and the plan of its data, steps, accumulation and parameter groups."""

from __future__ import annotations

import logging

import jax
import ml_collections
from clu import parameter_overview

from flaxtpu.data import loaders, pipeline
from flaxtpu.data.spec import saved_config
from flaxtpu.io import writers
from flaxtpu.optimizers import optim
from flaxtpu.settings.lengths import RunLength
from flaxtpu.step import placing, steps


def log_run_overview(writer, config: ml_collections.ConfigDict, task: steps.Task, placement,
                     state, dataset: pipeline.Dataset, first_step: int) -> None:
  """TensorBoard (and W&B) extras at the start: the config as HParams, the parameter
  table, and the first training images as the train step augments them."""
  writer.write_hparams(writers.flat_hparams(saved_config(config, dataset.image_shape[-1])))
  overview = parameter_overview.get_parameter_overview(placement.to_saveable(state).params,
                                                       include_stats=False)
  logging.info('parameters:\n%s', overview)
  writer.write_texts(first_step, {'parameters': f'<pre>{overview}</pre>'})
  if jax.process_count() == 1:  # the first local batch is the whole global batch only on one process
    first = next(iter(loaders.train_batches(dataset, seed=config.seed, batch_size=config.batch_size,
                                            first_step=first_step, last_step=first_step + 1,
                                            alternate_flip=config.augment.alternate_flip)))
    sample = steps.augmented_sample(task.augment, config.seed, first_step,
                                    first.images[:steps.AUGMENTED_SAMPLE_IMAGES])
    writer.write_images(first_step, {'train_images': sample})


def log_plan(config: ml_collections.ConfigDict, dataset: pipeline.Dataset, length: RunLength,
             task: steps.Task, placement: placing.Placement) -> None:
  """What the run will do: its data and steps, accumulation, and the optimizer's parameter groups."""
  logging.info('data: %d train / %d eval examples of %s, %d classes%s; %d steps (%d per epoch)',
               len(dataset.train), len(dataset.eval), dataset.image_shape, dataset.num_classes,
               ' (multilabel: a sigmoid per class; accuracy = exact match)' if task.multilabel else '',
               length.total_steps, length.steps_per_epoch)
  if task.class_weights is not None:
    logging.info('class weights of the train loss: %s', ', '.join(
        f'{name} {weight:.3g}' for name, weight in zip(dataset.class_names, task.class_weights)))
  if length.accumulate_steps > 1:
    logging.info('gradient accumulation: %d batches of %d per update (an effective batch of %d); '
                 '%d updates', length.accumulate_steps, config.batch_size,
                 length.accumulate_steps * config.batch_size, length.total_updates)
  if task.param_groups:  # a pattern that matches nothing is a typo: stop before any work
    logging.info('optimizer: %s', optim.describe_groups(task.param_groups.check(
        placement.abstract_state.params)))
    for pattern, epochs in task.param_groups.freeze_after:
      logging.info('optimizer: parameters matching %r stop changing after %g epochs', pattern, epochs)
