"""The classic Keras pipeline that flaxtpu is the JAX twin of, as a reference.

Trains the Keras CNN (20,042 parameters) on a CIFAR-10 image folder with the
TensorFlow backend, Adam(1e-3), batch 128, inputs / 255, no augmentation, and
reports test accuracy/loss per seed plus the median, so flaxtpu's
`configs/cifar10.py` can be compared against a number measured on the same
machine and the same data.

    python -m benchmarks.peers.keras_reference --seeds 0 1 2 --epochs 5
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

# Keras picks its backend at import time, and TensorFlow must not grab any
# accelerator that JAX may want later in the same machine.
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.shared import harness, peers  # noqa: E402  (peers: the CNN's one definition; it imports no Keras)

tf.config.set_visible_devices([], 'GPU')

IMAGE_SIZE = peers.IMAGE_SHAPE[:2]  # what the CNN takes
BATCH_SIZE = 128


def load_split(data_dir: pathlib.Path, split: str, seed: int, shuffle: bool) -> tf.data.Dataset:
  """Decodes `data_dir/split/<class>/*.jpg` into batches of (x / 255, label).

  Decoded images are cached in memory (the 50,000 CIFAR-10 training images are ~150 MB as uint8) so that
  epochs after the first measure training, not JPEG decoding. Shuffling
  happens after the cache so each epoch sees a new order.
  """
  dataset = keras.utils.image_dataset_from_directory(
      data_dir / split, labels='inferred', label_mode='int', image_size=IMAGE_SIZE,
      batch_size=None,  # batch after shuffling, not before
      shuffle=False, verbose=False)
  dataset = dataset.map(lambda x, y: (tf.cast(x, tf.uint8), y), num_parallel_calls=tf.data.AUTOTUNE).cache()
  if shuffle:
    dataset = dataset.shuffle(50_000, seed=seed, reshuffle_each_iteration=True)
  dataset = dataset.batch(BATCH_SIZE).map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y),
                                          num_parallel_calls=tf.data.AUTOTUNE)
  return dataset.prefetch(tf.data.AUTOTUNE)


def run_seed(data_dir: pathlib.Path, seed: int, epochs: int) -> dict:
  """Trains one model from scratch and evaluates it on the test split."""
  keras.utils.set_random_seed(seed)
  train = load_split(data_dir, 'train', seed, shuffle=True)
  test = load_split(data_dir, 'test', seed, shuffle=False)
  model = peers.keras_cnn(keras)
  model.compile(optimizer=keras.optimizers.Adam(1e-3), loss='sparse_categorical_crossentropy',
                metrics=['accuracy'])
  start = time.perf_counter()
  # shuffle=False: the dataset already reshuffles itself every epoch.
  history = model.fit(train, epochs=epochs, verbose=2, shuffle=False)
  train_time = time.perf_counter() - start
  test_loss, test_accuracy = model.evaluate(test, verbose=0)
  return {'seed': seed, 'test_accuracy': float(test_accuracy), 'test_loss': float(test_loss),
          'train_accuracy': float(history.history['accuracy'][-1]),
          'train_loss': float(history.history['loss'][-1]), 'train_time_s': train_time,
          'wall_time_s': time.perf_counter() - start, 'num_params': model.count_params()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data', type=pathlib.Path,
                      default=pathlib.Path(os.environ.get('FLAXTPU_CIFAR10', '')),
                      help='CIFAR-10 image-folder root with train/ and test/ (default: $FLAXTPU_CIFAR10)')
  parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
  parser.add_argument('--epochs', type=int, default=5)
  harness.out_argument(parser, 'keras_reference.json')
  args = parser.parse_args()
  if not (args.data / 'train').is_dir() or not (args.data / 'test').is_dir():
    parser.error(f'--data {args.data} needs train/ and test/ folders: '
                 'pass --data DIR or set FLAXTPU_CIFAR10=DIR')

  start = time.perf_counter()
  runs = []
  for seed in args.seeds:
    run = run_seed(args.data, seed, args.epochs)
    print(f'seed {seed}: test_accuracy={run["test_accuracy"]:.4f} test_loss={run["test_loss"]:.4f} '
          f'train_time={run["train_time_s"]:.1f}s', flush=True)
    runs.append(run)
  wall_time = time.perf_counter() - start

  result = {
      'pipeline': 'keras Sequential CNN, Adam(1e-3), batch 128, x/255, no augmentation, TensorFlow backend',
      'data': str(args.data.resolve()), 'epochs': args.epochs, 'batch_size': BATCH_SIZE,
      'median_test_accuracy': harness.median(runs, 'test_accuracy'),
      'median_test_loss': harness.median(runs, 'test_loss'), 'wall_time_s': wall_time,
      'versions': {'keras': keras.__version__, 'tensorflow': tf.__version__},
      'cpu_count': os.cpu_count(), 'runs': runs,
  }
  print(f'median over seeds {args.seeds}: test_accuracy={result["median_test_accuracy"]:.4f} '
        f'test_loss={result["median_test_loss"]:.4f} wall_time={wall_time:.1f}s')
  harness.write_results(args.out, result)


if __name__ == '__main__':
  main()
