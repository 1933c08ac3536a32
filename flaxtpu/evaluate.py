"""Restore a checkpoint on whatever devices are here, then evaluate a split or predict on images."""

from __future__ import annotations

import csv
import logging
import os

import jax
import ml_collections
import numpy as np

from flaxtpu import checkpoint, data, files, parallel, steps
from flaxtpu.config import resolved_eval_batch_size
from flaxtpu.errors import UserError


def evaluate(placement: steps.Placement, state, dataset: data.Dataset,
             batch_size: int) -> dict[str, float]:
  """Loss and accuracy over every example of the eval split, each counted exactly once."""
  totals, one_step_in_flight = None, parallel.one_step_in_flight()
  for batch in data.eval_batches(dataset, batch_size=batch_size, process_index=jax.process_index(),
                                 process_count=jax.process_count()):
    batch_metrics = placement.eval_step(state, placement.put_eval_batch(tuple(batch)))
    if one_step_in_flight:
      jax.block_until_ready(batch_metrics)
    totals = batch_metrics if totals is None else totals.merge(batch_metrics)
  result = {f'eval_{k}': float(v) for k, v in totals.compute().items()}
  result['num_examples'] = int(totals.loss.count)
  return result


def restore(config: ml_collections.ConfigDict, workdir: str):
  """The model of `config.eval.checkpoint` (latest | best | STEP), laid out for these devices.

  Returns (placement, model state, step, record). Only parameters and
  BatchNorm statistics are read: no optimizer is built. The model is checked
  against the checkpoint's own record (model, classes, image shape);
  normalisation statistics come from the checkpoint.
  """
  checkpoints = checkpoint.Checkpoints(workdir, config, read_only=True)
  step = checkpoints.resolve(str(config.eval.checkpoint))
  record = checkpoints.read_record(step)
  task = steps.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']),
                           mean=record['normalization']['mean'], std=record['normalization']['std'])
  placement = steps.place(task, parallel.make_mesh(config), config)
  saved, record = checkpoints.restore(step, placement.abstract_state, config=config, partial=True,
                                      expected=checkpoint.expected_record(config, task.num_classes,
                                                                          task.image_shape))
  checkpoints.close()
  return placement, placement.from_saveable(saved), step, record


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """--mode=eval: accuracy and loss over every example of the eval split -> WORKDIR/eval.json."""
  placement, state, step, record = restore(config, workdir)
  dataset = data.load(config, need_train=False)
  if dataset.num_classes != record['num_classes'] or dataset.image_shape != tuple(record['image_shape']):
    raise UserError(f'{config.dataset.folder or config.dataset.name} has {dataset.num_classes} classes '
                    f'of {dataset.image_shape} images but checkpoint {workdir}/checkpoints/{step} was '
                    f'trained on {record["num_classes"]} classes of {tuple(record["image_shape"])}; '
                    'evaluate on data like the training data')
  results = evaluate(placement, state, dataset, resolved_eval_batch_size(config))
  results.update(step=step, split=config.dataset.eval_split,
                 source=config.dataset.folder or config.dataset.name,
                 checkpoint=os.path.join(workdir, 'checkpoints', str(step)))
  logging.info('eval of step %d: loss %.4f  accuracy %.4f  (%d examples)', step,
               results['eval_loss'], results['eval_accuracy'], results['num_examples'])
  if jax.process_index() == 0:
    files.write_json(os.path.join(workdir, 'eval.json'), results)
  return results


def predict(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """--mode=predict: top-k classes of each image in `config.predict.input`."""
  if not config.predict.input:
    raise UserError('--mode=predict needs --config.predict.input=IMAGE_OR_FOLDER')
  placement, state, step, record = restore(config, workdir)
  image_shape = tuple(record['image_shape'])
  paths, images = data.read_images(config.predict.input, image_shape,
                                   data.image_transform(config, channels=image_shape[-1]))
  logits = predict_logits(placement, state, images, config.batch_size)
  probabilities = np.asarray(jax.nn.softmax(logits, axis=-1))
  class_names = record['class_names']
  top_k = min(config.predict.top_k, len(class_names))
  rows = []
  for path, probs in zip(paths, probabilities):
    best = np.argsort(-probs)[:top_k]
    row = {'path': path}
    for rank, index in enumerate(best, 1):
      row[f'class_{rank}'], row[f'probability_{rank}'] = class_names[index], float(probs[index])
    rows.append(row)
    print(f'{path}: ' + ', '.join(f'{class_names[i]} {probs[i]:.3f}' for i in best))
  logging.info('predicted %d images with checkpoint step %d', len(rows), step)
  if config.predict.output_csv and jax.process_index() == 0:
    tmp = config.predict.output_csv + '.tmp'
    with open(tmp, 'w', newline='', encoding='utf-8') as f:
      writer = csv.DictWriter(f, fieldnames=list(rows[0]))
      writer.writeheader()
      writer.writerows(rows)
    os.replace(tmp, config.predict.output_csv)
  return rows


def predict_logits(placement: steps.Placement, state, images: np.ndarray,
                   batch_size: int) -> np.ndarray:
  """Logits of every image, in fixed-size padded batches through one compiled function.

  `batch_size` divides over the devices (`steps.place` checked it).
  """
  if jax.process_count() > 1:
    raise UserError('--mode=predict runs on one process; start it without --num_processes')
  outputs = []
  for start in range(0, len(images), batch_size):
    chunk = images[start:start + batch_size]
    padded = np.concatenate([chunk, np.zeros((batch_size - len(chunk), *chunk.shape[1:]), np.uint8)])
    (device_images,) = placement.put_eval_batch((padded,))
    outputs.append(np.asarray(placement.logits(state, device_images))[:len(chunk)])
  return np.concatenate(outputs)
