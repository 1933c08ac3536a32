"""The model card of --mode=export: WORKDIR/export/README.md, and the same card with the Hugging Face
metadata block timm's `push_to_hf_hub` writes as WORKDIR/export/timm/README.md (the hub's card).

Everything on it is read, not typed: the class names and checks from export.json's summary, the recipe
from the run's config, the metrics from eval.json (--mode=eval) or else results.json (the end of
training), the per-class extremes from the run's per_class.csv (else computed from the float TFLite
model's eval logits), calibration from eval.json's ECE and, when present, calibration.json's
temperature scaling.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Optional

import ml_collections
import numpy as np

from flaxtpu.io import files
from flaxtpu.optimizers import swa

EXTREMES = 3  # best and worst classes listed


def _percent(value: Optional[float]) -> str:
  return '-' if value is None else f'{100 * value:.2f}%'


def _numbers(values) -> str:
  return '[' + ', '.join(f'{value:.4g}' for value in values) + ']'


def _read_json(path: str) -> dict:
  return files.read_json(path) or {}


def _per_class(workdir: str, class_names: list[str], logits: Optional[np.ndarray],
               labels: Optional[np.ndarray]) -> tuple[list[tuple[str, float, int]], str]:
  """[(class, accuracy, support)] and where they come from."""
  path = os.path.join(workdir, 'per_class.csv')
  if files.exists(path):
    with files.open_file(path, encoding='utf-8') as f:
      rows = [row for row in csv.DictReader(f) if row.get('accuracy') not in (None, '')]
    if rows and 'support' in rows[0]:
      return [(row['class'], float(row['accuracy']), int(row['support'])) for row in rows
              if int(row['support']) > 0], 'the run\'s per_class.csv'
  if logits is None or labels is None or labels.ndim != 1:
    return [], ''
  predictions = logits.argmax(-1)
  rows = []
  for index, name in enumerate(class_names):
    support = int((labels == index).sum())
    if support:
      rows.append((name, float((predictions[labels == index] == index).mean()), support))
  return rows, 'the float TFLite model on the eval split at export'


def _ece(logits: np.ndarray, labels: np.ndarray, class_names: list[str]) -> float:
  from flaxtpu.report import metrics  # pylint: disable=g-import-not-at-top
  return float(metrics.eval_report(logits, labels, class_names)['ece'])


def _recipe(config: ml_collections.ConfigDict, step: int) -> list[str]:
  optimizer, schedule, augment = config.optimizer, config.schedule, config.augment
  length = (f'{config.num_train_steps} steps' if config.num_train_steps > 0
            else f'{config.num_epochs:g} epochs')
  lines = [
      f'- model: `{config.model.name}` ({config.dtype}), checkpoint step {step} '
      f'({swa.weights_name(config.eval).replace("ema", "EMA").replace("swa", "SWA")} weights)',
      f'- training length: {length}, batch size {config.batch_size}, seed {config.seed}',
      f'- optimizer: `{optimizer.name}`, learning rate {optimizer.learning_rate:g}, weight decay '
      f'{optimizer.weight_decay:g}; schedule `{schedule.name}` (warmup {schedule.warmup_epochs:g} epochs)',
      f'- label smoothing {config.label_smoothing:g}; augmentation: flip {bool(augment.flip)}, crop padding '
      f'{augment.crop_padding}, policy `{augment.policy or "none"}`, mixup {augment.mixup_alpha:g}, '
      f'cutmix {augment.cutmix_alpha:g}',
  ]
  return lines


def _checks(summary: dict) -> list[str]:
  check = summary.get('check', {})
  rows = ['| artefact | check | result |', '| --- | --- | --- |']
  for name, what in (('saved_model', 'SavedModel'), ('tflite', 'TFLite float32'), ('onnx', 'ONNX')):
    if isinstance(check.get(name), dict):
      measured = check[name]
      diffs = ', '.join(f'{key} {value:.3g}' for key, value in measured.items()
                        if 'diff' in key and isinstance(value, (int, float)))
      rows.append(f'| {what} | logits against flaxtpu predict on {check.get("num_images", "?")} '
                  f'{check.get("split", "eval")} images, batch sizes {measured.get("batch_sizes", "-")}, '
                  f'tolerance {measured.get("tolerance", "-")} | {diffs} (passed) |')
  models = summary.get('tflite_models') or {}
  for kind in ('fp16', 'int8'):
    model = models.get(kind) or {}
    if model.get('file'):
      rows.append(f'| TFLite {kind} | top-1 agreement with the float model, accuracy on '
                  f'{models["num_images"]} {models["split"]} images | agreement '
                  f'{_percent(model["top1_agreement_with_float"])}, accuracy '
                  f'{_percent(model["eval_accuracy"])} '
                  f'(drop {100 * model["accuracy_drop"]:.2f} points'
                  + (f', over the {100 * model["max_drop"]:g}-point margin: kept with a warning'
                     if kind == 'int8' and not model['within_max_drop'] else '') + ') |')
  timm = summary.get('timm') or {}
  if timm.get('directory'):
    rows.append('| timm | the safetensors read back through the import mapping to the same arrays | equal |')
  return rows


def _loading(summary: dict, directory: str) -> list[str]:
  height, width, channels = summary['signature']['inputs']['images']['shape'][1:]
  lines = [f'SavedModel, TensorFlow alone (uint8 images `[N, {height}, {width}, {channels}]`, any N):',
           '', '```python', 'import tensorflow as tf',
           f"serve = tf.saved_model.load('{directory}/saved_model').signatures['serving_default']",
           "probabilities = serve(images=tf.constant(uint8_images))['probabilities']", '```', '']
  if summary.get('tflite'):
    models = summary.get('tflite_models') or {}
    names = [summary['tflite']] + [models[kind]['file'] for kind in ('fp16', 'int8')
                                   if (models.get(kind) or {}).get('file')]
    lines += [f'TFLite / LiteRT ({", ".join(names)}; each returns `logits`):', '', '```python',
              'from ai_edge_litert.interpreter import Interpreter  # or tf.lite.Interpreter',
              f"runner = Interpreter(model_path='{directory}/{names[-1]}').get_signature_runner()",
              "logits = runner(images=uint8_images)['logits']", '```', '']
  if os.path.isfile(os.path.join(directory, 'model.onnx')) or summary.get('onnx'):
    lines += ['ONNX Runtime:', '', '```python', 'import onnxruntime as ort',
              f"session = ort.InferenceSession('{directory}/model.onnx')",
              "logits, probabilities = session.run(['logits', 'probabilities'], {'images': uint8_images})",
              '```', '']
  timm = summary.get('timm') or {}
  if timm.get('directory'):
    lines += ['PyTorch, timm (float images normalised as timm\'s config.json says):', '', '```python',
              'import timm', f"model = timm.create_model('local-dir:{timm['directory']}', pretrained=True)",
              '```', '']
  return lines


def _eval_crop_fraction(config: ml_collections.ConfigDict) -> float:
  """The centre crop eval (and so the export) reads images with: eval.image_size's, else the train size's."""
  if config.eval.image_size and config.eval.crop_fraction:
    return config.eval.crop_fraction
  return (config.dataset.crop_fraction or 0.875) if config.dataset.image_size else 1.0


def render(summary: dict, config: ml_collections.ConfigDict, workdir: str, data: Optional[dict] = None,
           float_logits: Optional[np.ndarray] = None) -> str:
  """The card's Markdown (no metadata block) for an export whose export.json holds `summary`."""
  class_names = list(summary['class_names'])
  directory = summary['directory']
  data = data or {}
  labels = data.get('labels')
  height, width, channels = summary['signature']['inputs']['images']['shape'][1:]
  normalization = summary['normalization']
  dataset = config.dataset
  source = f'image folder `{dataset.folder}`' if dataset.folder else f'TFDS `{dataset.name}`'
  title = os.path.basename(os.path.normpath(dataset.folder)) if dataset.folder else dataset.name
  lines = [f'# {summary["model"]} on {title}', '',
           f'A flaxtpu {summary["task"]} image classifier: `{summary["model"]}` trained to step '
           f'{summary["step"]}, exported by `--mode=export`.', '',
           f'## Classes ({len(class_names)})', '', ', '.join(f'`{name}`' for name in class_names), '',
           '## Preprocessing', '',
           f'- input: uint8 {"RGB " if channels == 3 else ""}images `[N, {height}, {width}, {channels}]`; '
           + (f'photos resized and centre-cropped to {height}x{width} as eval does (crop fraction '
              f'{_eval_crop_fraction(config):g})' if dataset.image_size or config.eval.image_size
              else f'no resizing: images are {height}x{width} as trained'),
           '- normalisation inside the model: (x / 255 - mean) / std with mean '
           f'{_numbers(normalization["mean"])} and std {_numbers(normalization["std"])}'
           + (' (the timm folder expects it done outside, as its config.json says)'
              if (summary.get('timm') or {}).get('directory') else ''),
           f'- outputs: `logits` and `probabilities` ({summary["probabilities"]})', '',
           '## Training data', '',
           f'- {source}: train split `{dataset.train_split}`'
           + (f' ({data["train_images"]:,} images)' if data.get('train_images') is not None else '')
           + f', eval split `{dataset.eval_split}`'
           + (f' ({data["eval_images"]:,} images)' if data.get('eval_images') is not None else ''), '',
           '## Recipe', '', *_recipe(config, summary['step']), '']
  evaluated = _read_json(os.path.join(workdir, 'eval.json'))
  results = evaluated or _read_json(os.path.join(workdir, 'results.json'))
  origin = ('--mode=eval (eval.json)' if evaluated else 'the end of training (results.json)')
  lines += ['## Evaluation', '', f'On `{evaluated.get("split", dataset.eval_split)}`, from {origin}:', '',
            '| metric | value |', '| --- | --- |']
  for key in ('eval_accuracy', 'eval_balanced_accuracy', 'eval_top5_accuracy', 'eval_map', 'eval_f1'):
    if isinstance(results.get(key), (int, float)):
      lines.append(f'| {key.removeprefix("eval_")} | {_percent(results[key])} |')
  if isinstance(results.get('eval_loss'), (int, float)):
    lines.append(f'| loss | {results["eval_loss"]:.4f} |')
  models = summary.get('tflite_models') or {}
  for kind in ('float32', 'fp16', 'int8'):
    if (models.get(kind) or {}).get('file'):
      lines.append(f'| TFLite {kind} accuracy ({models["num_images"]} images, at export) | '
                   f'{_percent(models[kind]["eval_accuracy"])} |')
  per_class, per_class_source = _per_class(workdir, class_names, float_logits, labels)
  if per_class:
    ranked = sorted(per_class, key=lambda row: (-row[1], row[0]))
    show = lambda rows: ', '.join(f'`{name}` {_percent(accuracy)} ({support})'
                                  for name, accuracy, support in rows)
    lines += ['', f'Per-class accuracy (support), from {per_class_source}:', '',
              f'- best: {show(ranked[:EXTREMES])}', f'- worst: {show(ranked[::-1][:EXTREMES])}']
  lines += ['', '## Calibration', '']
  ece = results.get('eval_ece')
  if isinstance(ece, (int, float)):
    lines.append(f'- expected calibration error (ECE, 15 bins): {ece:.4f} ({origin})')
  elif float_logits is not None and labels is not None and labels.ndim == 1:
    lines.append(f'- expected calibration error (ECE, 15 bins): '
                 f'{_ece(float_logits, labels, class_names):.4f} (the float TFLite model at export)')
  calibration = _read_json(os.path.join(workdir, 'calibration.json'))
  if calibration:
    value = lambda key, form: (form.format(calibration[key])
                               if isinstance(calibration.get(key), (int, float)) else '-')
    lines.append(f'- temperature scaling (calibration.json, split `{calibration.get("split", "?")}`, step '
                 f'{calibration.get("step", "?")}): T = {value("temperature", "{:.4f}")}; ECE '
                 f'{value("ece_before", "{:.4f}")} -> {value("ece_after", "{:.4f}")}, NLL '
                 f'{value("nll_before", "{:.4f}")} -> {value("nll_after", "{:.4f}")}'
                 + (f'; prediction sets: coverage {value("coverage", "{:.3f}")} at threshold '
                    f'{value("set_threshold", "{:.4f}")}' if 'coverage' in calibration else ''))
    lines.append('- the exported logits are not temperature-scaled: divide them by T for calibrated '
                 'probabilities')
  elif not lines[-1].startswith('- expected'):
    lines.append('- no calibration measured')
  lines += ['', '## Checks passed before export', '', *_checks(summary), '',
            '## Loading', '', *_loading(summary, directory)]
  return '\n'.join(lines).rstrip() + '\n'


