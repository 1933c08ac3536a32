"""--mode=export: a checkpoint as a TensorFlow SavedModel and a TFLite model that run without JAX.

`export_checkpoint(config, workdir)` writes

    WORKDIR/export/
      saved_model/      saved_model.pb + variables/ + assets/class_names.txt
      model.tflite      the same model for TFLite / LiteRT (when the converter can produce it)
      model.onnx        the same function for onnxruntime & co. (flaxtpu/exporters/onnx_export.py; when
                        jax2onnx is installed), the same `images` -> `logits`, `probabilities` signature
      class_names.txt   one class name a line, in logit order (also next to a deployed model.tflite)
      timm/             ResNets, ViTs, ConvNeXt: model.safetensors in timm's keys + timm's config.json;
                        timm.create_model('local-dir:WORKDIR/export/timm', pretrained=True) gives the
                        same logits in PyTorch (and init_from reads it back)
      export.json       step, paths, input signature, class names, tolerances, measured differences;
                        the task, how its probabilities are made, and (multilabel) each tag's threshold

The `serving_default` signature takes `images`: uint8 [batch, H, W, C] (any
batch size, H x W x C the model's input size) and returns float32 `logits`
and `probabilities` [batch, num_classes]; the checkpoint's normalisation is
built in. Probabilities are the softmax of the logits for `task=multiclass`
and a sigmoid of each logit for `task=multilabel` (export.json's `task` and
`probabilities` say which; the SavedModel's `task` variable too; TFLite and
timm exports carry the logits only: apply the sigmoid yourself). Images
must already be at the model's input size: for `dataset.image_size > 0`
runs, resize and centre-crop them as eval does (flaxtpu/data/preprocess.py).
Class names are an asset and a string variable (`loaded.class_names`).

Before anything appears under WORKDIR/export, both models are run on eval
images and compared with flaxtpu's own predict; a difference beyond the
tolerance raises UserError and leaves the previous export (or none) as it was.

The export is atomic: everything is written into WORKDIR/export.staging-PID,
export.json last (it marks the staging complete), then swapped in by two
renames (export -> export.old-PID, staging -> export). A kill at any instant
leaves the old export or the new one: the next export (or `recover`) moves a
complete staging or the old one back into place and removes the leftovers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from flaxtpu import models
from flaxtpu.augmentation import image_sizes
from flaxtpu.data import loaders, pipeline
from flaxtpu.exporters import (
  hub,
  model_card,
  onnx_export,
  tflite_export,
)
from flaxtpu.exporters.tflite_export import tflite_runner as _tflite_runner
from flaxtpu.exporters.tflite_export import write_tflite as _write_tflite
from flaxtpu.io import (
  files,
  storage,
)
from flaxtpu.models import layouts
from flaxtpu.modes.predict import predict_logits
from flaxtpu.modes.restore import restore
from flaxtpu.modes.thresholds import tag_thresholds
from flaxtpu.optimizers import (
  optim,
  swa,
)
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size
from flaxtpu.step import (
  parallel,
  steps,
)
from flaxtpu.weights import pretrained

EXPORT_DIR = 'export'
# What a killed export leaves next to EXPORT_DIR; earlier versions staged in '.export-<12 hex>'.
LEFTOVER = re.compile(rf'{EXPORT_DIR}\.(staging|old)-(\d+)|\.{EXPORT_DIR}-[0-9a-f]{{12}}(-previous)?')
COMPLETE_MARKER = 'export.json'  # written last into a staging directory
# The serialized StableHLO is lowered for every platform, so a model exported on a TPU serves on a CPU.
PLATFORMS = ('cpu', 'cuda', 'tpu')
CHECK_IMAGES = 256
# Allowed max |exported - predict| logits, relative to max(1, max |predict logits|). The SavedModel runs
# the same StableHLO through XLA (only the device count and fusion differ); TFLite re-lowers it to its
# own kernels (XNNPACK), whose sums run in another order; bfloat16 models round every activation.
TOLERANCES = {'float32': {'saved_model': 1e-4, 'tflite': 1e-3, 'onnx': 1e-4},
              'bfloat16': {'saved_model': 3e-2, 'tflite': 5e-2, 'onnx': 5e-2},
              'float16': {'saved_model': 3e-2, 'tflite': 5e-2, 'onnx': 5e-2}}  # float16 is finer than bf16


def export_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Exports the checkpoint `config.eval.checkpoint` names to WORKDIR/export; returns export.json's contents.

  Runs on one process (like --mode=predict). Raises UserError when the
  exported models disagree with flaxtpu's predict on the eval images.
  """
  if jax.process_count() > 1:
    raise UserError('--mode=export runs on one process; start it without --num_processes')
  if (reason := files.unwritable(workdir)) is not None:
    raise UserError(f'--mode=export writes {os.path.join(workdir, EXPORT_DIR)}, but {workdir} refuses '
                    f'files ({reason}); copy the run to a writable directory and export there')
  recover(workdir)
  final = os.path.join(workdir, EXPORT_DIR)
  if (reason := _unreplaceable(final)) is not None:
    raise UserError(f'--mode=export replaces {final}, but it cannot be replaced ({reason}); make it writable '
                    'or move it away, and run the same command')
  tf = _import_tensorflow()
  placement, state, step, record = restore(config, workdir, replaces=[os.path.join(workdir, EXPORT_DIR)])
  images = _check_images(config, record)
  expected = predict_logits(placement, state, images, resolved_eval_batch_size(config))
  # Sharded (fsdp) or per-device (pmap) parameters -> one numpy copy on the host.
  host_state = parallel.host_copy(placement.to_saveable(state))
  task = steps.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']), mean=record['normalization']['mean'],
                           std=record['normalization']['std'],
                           temperature=(record.get('calibration') or {}).get('temperature', 1.0))
  # Served at the eval size (eval.image_size), as eval and predict read images.
  task = dataclasses.replace(task, image_shape=image_sizes.eval_shape(config, record['image_shape']))
  remote = storage.is_remote(workdir)  # TensorFlow writes the SavedModel locally; it is uploaded after
  staging = (tempfile.mkdtemp(prefix='flaxtpu-export-') if remote
             else os.path.join(workdir, f'{EXPORT_DIR}.staging-{os.getpid()}'))  # not mkdtemp: mode 0700
  os.makedirs(staging, exist_ok=remote)
  data, measured = tflite_export.eval_data(config, list(record['class_names'])), {}

  def quantize(source: str) -> dict:
    measured['models'], measured['float_logits'] = tflite_export.write_quantized(
        source, staging, data['representative'], data['images'], data['labels'],
        multilabel=data['multilabel'], int8_max_drop=config.export.int8_max_drop,
        split=config.dataset.eval_split, calibration_split=data['calibration_split'],
        kinds=tuple(config.export.quantize))
    return measured['models']

  try:
    summary = _export_into(tf, staging, task, host_state, record['class_names'], images, expected,
                           TOLERANCES[config.dtype], quantize if config.export.quantize else None)
    summary.update(onnx_export.export(staging, task, host_state, _logits_function) if config.export.onnx
                   else {'onnx': None, 'onnx_error': 'not asked for (export.onnx=false)', 'onnx_model': None})
    if summary['onnx']:
      summary['check']['onnx'] = _check('ONNX', onnx_export.runner(os.path.join(staging, summary['onnx'])),
                                        images, expected, TOLERANCES[config.dtype]['onnx'])
    elif config.export.onnx:
      logging.warning('export: no ONNX model: %s', summary['onnx_error'])
    summary['timm'] = _export_timm(config, os.path.join(staging, 'timm'),
                                   os.path.join(files.absolute(final), 'timm'), host_state, record)
    summary.update(
        step=step, model=record['model'], dtype=config.dtype, directory=files.absolute(final),
        weights=swa.weights_name(config.eval), flip_tta=bool(config.eval.flip_tta),
        translate_tta=int(config.eval.translate_tta), image_size=task.image_shape[0],
        temperature=(record.get('calibration') or {}).get('temperature', 1.0),
        checkpoint=os.path.join(workdir, 'checkpoints', str(step)),
        preprocessing=('uint8 images at the model input size; normalisation is inside the model' + (
            f'; resize and centre-crop photos to {task.image_shape[0]}x{task.image_shape[1]} as eval does '
            '(flaxtpu/data/preprocess.py)' if config.dataset.image_size or config.eval.image_size else '')),
        normalization=record['normalization'], class_names=list(record['class_names']),
        **_task_metadata(config, workdir, step, list(record['class_names'])))
    summary['check'].update(num_images=len(images), split=config.dataset.eval_split)
    summary['data'] = {'source': config.dataset.folder or config.dataset.name,
                       'train_split': config.dataset.train_split, 'train_images': data['train_images'],
                       'eval_split': config.dataset.eval_split, 'eval_images': data['eval_images']}
    summary['card'] = model_card.write(staging, summary, config, workdir, data, measured.get('float_logits'))
    files.write_json(os.path.join(staging, COMPLETE_MARKER), summary)  # last: the staging is complete
  except BaseException as e:
    shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays behind
    if isinstance(e, Exception) and (reason := files.storage_error(e)) is not None:
      raise UserError(f'exporting step {step} into {workdir} failed ({reason}); the previous export in '
                      f'{final} is unchanged; free disk space and run the same command') from e
    raise
  try:
    (_upload_into_place if remote else _move_into_place)(staging, final)
  except OSError as e:
    shutil.rmtree(staging, ignore_errors=True)
    raise UserError(f'--mode=export could not replace {final} ({files.short_error(e)}); the previous export '
                    'there is unchanged; make it writable or move it away, and run the same command') from e
  checks = summary['check']
  logging.info('exported step %d to %s: SavedModel max |logit diff| %.2g; %s; %s', step, final,
               checks['saved_model']['max_abs_diff'],
               f'TFLite {checks["tflite"]["max_abs_diff"]:.2g}' if summary['tflite'] else
               f'no TFLite: {summary["tflite_error"]}',
               f'ONNX {checks["onnx"]["max_abs_diff"]:.2g}' if summary['onnx'] else
               f'no ONNX: {summary["onnx_error"]}')
  if config.export.hub_repo:
    logging.info('export: uploaded to %s', hub.upload(config.export.hub_repo, files.absolute(final)))
  return summary


