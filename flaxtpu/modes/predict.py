"""--mode=predict: the top-k classes (multilabel: the tags at their thresholds) of each image of a file or
folder, printed and optionally written to predict.output_csv."""

from __future__ import annotations

import logging
import os

import jax
import ml_collections
import numpy as np

from flaxtpu.augmentation import image_sizes
from flaxtpu.data import pipeline, predict_inputs
from flaxtpu.evaluation import explain
from flaxtpu.io import files, storage
from flaxtpu.modes.restore import restore
from flaxtpu.modes.thresholds import tag_thresholds
from flaxtpu.report import calibration, conformal
from flaxtpu.report import metrics as report_metrics
from flaxtpu.settings.errors import UserError, printable
from flaxtpu.settings.lengths import resolved_eval_batch_size
from flaxtpu.step import placing


def _multiclass_row(path: str, probabilities: np.ndarray, class_names: list[str], top_k: int) -> dict:
  """predict's row for one image: its top-k classes and their softmax probabilities."""
  best = np.argsort(-probabilities)[:top_k]
  row = {'path': path}
  for rank, index in enumerate(best, 1):
    row[f'class_{rank}'], row[f'probability_{rank}'] = class_names[index], float(probabilities[index])
  print(f'{printable(path)}: ' + ', '.join(f'{printable(class_names[i])} {probabilities[i]:.3f}'
                                                for i in best))
  return row


def _multilabel_row(path: str, probabilities: np.ndarray, thresholds: np.ndarray, class_names: list[str],
                    top_k: int) -> dict:
  """predict's row for one image: every tag whose probability reaches its threshold ('tags', most
  probable first, ';'-separated, and their 'tag_probabilities'), then the top-k classes as multiclass."""
  tags = [c for c in np.argsort(-probabilities, kind='stable') if probabilities[c] >= thresholds[c]]
  row = {'path': path, 'tags': ';'.join(class_names[c] for c in tags),
         'tag_probabilities': ';'.join(f'{probabilities[c]:.4f}' for c in tags)}
  for rank, index in enumerate(np.argsort(-probabilities, kind='stable')[:top_k], 1):
    row[f'class_{rank}'], row[f'probability_{rank}'] = class_names[index], float(probabilities[index])
  print(f'{printable(path)}: ' + (', '.join(f'{printable(class_names[c])} {probabilities[c]:.3f}'
                                                 for c in tags) or '(no tag)'))
  return row


