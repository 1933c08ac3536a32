"""The TFLite models of --mode=export: float32 (`model.tflite`), float16 weights (`model_fp16.tflite`)
and full-integer int8 (`model_int8.tflite`), each measured on the eval split.

All three are converted from the jax2tf SavedModel export.py writes. jax2tf (jax 0.10) serialises the
model as one `XlaCallModule` op holding StableHLO; TensorFlow 2.21's converter legalises that StableHLO
into TFLite builtins (CONV_2D, FULLY_CONNECTED, MAX_POOL_2D, ...), and its quantizer then works on those
builtins as on any Keras model: float16 weights, and with a representative dataset int8 weights and int8
activations (per-channel convolution scales, int32 biases). The model's uint8 input stays uint8 (a CAST
and a QUANTIZE open the graph; the normalisation runs in int8) and the logits come out float32
(DEQUANTIZE), so every TFLite model takes what the SavedModel takes.

The int8 model is calibrated on `export.calibration_images` train images spread over the split, as the
run's eval pipeline shows them (`loaders.train_sample`). Each model runs over the whole eval split:
its accuracy and the share of images whose top class equals the float model's are in export.json
(`tflite_models`). An int8 model that loses more than `export.int8_max_drop` accuracy is kept, with one
warning line giving the drop.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from typing import Any, Callable, Optional

import numpy as np

FLOAT, FP16, INT8 = 'model.tflite', 'model_fp16.tflite', 'model_int8.tflite'
RUN_BATCH = 256  # eval images per interpreter call


def write_tflite(tf, saved_model_dir: str, path: str, quantize: Optional[str] = None,
                 representative: Optional[np.ndarray] = None) -> tuple[str | None, bool]:
  """Converts the SavedModel to TFLite -> (None or why it could not, in one line; needs Flex ops).

  TFLite builtins alone first (they run on every TFLite runtime); only if they cannot express the
  model, builtins plus TensorFlow kernels (Flex), which a runtime must link in. `quantize`: None
  (float32), 'fp16' (float16 weights) or 'int8' (int8 weights and activations, calibrated on the
  uint8 `representative` images; int8 builtins only, no Flex).
  """
  errors = []
  for flex in ((False,) if quantize == 'int8' else (False, True)):
    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS] + (
        [tf.lite.OpsSet.SELECT_TF_OPS] if flex else [])
    if quantize:
      converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if quantize == 'fp16':
      converter.target_spec.supported_types = [tf.float16]
    elif quantize == 'int8':
      converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
      converter.representative_dataset = lambda: ({'images': image[None]} for image in representative)
    try:
      model = converter.convert()
    except Exception as e:  # pylint: disable=broad-except  # the converter raises many types
      lines = [line.strip() for line in str(e).splitlines() if line.strip()]
      errors.append(f'{type(e).__name__}: {lines[0][:300] if lines else ""}')
      continue
    with open(path, 'wb') as f:
      f.write(model)
    return None, flex
  return f'the TFLite converter of TensorFlow {tf.__version__} failed: {errors[-1]}', False


def interpreter_class():
  """LiteRT's Interpreter when installed, else tf.lite's (deprecated for LiteRT, still in TF 2.21)."""
  try:
    from ai_edge_litert.interpreter import Interpreter  # pylint: disable=g-import-not-at-top
  except ImportError:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    Interpreter = tf.lite.Interpreter  # noqa: N806
  return Interpreter


def tflite_runner(path: str) -> Callable[[np.ndarray], np.ndarray]:
  """The TFLite model's serving_default as uint8 images -> float32 logits."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    runner = interpreter_class()(model_path=path).get_signature_runner('serving_default')
  return lambda images: runner(images=images)['logits']


def _logits(path: str, images: np.ndarray) -> np.ndarray:
  run = tflite_runner(path)
  return np.concatenate([run(images[start:start + RUN_BATCH]) for start in range(0, len(images), RUN_BATCH)])


CHILD_CODE = ('import sys; from flaxtpu.exporters.tflite_export import quantize_and_score; '
              'quantize_and_score(*sys.argv[1:])')