def _unreplaceable(final: str) -> str | None:
  """Why an existing WORKDIR/export cannot be swapped for a new one (a mount point, read-only), or None."""
  if storage.is_remote(final) or not os.path.lexists(final):
    return None
  if not os.path.isdir(final) or os.path.islink(final):
    return 'it is not a directory'
  if os.path.ismount(final):
    return 'it is a mount point'
  return files.unwritable(final)


def _export_into(tf, directory: str, task: steps.Task, host_state: steps.ModelState, class_names: list[str],
                 images: np.ndarray, expected: np.ndarray, tolerances: dict[str, float],
                 quantize: Optional[Callable[[str], dict]] = None) -> dict[str, Any]:
  """Writes and checks the SavedModel, then the TFLite model (and `quantize(float32 SavedModel)`'s
  quantized ones), in `directory`."""
  started = time.perf_counter()
  class_names_file = os.path.join(directory, 'class_names.txt')
  with open(class_names_file, 'w', encoding='utf-8') as f:
    f.writelines(f'{name}\n' for name in class_names)
  saved_model_dir = os.path.join(directory, 'saved_model')
  _save(tf, saved_model_dir, task, host_state, class_names, class_names_file)
  serve = tf.saved_model.load(saved_model_dir).signatures['serving_default']
  checks = {'saved_model': _check('SavedModel', lambda x: serve(images=tf.constant(x))['logits'].numpy(),
                                  images, expected, tolerances['saved_model'])}
  tflite_path = os.path.join(directory, 'model.tflite')
  source = saved_model_dir
  if task.model.dtype != jnp.float32:  # TFLite has no bfloat16 convolutions: the same weights, in float32
    source = os.path.join(directory, 'float32_saved_model')
    _save(tf, source, dataclasses.replace(task, model=task.model.clone(dtype=jnp.float32)), host_state,
          class_names, class_names_file)
  tflite_error, tflite_flex = _write_tflite(tf, source, tflite_path)
  quantized = None
  if tflite_error is None:
    checks['tflite'] = _check('TFLite', _tflite_runner(tflite_path), images, expected, tolerances['tflite'])
    quantized = quantize(source) if quantize else None  # model_fp16.tflite, model_int8.tflite
  else:
    logging.warning('export: no TFLite model: %s', tflite_error)
  if source != saved_model_dir:
    shutil.rmtree(source)
  height, width, channels = task.image_shape
  tensor = lambda dtype, shape: {'dtype': dtype, 'shape': shape}
  return {
      'saved_model': 'saved_model', 'tflite': None if tflite_error else 'model.tflite',
      'tflite_error': tflite_error, 'tflite_needs_flex_ops': tflite_flex,
      'tflite_compute_dtype': None if tflite_error else 'float32',  # bfloat16 models too: see above
      'tflite_models': quantized,
      'class_names_file': 'class_names.txt', 'platforms': list(PLATFORMS),
      'signature': {'name': 'serving_default',
                    'inputs': {'images': tensor('uint8', [None, height, width, channels])},
                    'outputs': {'logits': tensor('float32', [None, task.num_classes]),
                                'probabilities': tensor('float32', [None, task.num_classes])}},
      'check': {'tolerance_rule': 'max |logits - predict| <= tolerance x max(1, max |predict logits|)',
                **checks},
      'export_seconds': round(time.perf_counter() - started, 3),
  }


