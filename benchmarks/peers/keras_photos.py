"""The Keras "Image classification" tutorial recipe on a photo folder, as flaxtpu's reference.

tensorflow.org/tutorials/images/classification, as written there:
`keras.utils.image_dataset_from_directory(image_size=(180, 180),
batch_size=32)`, `.cache().shuffle(1000).prefetch(AUTOTUNE)`, and
`Sequential([RandomFlip('horizontal'), RandomRotation(0.1), RandomZoom(0.1),
Rescaling(1/255), Conv2D(16, 3, padding='same', relu), MaxPooling2D(),
Conv2D(32, ...), MaxPooling2D(), Conv2D(64, ...), MaxPooling2D(),
Dropout(0.2), Flatten(), Dense(128, relu), Dense(num_classes)])` trained with
Adam and SparseCategoricalCrossentropy(from_logits=True) for 15 epochs
(Keras 3, TensorFlow backend, CPU only). Records the final and per-epoch
validation accuracy, wall time (total, including listing and decoding the
images) and images/s.

Two ways to get the validation images:

- `--split-folder DIR` (for the side-by-side with flaxtpu): train on all of
  DIR/train/<class>/ (shuffled), validate on DIR/test/<class>/, the same
  files flaxtpu evaluates on with `--config.dataset.folder=DIR`.
- `--folder DIR` (the tutorial exactly): one folder of classes, split by
  `validation_split=0.2, seed=123`; Keras picks that 20%, so flaxtpu can't
  evaluate on the same images.

The photo folders come from `python -m benchmarks.data.make_photo_folder` (OUT_split and OUT).

    python -m benchmarks.peers.keras_photos --split-folder /tmp/photos_split              # 15 epochs
    python -m benchmarks.peers.keras_photos --folder /tmp/photos                          # tutorial split
    python -m benchmarks.peers.keras_photos --split-folder /tmp/photos_split --seed 0 1 2 # median of 3
    # -> benchmarks/results/keras_photos.json
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

# This is the TensorFlow-backend recipe (tf.data pipeline), whatever the
# environment says; and TensorFlow must not grab an accelerator JAX may want.
os.environ['KERAS_BACKEND'] = 'tensorflow'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.shared import harness  # noqa: E402

tf.config.set_visible_devices([], 'GPU')

IMAGE_SIZE = (180, 180)  # the tutorial's img_height, img_width
BATCH_SIZE = 32
SPLIT_SEED = 123  # the tutorial's seed for validation_split and file shuffling
SHUFFLE_BUFFER = 1000  # the tutorial's .shuffle(1000), applied to batches (the datasets come batched)


def load_datasets(folder: pathlib.Path | None, split_folder: pathlib.Path | None):
  """(train, validation, class_names, sizes): the tutorial's datasets, cached, shuffled, prefetched."""
  common = dict(image_size=IMAGE_SIZE, batch_size=BATCH_SIZE, verbose=False)
  if split_folder is not None:
    train = keras.utils.image_dataset_from_directory(split_folder / 'train', shuffle=True, seed=SPLIT_SEED,
                                                     **common)
    validation = keras.utils.image_dataset_from_directory(split_folder / 'test', shuffle=False, **common)
    if train.class_names != validation.class_names:
      raise ValueError(f'{split_folder}: train/ has classes {train.class_names}, '
                       f'test/ has {validation.class_names}')
  else:
    train, validation = (
        keras.utils.image_dataset_from_directory(folder, validation_split=0.2, subset=subset, seed=SPLIT_SEED,
                                                 **common)
        for subset in ('training', 'validation'))
  class_names = train.class_names
  sizes = {'train': len(train.file_paths), 'validation': len(validation.file_paths)}
  autotune = tf.data.AUTOTUNE
  train = train.cache().shuffle(SHUFFLE_BUFFER).prefetch(buffer_size=autotune)
  validation = validation.cache().prefetch(buffer_size=autotune)
  return train, validation, class_names, sizes


def tutorial_model(num_classes: int) -> keras.Model:
  layers = keras.layers
  data_augmentation = keras.Sequential([
      layers.RandomFlip('horizontal'),
      layers.RandomRotation(0.1),
      layers.RandomZoom(0.1),
  ], name='data_augmentation')
  return keras.Sequential([
      keras.Input((*IMAGE_SIZE, 3)),
      data_augmentation,
      layers.Rescaling(1. / 255),
      layers.Conv2D(16, 3, padding='same', activation='relu'),
      layers.MaxPooling2D(),
      layers.Conv2D(32, 3, padding='same', activation='relu'),
      layers.MaxPooling2D(),
      layers.Conv2D(64, 3, padding='same', activation='relu'),
      layers.MaxPooling2D(),
      layers.Dropout(0.2),
      layers.Flatten(),
      layers.Dense(128, activation='relu'),
      layers.Dense(num_classes, name='outputs'),
  ])


class EpochTimer(keras.callbacks.Callback):
  """Seconds per epoch, split into training (to the first validation batch) and validation."""

  def __init__(self):
    super().__init__()
    self.train_s, self.validation_s = [], []
    self._start = self._test_start = None

  def on_epoch_begin(self, epoch, logs=None):
    self._start = self._test_start = time.perf_counter()

  def on_test_begin(self, logs=None):
    self._test_start = time.perf_counter()

  def on_epoch_end(self, epoch, logs=None):
    end = time.perf_counter()
    if self._test_start == self._start:  # no validation pass seen
      self._test_start = end
    self.train_s.append(self._test_start - self._start)
    self.validation_s.append(end - self._test_start)


