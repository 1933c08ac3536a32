"""The inference table: every export of a trained model against flaxtpu's predict and Keras, batch 1 and 64.

    FLAXTPU_CIFAR10=/path/to/cifar10 python -m benchmarks.device.inference  # CIFAR-10 (else the digits)
    python -m benchmarks.device.inference --models cnn --steps 100 --rounds 3  # quicker
    python -m benchmarks.device.inference --workdir-root runs/inference  # keep (and reuse) the trained runs

Trains the Keras CNN (configs/cifar10.py) and ResNet-20 (configs/cifar10_resnet.py) briefly (--steps on
the first --train-images train images), exports each (--mode=export: SavedModel, TFLite float32 / fp16 /
int8, and ONNX when the export writes model.onnx), then times, on one CPU device, host uint8 images in
and logits out, the same real eval images through:

  flaxtpu_predict   modes.predict.predict_logits, jitted (what --mode=predict runs)
  saved_model_tf    the SavedModel's serving_default in plain TensorFlow
  tflite_float32 / tflite_fp16 / tflite_int8   the TFLite models in TFLite's interpreter (XNNPACK)
  onnxruntime       export/model.onnx in onnxruntime ("no model.onnx" while the export writes none)
  keras_jit         the Keras twin of the same architecture (benchmarks/shared/peers.py, random weights: the
                    time does not depend on them): `model.predict_step` in tf.function(jit_compile=True)

Each round times --calls calls of each runner in turn (interleaved, so a noisy neighbour slows all of them
alike); the table gives the median over --rounds rounds of ms per batch, and images/s from it. Writes
JSON to --out-dir and the Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any, Callable

from benchmarks.shared import harness

MODELS = {'cnn': 'configs/cifar10.py', 'resnet20': 'configs/cifar10_resnet.py'}
RUNNERS = ('flaxtpu_predict', 'saved_model_tf', 'tflite_float32', 'tflite_fp16', 'tflite_int8', 'onnxruntime',
           'keras_jit')


def _config(model: str, data: str, steps: int, train_images: int):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('benchmark_config', harness.ROOT / MODELS[model])
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  if data:
    config.dataset.folder = data
    config.dataset.train_split = f'train[:{train_images}]'
  else:  # the embedded digits: 8x8 grayscale, no download
    config.dataset.name = 'digits'
  config.num_train_steps = steps
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = steps
  config.cpu_devices = 1
  config.compilation_cache_dir = 'none'
  return config


def _trained(model: str, args, steps: int, root: str):
  """(config, workdir) of a trained and exported run, reused when `root` holds one."""
  from flaxtpu.exporters import export  # pylint: disable=g-import-not-at-top
  from flaxtpu.loop import train  # pylint: disable=g-import-not-at-top
  config = _config(model, args.data, steps, args.train_images)
  workdir = os.path.join(root, model)
  if not os.path.isfile(os.path.join(workdir, 'results.json')):
    train.train_and_evaluate(config, workdir)
  if not os.path.isfile(os.path.join(workdir, 'export', 'export.json')):
    export.export_checkpoint(config, workdir)
  return config, workdir


def _keras_predict(model: str, image_shape: tuple[int, ...], num_classes: int) -> Callable:
  """The Keras twin's predict_step under jit_compile=True, uint8 in (x / 255 inside, as the seed)."""
  from benchmarks.shared import peers  # pylint: disable=g-import-not-at-top
  keras = peers.import_keras('tensorflow')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  if tuple(image_shape) == peers.IMAGE_SHAPE and num_classes == peers.NUM_CLASSES:
    net = peers.build_keras_model(keras, model)
  else:  # the digits: the same layers at their size
    original = peers.IMAGE_SHAPE, peers.NUM_CLASSES
    peers.IMAGE_SHAPE, peers.NUM_CLASSES = tuple(image_shape), num_classes
    try:
      net = peers.build_keras_model(keras, model)
    finally:
      peers.IMAGE_SHAPE, peers.NUM_CLASSES = original
  step = tf.function(lambda x: net.predict_step(tf.cast(x, tf.float32) / 255.0), jit_compile=True)
  return lambda images: step(tf.constant(images)).numpy()