def _task_metadata(config: ml_collections.ConfigDict, workdir: str, step: int,
                   class_names: list[str]) -> dict[str, Any]:
  """What the exported logits mean: the task, how `probabilities` come from them and, multilabel,
  the threshold of each tag that --mode=predict would apply (`modes.thresholds.tag_thresholds`)."""
  if config.task != 'multilabel':
    return {'task': 'multiclass', 'probabilities': 'softmax over the classes (they sum to 1)'}
  thresholds, source = tag_thresholds(config, workdir, step, class_names)
  return {'task': 'multilabel',
          'probabilities': 'sigmoid of each logit: an independent probability per tag (a tag is present '
                           'when its probability reaches its threshold)',
          'thresholds': dict(zip(class_names, thresholds.tolist())), 'thresholds_source': source}


def _export_timm(config: ml_collections.ConfigDict, directory: str, final: str, host_state: steps.ModelState,
                 record: dict) -> dict[str, Any]:
  """The weights in timm's layout (written to `directory`, to be moved to `final`), read back through
  init_from's mapping to check they are the same arrays."""
  if models.get_family(config.model.name).timm_architecture is None:
    return {'skipped': f'{config.model.name} has no timm twin'}
  arrays = {f'{collection}/{name}': np.asarray(leaf) for collection in ('params', 'batch_stats')
            for name, leaf in optim.named_leaves(getattr(host_state, collection)).items()}
  options = {key: config.model[key] for key in models.get_spec(config.model.name).options
             if key in ('patch_size', 'pool', 'gelu', 'padding', 'downsample')}
  try:
    architecture, _ = pretrained.timm_architecture(config.model.name, options, tuple(record['image_shape']),
                                                   record['num_classes'])
  except UserError as e:
    logging.warning('no timm export: %s', e)
    return {'skipped': str(e)}
  os.makedirs(directory)
  timm_config = pretrained.write_timm(
      directory, model=config.model.name, options=options, arrays=arrays, class_names=record['class_names'],
      mean=record['normalization']['mean'], std=record['normalization']['std'],
      image_shape=tuple(record['image_shape']), crop_fraction=config.dataset.crop_fraction or 0.875,
      image_size_key=config.dataset.image_size)
  written = pretrained.read_tensors.__wrapped__(os.path.join(directory, 'model.safetensors'))
  rules = pretrained.timm_rules(config.model.name, options)
  back = layouts.load(rules, written, {name: array.shape for name, array in arrays.items()}, directory)
  if different := [name for name, array in arrays.items() if not np.array_equal(back.get(name), array)]:
    raise UserError(f'the timm export does not read back to the same {different[0]} (a flaxtpu bug)')
  return {'directory': final, 'architecture': architecture, 'model_args': timm_config['model_args'],
          'load': f"timm.create_model('local-dir:{final}', pretrained=True)"}