def predict(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """--mode=predict: top-k classes of each image in `config.predict.input`; multilabel, every tag
  whose probability reaches its threshold (`tag_thresholds` says which, in the log and on stdout)."""
  if not config.predict.input:
    raise UserError('--mode=predict needs --config.predict.input=IMAGE_OR_FOLDER')
  check_outputs(config, workdir)
  placement, state, step, record = restore(config, workdir, replaces=[config.predict.output_csv])
  image_shape = image_sizes.eval_shape(config, record['image_shape'])  # eval.image_size's, if set
  transform = image_sizes.eval_transform(pipeline.image_transform(config, channels=image_shape[-1]),
                                         config.eval.image_size, config.eval.crop_fraction)
  paths, images = predict_inputs.read_images(config.predict.input, image_shape, transform,
                                             skip_corrupt=config.dataset.skip_corrupt)
  logits = predict_logits(placement, state, images, resolved_eval_batch_size(config))
  class_names = record['class_names']
  top_k = min(config.predict.top_k, len(class_names))
  if config.task == 'multilabel':
    thresholds, source = tag_thresholds(config, workdir, step, class_names)
    print(f'tags at or above their thresholds: {source}')
    logging.info('thresholds: %s', source)
    rows = [_multilabel_row(path, probs, thresholds, class_names, top_k)
            for path, probs in zip(paths, report_metrics.sigmoid(logits))]
  else:
    probabilities = np.asarray(jax.nn.softmax(logits, axis=-1))
    rows = [_multiclass_row(path, probs, class_names, top_k) for path, probs in zip(paths, probabilities)]
    if record.get('calibration'):  # calibrated: each image's prediction set, most probable class first
      _add_sets(rows, probabilities, class_names, record['calibration'])
  logging.info('predicted %d images with checkpoint step %d', len(rows), step)
  if config.predict.explain:
    explainer = explain.for_restored(config, record, state)
    heatmaps, _ = explainer(images, batch_size=resolved_eval_batch_size(config))
    directory = config.predict.explain_dir or os.path.join(workdir, 'explain')
    written = explain.write_explanations(paths, heatmaps, transform, image_shape[-1], directory,
                                         config.predict.input)
    rows = [{**row, 'heatmap': files.csv_path(npy)} for row, npy in zip(rows, written)]
    logging.info('Grad-CAM heatmaps of the top class and their overlays in %s', directory)
  if config.predict.output_csv and jax.process_index() == 0:
    files.write_csv(config.predict.output_csv, [{**row, 'path': files.csv_path(row['path'])} for row in rows],
                    'predict.output_csv')
  return rows


def check_outputs(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Where predict writes (predict.output_csv; predict.explain_dir with predict.explain) can be written:
  one UserError line before any weights or images are read, as the write itself would say it."""
  csv_path = config.predict.output_csv
  if csv_path and not storage.is_remote(csv_path):
    folder = os.path.dirname(os.path.abspath(csv_path))
    missing = f'its folder {os.path.dirname(csv_path) or "."} does not exist'
    reason = ('it is a folder' if os.path.isdir(csv_path) else missing if not os.path.isdir(folder) else
              files.creatable(folder))
    if reason:
      raise UserError(f'cannot write {csv_path}: {reason}; choose another --config.predict.output_csv')
  if config.predict.explain:
    directory = config.predict.explain_dir or os.path.join(workdir, 'explain')
    if reason := files.creatable(directory):
      raise UserError(f'config.predict.explain_dir={directory} cannot hold the heatmaps ({reason}); choose a '
                      'directory you can write')


def _add_sets(rows: list[dict], probabilities: np.ndarray, class_names: list[str], fitted: dict) -> None:
  """Each row's `set` column: the classes of its conformal prediction set (`report.conformal`, with the
  threshold of calibration.json), ';'-separated like multilabel's tags, most probable first."""
  sets = conformal.prediction_sets(probabilities, calibration.set_parameters(fitted))
  for row, members, probs in zip(rows, sets, probabilities):
    row['set'] = ';'.join(class_names[c] for c in np.argsort(-probs, kind='stable') if members[c])
  print(f'prediction sets hold the true class {fitted["coverage"]:.0%} of the time '
        f'({fitted["set_score"].upper()}, calibrated on {fitted["split"]}): '
        + ', '.join(f'{printable(row["path"])}: {{{printable(row["set"])}}}' for row in rows[:5])
        + (' ...' if len(rows) > 5 else ''))


def predict_logits(placement: placing.Placement, state, images: np.ndarray,
                   batch_size: int) -> np.ndarray:
  """Logits of every image, in fixed-size padded batches through one compiled function.

  `batch_size` divides over the devices (`placing.place` checked it).
  """
  if jax.process_count() > 1:
    raise UserError('--mode=predict runs on one process; start it without --num_processes')
  # A few images need no full batch of padding: the smallest multiple of the device count holding them.
  devices = placement.mesh.devices.size
  batch_size = min(batch_size, -(-len(images) // devices) * devices)
  outputs = []
  for start in range(0, len(images), batch_size):
    chunk = images[start:start + batch_size]
    padded = np.concatenate([chunk, np.zeros((batch_size - len(chunk), *chunk.shape[1:]), np.uint8)])
    (device_images,) = placement.put_eval_batch((padded,))
    outputs.append(np.asarray(placement.logits(state, device_images))[:len(chunk)])
  return np.concatenate(outputs)