def quantize_and_score(saved_model_dir: str, path: str, kind: str, representative_file: str,
                       images_file: str, logits_file: str, error_file: str) -> None:
  """In a child process: the `kind` TFLite model converted to `path`, then run on the images; its logits to
  `logits_file`, or the converter's one-line refusal to `error_file`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  error, _ = write_tflite(tf, saved_model_dir, path, quantize=kind,
                          representative=np.load(representative_file))
  if error is not None:
    with open(error_file, 'w', encoding='utf-8') as f:
      f.write(error)
    return
  np.save(logits_file, _logits(path, np.load(images_file)))


def _quantized_in_a_child(saved_model_dir: str, path: str, kind: str, representative: np.ndarray,
                          images: np.ndarray) -> tuple[Optional[str], Optional[np.ndarray]]:
  """quantize_and_score in another process -> (None, logits) or (why not, None). TensorFlow's quantizer and
  TFLite's interpreter kill their process on some graphs (a segfault in the int8 quantizer on an
  EfficientNet-B0 with "scale out of expressed type range"; an abort running an int8 ResNet-18 at 32 px):
  that must cost the one model, not the export."""
  with tempfile.TemporaryDirectory(prefix='flaxtpu-tflite-') as directory:
    given = {name: os.path.join(directory, f'{name}.npy') for name in ('representative', 'images')}
    np.save(given['representative'], representative)
    np.save(given['images'], images)
    returned, refused = os.path.join(directory, 'logits.npy'), os.path.join(directory, 'error.txt')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [root, os.environ.get('PYTHONPATH')]))}
    done = subprocess.run([sys.executable, '-c', CHILD_CODE, saved_model_dir, path, kind,
                           given['representative'], given['images'], returned, refused], env=env,
                          capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
      how = (f'signal {signal.Signals(-done.returncode).name}' if done.returncode < 0
             else f'exit status {done.returncode}')
      said = [line for line in done.stderr.splitlines() if any(word in line.lower() for word in (
          'error', 'fail', 'abort')) and 'oneDNN' not in line]
      last = said[-1].strip()[:200] if said else ''
      doing = 'running' if os.path.exists(path) else 'converting'
      if os.path.exists(path):
        os.remove(path)
      return f'TensorFlow stopped with {how} {doing} the {kind} model' + (f' ({last})' if last else ''), None
    if os.path.exists(refused):
      with open(refused, encoding='utf-8') as f:
        return f.read(), None
    return None, np.load(returned)


def _accuracy(logits: np.ndarray, labels: np.ndarray, multilabel: bool) -> float:
  """Top-1 accuracy; multilabel: the share of (image, tag) decisions at probability 0.5 that are right."""
  if multilabel:
    return float(np.mean((logits > 0) == (labels > 0)))
  return float(np.mean(logits.argmax(-1) == labels))


def _agreement(logits: np.ndarray, reference: np.ndarray, multilabel: bool) -> float:
  if multilabel:
    return float(np.mean((logits > 0) == (reference > 0)))
  return float(np.mean(logits.argmax(-1) == reference.argmax(-1)))


def write_quantized(saved_model_dir: str, directory: str, representative: np.ndarray,
                    images: np.ndarray, labels: np.ndarray, *, multilabel: bool, int8_max_drop: float,
                    split: str, calibration_split: Optional[str] = None,
                    kinds: tuple[str, ...] = ('fp16', 'int8')) -> tuple[dict[str, Any], Optional[np.ndarray]]:
  """Writes model_fp16.tflite and model_int8.tflite (those of `kinds`) next to `directory`'s model.tflite and
  measures them on the eval split (`images`, `labels`) -> (export.json's `tflite_models`, the float model's
  logits on the eval split).

  A model the converter cannot make is recorded with its error, not raised: the float exports stand.
  """
  float_logits = _logits(os.path.join(directory, FLOAT), images)
  models: dict[str, Any] = {'split': split, 'num_images': len(images),
                            'calibration_images': len(representative), 'calibration_split': calibration_split,
                            'accuracy': 'tag decisions at probability 0.5 that are right' if multilabel
                                        else 'top-1 accuracy',
                            'agreement': 'share of eval images whose top class equals the float model\'s'
                                         if not multilabel else 'share of tag decisions equal to the float '
                                                                'model\'s'}
  float_accuracy = _accuracy(float_logits, labels, multilabel)
  models['float32'] = {'file': FLOAT, 'bytes': os.path.getsize(os.path.join(directory, FLOAT)),
                       'eval_accuracy': float_accuracy, 'top1_agreement_with_float': 1.0}
  for kind, name in (('fp16', FP16), ('int8', INT8)):
    if kind not in kinds:
      continue
    path = os.path.join(directory, name)
    error, logits = _quantized_in_a_child(saved_model_dir, path, kind, representative, images)
    if error is not None:
      logging.warning('export: no %s TFLite model: %s', kind, error)
      models[kind] = {'file': None, 'error': error}
      continue
    accuracy = _accuracy(logits, labels, multilabel)
    models[kind] = {'file': name, 'bytes': os.path.getsize(path), 'eval_accuracy': accuracy,
                    'top1_agreement_with_float': _agreement(logits, float_logits, multilabel),
                    'accuracy_drop': float_accuracy - accuracy,
                    'max_abs_logit_diff_vs_float': float(np.abs(logits - float_logits).max())}
  int8 = models['int8']
  if int8.get('file'):
    int8['max_drop'] = int8_max_drop
    int8['within_max_drop'] = bool(int8['accuracy_drop'] <= int8_max_drop)
    if not int8['within_max_drop']:
      drop = 100 * int8['accuracy_drop']
      int8['warning'] = (f'the int8 TFLite model\'s eval accuracy is {drop:.2f} points '
                         f'below the float model\'s ({100 * float_accuracy:.2f}% -> '
                         f'{100 * int8["eval_accuracy"]:.2f}% on {len(images)} {split} images), more than '
                         f'export.int8_max_drop={int8_max_drop:g}; {INT8} is kept: check it before '
                         'deploying it, or deploy model_fp16.tflite')
      logging.warning('export: %s', int8['warning'])
  return models, float_logits


MAX_EVAL_IMAGES = 10_000  # the quantized models are scored on up to this many eval images (memory)


def eval_data(config, class_names: list[str]) -> dict[str, Any]:
  """What the quantized models need from the run's data, through its own pipeline: calibration images
  (train), eval images with their labels, and the split sizes the model card gives."""
  from flaxtpu.data import loaders, pipeline  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings.errors import UserError  # pylint: disable=g-import-not-at-top
  try:
    dataset = pipeline.load(config, need_train=True, class_names=class_names)
    representative = np.stack(loaders.train_sample(dataset, config.export.calibration_images))
    calibration_split = config.dataset.train_split
  except UserError as e:  # a run exported where only its eval data is: calibrate on that
    logging.warning('export: the int8 TFLite model is calibrated on eval images: the train split %r cannot '
                    'be read (%s)', config.dataset.train_split, str(e).splitlines()[0][:200])
    dataset = pipeline.load(config, need_train=False, class_names=class_names)
    count = min(len(dataset.eval), config.export.calibration_images)
    representative = np.stack(loaders.split_images(
        dataset, dataset.eval, np.linspace(0, len(dataset.eval) - 1, count).astype(int)))
    calibration_split = config.dataset.eval_split
  images, labels, count = [], [], 0
  for batch in loaders.eval_batches(dataset, batch_size=RUN_BATCH):
    images.append(batch.images[batch.mask])
    labels.append(batch.labels[batch.mask])
    count += int(batch.mask.sum())
    if count >= MAX_EVAL_IMAGES:
      break
  return {'representative': representative, 'images': np.concatenate(images)[:MAX_EVAL_IMAGES],
          'labels': np.concatenate(labels)[:MAX_EVAL_IMAGES], 'multilabel': dataset.multilabel,
          'train_images': None if dataset.train is None else len(dataset.train),
          'eval_images': len(dataset.eval), 'calibration_split': calibration_split}