def _import_tensorflow():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with contextlib.suppress(RuntimeError):  # already initialised: its devices are set already
    tf.config.set_visible_devices([], 'GPU')  # accelerator memory stays JAX's
  return tf


def _check_images(config: ml_collections.ConfigDict, record: dict) -> np.ndarray:
  """The first CHECK_IMAGES eval images, at the model's input size, as predict sees them."""
  dataset = pipeline.load(config, need_train=False)
  if dataset.image_shape != tuple(record['image_shape']) or len(dataset.eval) == 0:
    raise UserError('export checks the model on the eval split of '
                    f'{config.dataset.folder or config.dataset.name}, which has {len(dataset.eval)} images '
                    f'of {dataset.image_shape}, but the checkpoint takes {tuple(record["image_shape"])}; '
                    'point the config at data like the training data')
  batch = next(loaders.eval_batches(dataset, batch_size=min(CHECK_IMAGES, len(dataset.eval))))
  return batch.images[batch.mask]


def _logits_function(task: steps.Task) -> Callable:
  """(variables, uint8 images) -> float32 logits: predict's own `logits_fn`, normalisation included."""

  def logits(variables: dict, images: jax.Array) -> jax.Array:
    state = steps.ModelState(params=variables['params'], batch_stats=variables['batch_stats'])
    return steps.logits_fn(state, images, task=task).astype(jnp.float32)

  return logits