def run_seed(folder: pathlib.Path | None, split_folder: pathlib.Path | None, seed: int, epochs: int) -> dict:
  """Lists, decodes and trains from scratch; everything after the seed is inside `wall_time_s`."""
  keras.utils.set_random_seed(seed)  # weights, augmentation, dropout, the shuffle buffer
  with harness.cpu_load() as load:
    start = time.perf_counter()
    train, validation, class_names, sizes = load_datasets(folder, split_folder)
    model = tutorial_model(len(class_names))
    model.compile(optimizer='adam', loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=['accuracy'])
    timer = EpochTimer()
    fit_start = time.perf_counter()
    history = model.fit(train, validation_data=validation, epochs=epochs, verbose=2,
                        callbacks=[timer], shuffle=False)  # the dataset shuffles itself; silences a warning
    fit_s = time.perf_counter() - fit_start
    wall_s = time.perf_counter() - start

  trained = sizes['train'] * epochs
  later_epochs = timer.train_s[1:] or timer.train_s  # epoch 1 also decodes and caches the images
  result = {
      'seed': seed, 'classes': list(class_names), 'num_train': sizes['train'],
      'num_validation': sizes['validation'], 'num_params': model.count_params(),
      'final_val_accuracy': float(history.history['val_accuracy'][-1]),
      'final_val_loss': float(history.history['val_loss'][-1]),
      'val_accuracy': [float(a) for a in history.history['val_accuracy']],
      'train_accuracy': [float(a) for a in history.history['accuracy']],
      'wall_time_s': wall_s, 'fit_time_s': fit_s, 'setup_time_s': fit_start - start,
      'epoch_train_s': timer.train_s, 'epoch_validation_s': timer.validation_s,
      # Training images per second of wall time, listing/decoding/validation included: the user's view.
      'images_per_s': trained / wall_s,
      # Training images per second in the epochs after the first (images cached, validation excluded).
      'train_images_per_s': sizes['train'] / harness.median(later_epochs),
      'other_cpu_load': load['other_cpu_load'],
  }
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog='\n'.join(__doc__.splitlines()[2:]))
  where = parser.add_mutually_exclusive_group(required=True)
  where.add_argument('--split-folder', type=pathlib.Path,
                     help='train/<class>/ and test/<class>/ (validate on test/: the side-by-side mode)')
  where.add_argument('--folder', type=pathlib.Path,
                     help="one folder of classes, split by the tutorial's validation_split=0.2, seed=123")
  parser.add_argument('--epochs', type=int, default=15)
  parser.add_argument('--seed', '--seeds', dest='seeds', type=int, nargs='+', default=[0],
                      help='seed(s) for weights, augmentation, dropout and shuffling; several -> medians')
  harness.out_argument(parser, 'keras_photos.json')
  args = parser.parse_args()
  if args.split_folder is not None:
    for split in ('train', 'test'):
      if not (args.split_folder / split).is_dir():
        parser.error(f'--split-folder {args.split_folder} needs train/ and test/ folders '
                     '(python -m benchmarks.data.make_photo_folder writes OUT_split)')
  elif not args.folder.is_dir():
    parser.error(f'--folder {args.folder} is not a directory')

  start = time.perf_counter()
  runs = []
  for seed in args.seeds:
    run = run_seed(args.folder, args.split_folder, seed, args.epochs)
    print(f'seed {seed}: val_accuracy={run["final_val_accuracy"]:.4f} ({run["num_validation"]} images) '
          f'wall_time={run["wall_time_s"]:.1f}s images/s={run["images_per_s"]:.1f} '
          f'(train-only {run["train_images_per_s"]:.1f}) other_cpu_load={run.get("other_cpu_load", -1):.2f}',
          flush=True)
    runs.append(run)
  wall_time = time.perf_counter() - start

  mode = 'split_folder' if args.split_folder is not None else 'validation_split'
  result = {
      'pipeline': ("Keras image-classification tutorial: image_dataset_from_directory 180x180 batch 32, "
                   "cache/shuffle(1000)/prefetch, flip/rotate/zoom augmentation, 3x conv+pool, dropout 0.2, "
                   "dense 128, Adam, 15 epochs by default; TensorFlow backend, CPU"),
      'mode': mode,
      'data': str((args.split_folder or args.folder).resolve()),
      'validation': ('test/ of the split folder' if mode == 'split_folder'
                     else f'validation_split=0.2, seed={SPLIT_SEED}'),
      'epochs': args.epochs, 'batch_size': BATCH_SIZE, 'image_size': list(IMAGE_SIZE), 'seeds': args.seeds,
      'median_final_val_accuracy': harness.median(runs, 'final_val_accuracy'),
      'median_wall_time_s': harness.median(runs, 'wall_time_s'),
      'median_images_per_s': harness.median(runs, 'images_per_s'),
      'median_train_images_per_s': harness.median(runs, 'train_images_per_s'),
      'total_wall_time_s': wall_time,
      'versions': {'keras': keras.__version__, 'tensorflow': tf.__version__},
      'cpu_count': os.cpu_count(), 'runs': runs,
  }
  print(f'median over seeds {args.seeds}: val_accuracy={result["median_final_val_accuracy"]:.4f} '
        f'wall_time={result["median_wall_time_s"]:.1f}s images/s={result["median_images_per_s"]:.1f}')
  harness.write_results(args.out, result)


if __name__ == '__main__':
  main()