def metadata(summary: dict, config: ml_collections.ConfigDict) -> str:
  """The YAML block timm's `push_to_hf_hub` opens its README.md with."""
  dataset = config.dataset
  name = dataset.name if not dataset.folder else os.path.basename(os.path.normpath(dataset.folder))
  lines = ['---', 'tags:', '- image-classification', '- timm', '- flaxtpu', 'library_name: timm']
  if config.export.license:
    lines.append(f'license: {config.export.license}')
  lines += ['datasets:', f'- {json.dumps(name)}', 'metrics:', '- accuracy', '---', '']
  return '\n'.join(lines)


def write(directory: str, summary: dict, config: ml_collections.ConfigDict, workdir: str,
          data: Optional[dict] = None, float_logits: Optional[np.ndarray] = None) -> dict[str, Any]:
  """Writes `directory`/README.md and, when the timm folder was exported, `directory`/timm/README.md."""
  card = render(summary, config, workdir, data, float_logits)
  written = ['README.md']
  with open(os.path.join(directory, 'README.md'), 'w', encoding='utf-8') as f:
    f.write(card)
  if os.path.isdir(os.path.join(directory, 'timm')):
    with open(os.path.join(directory, 'timm', 'README.md'), 'w', encoding='utf-8') as f:
      f.write(metadata(summary, config) + card)
    written.append('timm/README.md')
  return {'files': written}