def _save(tf, path: str, task: steps.Task, host_state: steps.ModelState, class_names: list[str],
          class_names_file: str) -> None:
  """The task's logits as a SavedModel: `serving_default`, the weights as variables, the class names."""
  from jax.experimental import jax2tf  # pylint: disable=g-import-not-at-top
  height, width, channels = task.image_shape
  converted = jax2tf.convert(_logits_function(task), with_gradient=False,
                             polymorphic_shapes=[None, f'(b, {height}, {width}, {channels})'],
                             native_serialization_platforms=PLATFORMS)
  module = tf.Module()
  # Variables, not constants: the weights stay out of the graph proto, which is capped at 2 GiB.
  module.model_variables = tf.nest.map_structure(
      lambda x: tf.Variable(x, trainable=False),
      {'params': host_state.params, 'batch_stats': host_state.batch_stats})
  module.class_names = tf.Variable(list(class_names), trainable=False, dtype=tf.string)
  module.task = tf.Variable('multilabel' if task.multilabel else 'multiclass', trainable=False,
                            dtype=tf.string)
  module.class_names_file = tf.saved_model.Asset(class_names_file)  # copied to saved_model/assets/

  @tf.function(autograph=False, input_signature=[
      tf.TensorSpec([None, height, width, channels], tf.uint8, name='images')])
  def serve(images):
    logits = converted(module.model_variables, images)
    probabilities = tf.nn.sigmoid(logits) if task.multilabel else tf.nn.softmax(logits, axis=-1)
    return {'logits': logits, 'probabilities': probabilities}

  module.serve = serve
  tf.saved_model.save(module, path, signatures={'serving_default': serve})


