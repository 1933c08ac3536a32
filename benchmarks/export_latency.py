"""Batch-64 predict latency: the exported SavedModel (and TFLite model) vs flaxtpu's jitted predict.

    python -m benchmarks.export_latency                                   # trains the embedded digits CNN
    python -m benchmarks.export_latency --config configs/cifar10_resnet.py --data /path/to/cifar10
    python -m benchmarks.export_latency --config configs/cifar10.py --workdir runs/cifar10   # a trained run

Without --workdir, trains --steps steps in a temporary directory (latency does
not depend on the weights). Exports the run when it has no WORKDIR/export yet,
then times, interleaved, --repeats calls of each on the same batch of uint8
images (host in, host out): flaxtpu's `modes.predict.predict_logits` (jit on one
CPU device, as --mode=predict uses), the SavedModel's serving_default in
TensorFlow, and the TFLite model in TFLite's interpreter. Prints the medians
and the ratio SavedModel / flaxtpu; writes JSON to --out-dir.
"""

import argparse
import json
import os
import tempfile
import time
import warnings

from benchmarks import harness


def _config(path: str, data: str, steps: int, eval_images: int):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('benchmark_config', harness.ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  if data:
    config.dataset.folder = data
    config.dataset.train_split, config.dataset.eval_split = 'train[:512]', f'test[:{eval_images}]'
  config.num_train_steps = steps
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = steps
  config.cpu_devices = 1
  config.compilation_cache_dir = 'none'
  return config


def measure(config, workdir: str, *, batch_size: int = 64, repeats: int = 50) -> dict:
  """Median milliseconds per batch of `batch_size` for flaxtpu predict, the SavedModel and TFLite."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import loaders, pipeline  # pylint: disable=g-import-not-at-top
  from flaxtpu.exporters import export  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import predict, restore  # pylint: disable=g-import-not-at-top

  directory = os.path.join(workdir, export.EXPORT_DIR)
  if not os.path.isfile(os.path.join(directory, 'export.json')):
    export.export_checkpoint(config, workdir)
  with open(os.path.join(directory, 'export.json'), encoding='utf-8') as f:
    summary = json.load(f)
  placement, state, step, record = restore.restore(config, workdir)
  images = np.random.default_rng(0).integers(0, 256, (batch_size, *record['image_shape']), dtype=np.uint8)
  serve = tf.saved_model.load(os.path.join(directory, 'saved_model')).signatures['serving_default']
  runners = {
      'flaxtpu_predict': lambda: predict.predict_logits(placement, state, images, batch_size),
      'saved_model_tf': lambda: serve(images=tf.constant(images))['logits'].numpy(),
  }
  if summary['tflite']:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      interpreter = tf.lite.Interpreter(model_path=os.path.join(directory, summary['tflite']))
    tflite = interpreter.get_signature_runner('serving_default')
    runners['tflite'] = lambda: tflite(images=images)['logits']
  # Agreement on real images: the first eval images, through each model, against predict.
  dataset = pipeline.load(config, need_train=False)
  eval_images = next(loaders.eval_batches(dataset, batch_size=len(dataset.eval))).images
  reference = predict.predict_logits(placement, state, eval_images, batch_size)
  max_diff = {'saved_model_tf': float(np.max(np.abs(
      serve(images=tf.constant(eval_images))['logits'].numpy() - reference)))}
  if 'tflite' in runners:  # its own interpreter: the signature runner resizes to the whole batch
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      whole = tf.lite.Interpreter(model_path=os.path.join(directory, summary['tflite']))
    logits = whole.get_signature_runner('serving_default')(images=eval_images)['logits']
    max_diff['tflite'] = float(np.max(np.abs(logits - reference)))
  times = {name: [] for name in runners}
  for name, run in runners.items():  # compile / trace / allocate outside the timings
    for _ in range(3):
      run()
  for _ in range(repeats):  # interleaved, so a noisy neighbour slows all of them alike
    for name, run in runners.items():
      started = time.perf_counter()
      run()
      times[name].append((time.perf_counter() - started) * 1000)
  medians = {name: harness.median(values) for name, values in times.items()}
  return {'model': record['model'], 'dtype': config.dtype, 'image_shape': record['image_shape'],
          'step': step, 'batch_size': batch_size, 'repeats': repeats, 'median_ms': medians,
          'agreement_images': len(eval_images), 'max_abs_logit_diff_vs_predict': max_diff,
          'saved_model_over_flaxtpu': medians['saved_model_tf'] / medians['flaxtpu_predict'],
          'tflite_over_flaxtpu': (medians['tflite'] / medians['flaxtpu_predict']
                                  if 'tflite' in medians else None)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/digits.py')
  parser.add_argument('--workdir', default='', help='a trained run (default: train --steps in a temp dir)')
  parser.add_argument('--data', default='', help='dataset.folder for the config (e.g. a CIFAR-10 folder)')
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--batch-size', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=50)
  parser.add_argument('--eval-images', type=int, default=1000,
                      help='with --data: the first N test images the models must agree on')
  parser.add_argument('--out-dir', default=harness.RESULTS)
  args = parser.parse_args()
  harness.cpu_devices(1)  # as --mode=predict uses (latency-bound)
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import jax  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from flaxtpu.loop import train  # pylint: disable=g-import-not-at-top

  config = _config(args.config, args.data, args.steps, args.eval_images)
  with tempfile.TemporaryDirectory() as tmp:
    workdir = args.workdir or os.path.join(tmp, 'run')
    if not args.workdir:
      train.train_and_evaluate(config, workdir)
    result = measure(config, workdir, batch_size=args.batch_size, repeats=args.repeats)
  result.update(config=args.config, jax=jax.__version__, tensorflow=tf.__version__,
                devices=str(jax.devices()), cpu_count=os.cpu_count())
  medians = result['median_ms']
  print(f'max |logit difference| against flaxtpu predict on {result["agreement_images"]} eval images: '
        + '  '.join(f'{k} {v:.2e}' for k, v in result['max_abs_logit_diff_vs_predict'].items()))
  print(f'predict latency, {result["model"]} {result["image_shape"]}, batch {args.batch_size} '
        f'(median of {args.repeats}, ms): ' + '  '.join(f'{k} {v:.2f}' for k, v in medians.items()))
  print(f'SavedModel (TF) / flaxtpu predict = {result["saved_model_over_flaxtpu"]:.2f}x'
        + (f'; TFLite / flaxtpu = {result["tflite_over_flaxtpu"]:.2f}x' if result['tflite_over_flaxtpu']
           else ''))
  harness.write_results(os.path.join(args.out_dir, 'export_latency.json'), result)


if __name__ == '__main__':
  main()
