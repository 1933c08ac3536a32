"""Restore a checkpoint on whatever devices are here, then evaluate a split or predict on images."""

from __future__ import annotations

import csv
import logging
import os

import jax
import ml_collections
import numpy as np

from flaxtpu import checkpoint, data, metrics, parallel, train
from flaxtpu.config import RunLength, resolved_eval_batch_size
from flaxtpu.errors import UserError


def restore(config: ml_collections.ConfigDict, workdir: str, *, which: str | None = None):
  """The model state of `config.eval.checkpoint` (latest | best | STEP), laid out for these devices.

  Returns (placement, state, step, record). The model is rebuilt from the
  config and checked against the checkpoint's own record (model, classes,
  image shape); normalisation statistics come from the checkpoint.
  """
  checkpoints = checkpoint.Checkpoints(workdir, config, read_only=True)
  step = checkpoints.resolve(which or str(config.eval.checkpoint))
  record = checkpoints.read_record(step)
  # The schedule is unused at inference; any run length gives the same state shapes.
  length = RunLength(steps_per_epoch=1, total_steps=1, eval_every_steps=1,
                     checkpoint_every_steps=1, warmup_steps=0)
  task = train.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']),
                           mean=record['normalization']['mean'], std=record['normalization']['std'],
                           length=length)
  placement = train.place(task, parallel.make_mesh(config), config)
  saved, record = checkpoints.restore(step, placement.abstract_state,
                                      expected=train.expected_record(config, task))
  checkpoints.close()
  return placement, placement.from_saveable(saved), step, record


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """--mode=eval: accuracy and loss over every example of the eval split -> WORKDIR/eval.json."""
  eval_batch_size = resolved_eval_batch_size(config)
  parallel.check_batch_size('eval_batch_size', eval_batch_size, config)
  placement, state, step, record = restore(config, workdir)
  dataset = data.load(config, need_train=False)
  if dataset.num_classes != record['num_classes'] or dataset.image_shape != tuple(record['image_shape']):
    raise UserError(f'{config.dataset.folder or config.dataset.name} has {dataset.num_classes} classes '
                    f'of {dataset.image_shape} images but checkpoint {workdir}/checkpoints/{step} was '
                    f'trained on {record["num_classes"]} classes of {tuple(record["image_shape"])}; '
                    'evaluate on data like the training data')
  results = train.evaluate(placement, state, dataset.eval, eval_batch_size)
  results.update(step=step, split=config.dataset.eval_split,
                 source=config.dataset.folder or config.dataset.name,
                 checkpoint=os.path.join(workdir, 'checkpoints', str(step)))
  logging.info('eval of step %d: loss %.4f  accuracy %.4f  (%d examples)', step,
               results['eval_loss'], results['eval_accuracy'], results['num_examples'])
  if jax.process_index() == 0:
    metrics.write_json(os.path.join(workdir, 'eval.json'), results)
  return results


def predict(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """--mode=predict: top-k classes of each image in `config.predict.input`."""
  if not config.predict.input:
    raise UserError('--mode=predict needs --config.predict.input=IMAGE_OR_FOLDER')
  placement, state, step, record = restore(config, workdir)
  paths, images = data.read_images(config.predict.input, tuple(record['image_shape']))
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


def predict_logits(placement: train.Placement, state, images: np.ndarray,
                   batch_size: int) -> np.ndarray:
  """Logits of every image, in fixed-size padded batches through one compiled function."""
  batch_size -= batch_size % jax.device_count() or 0
  batch_size = max(batch_size, jax.device_count())
  if jax.process_count() > 1:
    raise UserError('--mode=predict runs on one process; start it without --num_processes')
  outputs = []
  for start in range(0, len(images), batch_size):
    chunk = images[start:start + batch_size]
    padded = np.concatenate([chunk, np.zeros((batch_size - len(chunk), *chunk.shape[1:]), np.uint8)])
    (device_images,) = placement.put_eval_batch((padded,))
    outputs.append(np.asarray(placement.logits(state, device_images))[:len(chunk)])
  return np.concatenate(outputs)