def _check(what: str, run: Callable[[np.ndarray], np.ndarray], images: np.ndarray,
           expected: np.ndarray, tolerance: float) -> dict[str, Any]:
  """Runs the exported model on all images in one batch and on the first alone (another batch size)."""
  outputs = run(images)
  first = run(images[:1])
  max_diff = float(max(np.abs(outputs - expected).max(), np.abs(first - expected[:1]).max()))
  scale = max(1.0, float(np.abs(expected).max()))
  allowed = tolerance * scale
  if not max_diff <= allowed:  # also catches NaN
    raise UserError(f'export check failed: the {what} logits differ from flaxtpu predict by up to '
                    f'{max_diff:.3g} on {len(images)} eval images, more than the {allowed:.3g} allowed '
                    f'({tolerance:g} x max(1, max |logit| = {scale:.3g})); nothing was exported')
  return {'max_abs_diff': max_diff, 'tolerance': tolerance, 'allowed_abs_diff': allowed,
          'batch_sizes': [len(images), 1]}


@contextlib.contextmanager
def _locked(workdir: str):
  """Holds the workdir's flock while exports move directories: two exports never interleave renames."""
  handle = os.open(workdir, os.O_RDONLY)
  try:
    fcntl.flock(handle, fcntl.LOCK_EX)
    yield
  finally:
    os.close(handle)  # releases the lock (so does a kill)


def _move_into_place(staging: str, final: str) -> None:
  """Swaps the checked export in; a previous export is replaced whole, never merged.

  Between the two renames `final` is missing: `recover` completes the swap after a kill there.
  """
  old = os.path.join(os.path.dirname(final), f'{EXPORT_DIR}.old-{os.getpid()}')
  with _locked(os.path.dirname(final)):
    if os.path.exists(final):
      os.rename(final, old)
    os.rename(staging, final)
  shutil.rmtree(old, ignore_errors=True)


def _upload_into_place(staging: str, final: str) -> None:
  """_move_into_place for an object store, which renames nothing: the previous export's objects are
  deleted and the staging's uploaded, export.json last (a reader that finds it finds the whole export)."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  if epath.Path(final).exists():
    epath.Path(final).rmtree()
  paths = sorted((os.path.join(root, name) for root, _, names in os.walk(staging) for name in names),
                 key=lambda path: path == os.path.join(staging, COMPLETE_MARKER))
  for path in paths:
    files.upload(path, os.path.join(final, os.path.relpath(path, staging)))
  shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return False  # ours from before: this process has staged nothing yet when it recovers
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def recover(workdir: str) -> None:
  """Repairs what a killed export left in `workdir`: with WORKDIR/export missing, the newest complete
  staging (the kill came between the two renames) or else the old export is moved back into place;
  then the staging and old directories of processes no longer running are removed. An object
  store's workdir has none: its export is staged on the local disk."""
  if storage.is_remote(workdir) or not os.path.isdir(workdir):
    return
  final = os.path.join(workdir, EXPORT_DIR)
  with _locked(workdir):
    leftovers = []
    for name in os.listdir(workdir):
      match = LEFTOVER.fullmatch(name)
      if match and not (match.group(2) and _alive(int(match.group(2)))):
        leftovers.append(os.path.join(workdir, name))
    if not os.path.exists(final):
      complete = [path for path in leftovers if os.path.exists(os.path.join(path, COMPLETE_MARKER))]
      newest = max(complete, key=lambda path: os.path.getmtime(os.path.join(path, COMPLETE_MARKER)),
                   default=None)
      if newest is not None:
        logging.info('export: a killed export had finished %s; moved into %s', newest, final)
        os.rename(newest, final)
        leftovers.remove(newest)
  for path in leftovers:
    shutil.rmtree(path, ignore_errors=True)