def runners(config, workdir: str, model: str, batch: 'np.ndarray') -> dict[str, Any]:  # noqa: F821
  """name -> a call that runs one batch (host in, host out), or a string saying why there is none."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from flaxtpu.exporters import tflite_export  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import predict, restore  # pylint: disable=g-import-not-at-top
  directory = os.path.join(workdir, 'export')
  with open(os.path.join(directory, 'export.json'), encoding='utf-8') as f:
    summary = json.load(f)
  placement, state, _, record = restore.restore(config, workdir)
  serve = tf.saved_model.load(os.path.join(directory, 'saved_model')).signatures['serving_default']
  found: dict[str, Any] = {
      'flaxtpu_predict': lambda: predict.predict_logits(placement, state, batch, len(batch)),
      'saved_model_tf': lambda: serve(images=tf.constant(batch))['logits'].numpy(),
  }
  for kind, name in (('float32', tflite_export.FLOAT), ('fp16', tflite_export.FP16),
                     ('int8', tflite_export.INT8)):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      run = tflite_export.tflite_runner(path)  # one interpreter per batch size: no re-allocation per call
      found[f'tflite_{kind}'] = lambda run=run: run(batch)
    else:
      found[f'tflite_{kind}'] = f'no {name}'
  onnx_path = os.path.join(directory, 'model.onnx')
  if os.path.isfile(onnx_path):
    import onnxruntime  # pylint: disable=g-import-not-at-top
    session = onnxruntime.InferenceSession(onnx_path, providers=['CPUExecutionProvider'])
    found['onnxruntime'] = lambda: session.run(['logits'], {'images': batch})[0]
  else:
    found['onnxruntime'] = 'no model.onnx'
  keras = _keras_predict(model, tuple(record['image_shape']), int(record['num_classes']))
  found['keras_jit'] = lambda: keras(batch)
  reference = np.asarray(found['flaxtpu_predict']())
  for name, run in found.items():  # each export gives predict's classes (Keras: another model)
    if callable(run) and name != 'keras_jit':
      agreement = float(np.mean(np.asarray(run()).argmax(-1) == reference.argmax(-1)))
      if agreement < 0.9 and name != 'tflite_int8':
        raise RuntimeError(f'{name} agrees with flaxtpu predict on only {agreement:.0%} of the batch')
  return {'runners': found, 'summary': summary}


def measure(found: dict[str, Any], rounds: int, calls: int) -> dict[str, Any]:
  """Median ms per batch over interleaved rounds of `calls` calls each."""
  live = {name: run for name, run in found.items() if callable(run)}
  for run in live.values():  # compile, trace, allocate outside the timings
    for _ in range(3):
      run()
  per_round = {name: [] for name in live}
  for _ in range(rounds):
    for name, run in live.items():
      started = time.perf_counter()
      for _ in range(calls):
        run()
      per_round[name].append(1000 * (time.perf_counter() - started) / calls)
  return {name: {'ms_per_batch': harness.median(values), 'rounds_ms': values}
          for name, values in per_round.items()}


def table(results: list[dict]) -> str:
  lines = ['| model | runner | batch 1: ms | batch 1: img/s | batch 64: ms | batch 64: img/s '
           '| ms / flaxtpu\'s (64) |',
           '| --- | --- | --- | --- | --- | --- | --- |']
  for result in results:
    timed = result['timings']
    for name in RUNNERS:
      cells = []
      for batch in ('1', '64'):
        row = timed.get(batch, {}).get(name)
        if isinstance(row, dict):
          cells += [f'{row["ms_per_batch"]:.2f}', f'{int(batch) / row["ms_per_batch"] * 1000:,.0f}']
        else:
          cells += [result['missing'].get(name, '-'), '']
      base, row = timed.get('64', {}).get('flaxtpu_predict'), timed.get('64', {}).get(name)
      ratio = (f'{row["ms_per_batch"] / base["ms_per_batch"]:.2f}x' if isinstance(row, dict) and base else '')
      lines.append(f'| {result["model"]} | {name} | ' + ' | '.join(cells) + f' | {ratio} |')
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data', default=os.environ.get('FLAXTPU_CIFAR10', ''),
                      help='CIFAR-10 image folder (default: $FLAXTPU_CIFAR10; empty: the embedded digits)')
  parser.add_argument('--models', nargs='+', default=list(MODELS), choices=list(MODELS))
  parser.add_argument('--steps', type=int, nargs='+', default=[300],
                      help='training steps (batch 128): one for all models, or one per model in order')
  parser.add_argument('--train-images', type=int, default=20_000,
                      help='with --data: the first N train images')
  parser.add_argument('--batch-sizes', type=int, nargs='+', default=[1, 64])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--calls', type=int, default=0,
                      help='calls per round (default: 50 at batch 1, 10 at 64)')
  parser.add_argument('--workdir-root', default='', help='keep the trained runs here (reused when present)')
  parser.add_argument('--quantized-eval-images', type=int, default=0,
                      help='score the TFLite models of the export on the first N eval images (default: '
                           "the export's own limit)")
  harness.out_argument(parser, 'inference.json')
  args = parser.parse_args()
  harness.cpu_devices(1)  # as --mode=predict uses on CPU (latency-bound)
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import loaders, pipeline  # pylint: disable=g-import-not-at-top
  from flaxtpu.exporters import tflite_export  # pylint: disable=g-import-not-at-top
  if args.quantized_eval_images:
    tflite_export.MAX_EVAL_IMAGES = args.quantized_eval_images
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    root = args.workdir_root or tmp
    for index, model in enumerate(args.models):
      config, workdir = _trained(model, args, args.steps[min(index, len(args.steps) - 1)], root)
      dataset = pipeline.load(config, need_train=False)
      eval_images = next(loaders.eval_batches(dataset, batch_size=max(args.batch_sizes))).images
      result: dict[str, Any] = {'model': model, 'workdir': workdir, 'timings': {}, 'missing': {}}
      for batch_size in args.batch_sizes:
        batch = np.ascontiguousarray(eval_images[:batch_size])
        found = runners(config, workdir, model, batch)
        result['missing'].update({k: v for k, v in found['runners'].items() if isinstance(v, str)})
        calls = args.calls or (50 if batch_size == 1 else 10)
        result['timings'][str(batch_size)] = measure(found['runners'], args.rounds, calls)
        result['export'] = {k: found['summary'].get(k) for k in ('step', 'tflite_models', 'check', 'data')}
      results.append(result)
      harness.write_results(args.out, {'results': results, 'partial': True})  # a model's numbers kept early
  payload = {'results': results, 'rounds': args.rounds, 'data': args.data or 'digits', 'steps': args.steps,
             'jax': jax.__version__, 'tensorflow': tf.__version__, 'devices': str(jax.devices()),
             'cpu_count': os.cpu_count()}
  print(table(results))
  for result in results:
    models = result['export']['tflite_models'] or {}
    print(f'{result["model"]}: ' + '; '.join(
        f'{kind} {models[kind]["bytes"]:,} B, eval accuracy {100 * models[kind]["eval_accuracy"]:.2f}%, '
        f'top-1 agreement {100 * models[kind]["top1_agreement_with_float"]:.2f}%'
        for kind in ('float32', 'fp16', 'int8') if (models.get(kind) or {}).get('file')))
  harness.write_results(args.out, payload)


if __name__ == '__main__':
  main()
