"""--mode=eval: score a checkpoint on a split -> eval.json and its per-class report."""

from __future__ import annotations

import logging
import os
import re

import jax
import ml_collections

from flaxtpu.data import pipeline
from flaxtpu.evaluation import explain, fewshot
from flaxtpu.evaluation.evaluate import evaluate, report_about, tta_name, write_report
from flaxtpu.io import files
from flaxtpu.modes.restore import restore
from flaxtpu.optimizers import swa
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size
from flaxtpu.step import placing, steps


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """--mode=eval: accuracy and loss over every example of the eval split -> WORKDIR/eval.json.

  eval.json holds this evaluation at its top level (`split` names what it
  scored, `weights` raw, ema or swa, `tta` the test-time augmentation) and, under
  `splits`, the latest result of every split, weights, TTA and step evaluated
  ('test', 'test:ema', 'test:tta=none' when training used TTA, 'test:step=48'
  for a checkpoint before the last), so scoring another never loses one.
  """
  # A run on a read-only disk is still evaluated: its files then go elsewhere (a warning says where).
  output = files.writable_or_elsewhere(workdir, 'eval.json, per_class.csv and the pictures')
  placement, state, step, record = restore(config, workdir, replaces=[os.path.join(output, 'eval.json')])
  dataset = pipeline.load(config, need_train=False, class_names=record.get('class_names'))  # matched by name
  if dataset.num_classes != record['num_classes'] or dataset.image_shape != tuple(record['image_shape']):
    raise UserError(f'{config.dataset.folder or config.dataset.name} has {dataset.num_classes} classes '
                    f'of {dataset.image_shape} images but checkpoint {workdir}/checkpoints/{step} was '
                    f'trained on {record["num_classes"]} classes of {tuple(record["image_shape"])}; '
                    'evaluate on data like the training data')
  results, predictions = evaluate(placement, state, dataset, resolved_eval_batch_size(config),
                                  keep_logits=True, threshold=config.eval.threshold)
  if config.eval.fewshot.shots:
    results.update(fewshot_accuracies(config, placement, state, record))
  # The run's own final evaluation (its eval split, TTA and weights at its last step) gets the plain
  # names its end-of-run report has; any other view of the checkpoints a suffix naming how it differs,
  # so no result replaces another's.
  trained = record.get('config', {})
  split, tta, weights = config.dataset.eval_split, tta_name(config.eval), swa.weights_name(config.eval)
  final_step = (files.read_json(os.path.join(workdir, 'results.json')) or {}).get('step')
  other_step = final_step is not None and step != final_step
  trained_eval = trained.get('eval', {})
  other_tta = tta != tta_name(trained_eval)
  other_weights = weights != swa.weights_name(trained_eval)
  size = config.eval.image_size  # eval.image_size apart from the run's: its own entry
  other_size = size != trained_eval.get('image_size', 0)
  suffix = ''.join(part for part, differs in (
      (f'-{split_file_name(split)}', split != trained.get('dataset', {}).get('eval_split')),
      (f'-step{step}', other_step), (f'-tta_{tta}', other_tta),
      (f'-{weights}', other_weights), (f'-size{size}', other_size)) if differs)
  key = split + (f':step={step}' if other_step else '') + (f':tta={tta}' if other_tta else '') + (
      f':{weights}' if weights != 'raw' else '') + (f':size={size}' if other_size else '')
  # The mistakes picture shows each image under the Grad-CAM heatmap of the class it was taken for.
  results.update(write_report(predictions, dataset, output, suffix, config.eval.threshold,
                              report_about(config, step, split), calibration=record.get('calibration'),
                              overlay=explain.overlaid(explain.for_restored(config, record, state))))
  results.update(step=step, split=split, tta=tta, weights=weights,
                 image_size=dataset.eval_image_shape[0],
                 source=config.dataset.folder or config.dataset.name,
                 checkpoint=os.path.join(workdir, 'checkpoints', str(step)))
  logging.info('eval of step %d: %s  (%d examples)', step, eval_summary(results), results['num_examples'])
  if jax.process_index() == 0:
    # The latest evaluation on top; every split's latest result kept under 'splits'.
    path = os.path.join(output, 'eval.json')
    earlier = files.read_json(path) or files.read_json(os.path.join(workdir, 'eval.json')) or {}
    splits = earlier.get('splits', {})
    splits[key] = dict(results)
    with files.writing(path, 'free disk space or choose a writable --workdir'):
      files.write_json(path, {**results, 'splits': splits})
  return results


def fewshot_accuracies(config: ml_collections.ConfigDict, placement: placing.Placement, state,
                       record: dict) -> dict[str, float]:
  """eval.fewshot's probe accuracies of a restored model (they need the train split too)."""
  dataset = pipeline.load(config, class_names=record.get('class_names'))
  norm = record['normalization']
  task = steps.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']), mean=norm['mean'], std=norm['std'])
  return fewshot.Probe(config, dataset, task, placement)(state)


def eval_summary(results: dict) -> str:
  """The log line's metrics: loss and accuracy first, then every other scalar, e.g. 'loss 0.4 ...'."""
  names = ['eval_loss', 'eval_accuracy'] + [name for name, value in results.items()
                                            if name.startswith('eval_') and isinstance(value, float)
                                            and name not in ('eval_loss', 'eval_accuracy')]
  return '  '.join(f'{name.removeprefix("eval_")} {results[name]:.4f}' for name in names if name in results)



def split_file_name(split: str) -> str:
  """A split as part of a file name: 'train_5000' for 'train[:5000]', 'train_45000-' for 'train[45000:]'."""
  name = re.sub(r'\[(-?\d*%?):(-?\d*%?)\]', lambda m: '_' + (f'{m[1]}-{m[2]}' if m[1] else m[2]), split)
  return re.sub(r'[^\w.-]+', '_', name.replace('%', 'pct')).strip('_')
