"""Keras 3 (JAX backend) peer of flaxtpu's `configs/cifar10_resnet.py`: He et al.'s CIFAR ResNets.

Same network as flaxtpu's resnet20/32/44/56/110 (CIFAR stem; 3 stages of (depth - 2) / 6 BasicBlocks,
widths 16/32/64; PyTorch-style symmetric padding; projection shortcuts where the shape changes; the
last BN of each block starts with gamma = 0; BN momentum 0.9, eps 1e-5; lecun_normal kernels) and the
same recipe: batch 128 (last partial batch dropped), SGD 0.1 with optax-style Nesterov momentum 0.9,
L2 5e-4 on kernels added to the gradient, 1 epoch linear warmup from 0 then cosine to 0 (per step),
label smoothing 0.1, zero-pad-4 random crop + flip (uint8, on the host, every epoch), per-channel
standardisation with the train split's mean and std (inside the model, on the device). The train loss
it prints includes the L2 penalty (Keras adds kernel regularisers to the loss); accuracies do not.

    python -m benchmarks.peers.keras_cifar_resnet --data /path/to/cifar10 --depth 20 --epochs 182 \
        --out keras_resnet20.json

With `--state DIR` a run longer than one sitting resumes: every `--save-every` epochs, and after the
epoch in which a SIGTERM arrives (then it exits 0), the model with its optimizer (`model.keras`) and the
run's clocks and history (`state.json`) are saved in DIR; the same command continues from there. Each
epoch's augmentation draws from (seed, epoch), so a resumed run trains on the batches an uninterrupted
one would; its wall times add the attempts (the epochs since the last save are trained again).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import pathlib
import signal
import sys
import time

os.environ['KERAS_BACKEND'] = 'jax'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers, ops  # noqa: E402
from PIL import Image  # noqa: E402

if 'tensorflow' in sys.modules:  # never let TensorFlow take accelerator memory from JAX
  import tensorflow as tf
  for kind in ('GPU', 'TPU'):
    try:
      tf.config.set_visible_devices([], kind)
    except (RuntimeError, ValueError):
      pass

NUM_CLASSES, PAD = 10, 4
WEIGHT_DECAY = 5e-4  # flaxtpu's optimizer.weight_decay: L2(5e-4 / 2) has the gradient 5e-4 w


def load_split(root: pathlib.Path, split: str, limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """`root/split/<class>/*.jpg` (classes sorted by name) -> uint8 [N, 32, 32, 3] images, int32 labels."""
  classes = sorted(path.name for path in (root / split).iterdir() if path.is_dir())
  files = [(path, label) for label, name in enumerate(classes)
           for path in sorted((root / split / name).glob('*.jpg'))]
  if limit:  # a class-balanced-ish subset for smoke tests: every k-th file
    files = files[::max(1, len(files) // limit)][:limit]
  with concurrent.futures.ThreadPoolExecutor(max(4, os.cpu_count() or 1)) as pool:
    images = list(pool.map(lambda item: np.asarray(Image.open(item[0]).convert('RGB')), files))
  return np.stack(images), np.array([label for _, label in files], np.int32)


def augment(rng: np.random.Generator, images: np.ndarray) -> np.ndarray:
  """Zero-pad by PAD, cut a random 32x32 window and mirror half of the images, in one vectorised gather."""
  n, height, width, _ = images.shape
  padded = np.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
  top, left = rng.integers(0, 2 * PAD + 1, (2, n))
  flip = rng.random(n) < 0.5
  rows = top[:, None] + np.arange(height)
  cols = left[:, None] + np.where(flip[:, None], np.arange(width)[::-1], np.arange(width))
  return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


def conv(x, filters: int, kernel: int, stride: int = 1):
  """Bias-free lecun_normal convolution padded kernel // 2 on every side (PyTorch's, flaxtpu's 'torch')."""
  if kernel > 1 and stride > 1:  # Keras' 'same' would pad (0, 1) on even maps, not (1, 1)
    x = layers.ZeroPadding2D(kernel // 2)(x)
  return layers.Conv2D(filters, kernel, stride, padding='same' if stride == 1 else 'valid', use_bias=False,
                       kernel_initializer=keras.initializers.LecunNormal(),
                       kernel_regularizer=keras.regularizers.L2(WEIGHT_DECAY / 2))(x)


def norm(x, zero_gamma: bool = False):
  return layers.BatchNormalization(momentum=0.9, epsilon=1e-5,
                                   gamma_initializer='zeros' if zero_gamma else 'ones')(x)


def resnet(depth: int, mean: np.ndarray, std: np.ndarray) -> keras.Model:
  """CIFAR ResNet-`depth` on uint8 inputs; standardisation is its first layer."""
  assert (depth - 2) % 6 == 0, 'depth must be 6n + 2 (20, 32, 44, 56, 110)'
  inputs = keras.Input((32, 32, 3), dtype='uint8')
  x = layers.Rescaling(1 / 255)(inputs)
  x = layers.Normalization(mean=mean, variance=std**2)(x)
  x = layers.ReLU()(norm(conv(x, 16, 3)))
  for stage, width in enumerate((16, 32, 64)):
    for index in range((depth - 2) // 6):
      stride = 2 if stage > 0 and index == 0 else 1
      y = layers.ReLU()(norm(conv(x, width, 3, stride)))
      y = norm(conv(y, width, 3), zero_gamma=True)
      shortcut = x if x.shape[-1] == width and stride == 1 else norm(conv(x, width, 1, stride))
      x = layers.ReLU()(layers.Add()([shortcut, y]))
  x = layers.GlobalAveragePooling2D()(x)
  outputs = layers.Dense(NUM_CLASSES, kernel_initializer=keras.initializers.LecunNormal(),
                         kernel_regularizer=keras.regularizers.L2(WEIGHT_DECAY / 2))(x)
  return keras.Model(inputs, outputs, name=f'resnet{depth}')


class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
  """optax.warmup_cosine_decay_schedule(0, peak, warmup, total, 0), as flaxtpu builds it."""

  def __init__(self, peak: float, warmup: int, total: int):
    self.peak, self.warmup, self.total = peak, min(max(warmup, 1), total - 1), total

  def __call__(self, step):
    step = ops.cast(step, 'float32')
    progress = ops.clip((step - self.warmup) / max(self.total - self.warmup, 1), 0.0, 1.0)
    cosine = 0.5 * self.peak * (1.0 + ops.cos(math.pi * progress))
    return ops.where(step < self.warmup, self.peak * step / self.warmup, cosine)

  def get_config(self):
    return {'peak': self.peak, 'warmup': self.warmup, 'total': self.total}


class OptaxNesterov(keras.optimizers.SGD):
  """optax.sgd(nesterov=True): the trace holds raw gradients (m = g + mu m), the step is lr (g + mu m);
  Keras' own SGD keeps lr-scaled steps in its momentum, which differs while the rate changes."""

  def update_step(self, gradient, variable, learning_rate):
    lr, g = ops.cast(learning_rate, variable.dtype), ops.cast(gradient, variable.dtype)
    m = self.momentums[self._get_variable_index(variable)]
    self.assign(m, ops.add(g, ops.multiply(m, self.momentum)))
    self.assign_sub(variable, ops.multiply(lr, ops.add(g, ops.multiply(m, self.momentum))))


def save_state(directory: pathlib.Path, model: keras.Model, state: dict) -> None:
  """The model (optimizer included) and the run's record, each written whole then renamed into place."""
  directory.mkdir(parents=True, exist_ok=True)
  model.save(directory / 'model.tmp.keras')
  os.replace(directory / 'model.tmp.keras', directory / 'model.keras')
  (directory / 'state.tmp.json').write_text(json.dumps(state))
  os.replace(directory / 'state.tmp.json', directory / 'state.json')


def load_state(directory: pathlib.Path) -> tuple[keras.Model, dict] | None:
  if not (directory / 'state.json').exists():
    return None
  model = keras.models.load_model(directory / 'model.keras', custom_objects={
      'WarmupCosine': WarmupCosine, 'OptaxNesterov': OptaxNesterov})
  return model, json.loads((directory / 'state.json').read_text())


class FirstStep(keras.callbacks.Callback):
  """Wall time at which the first training step has finished (compilation included)."""
  async_safe = True

  def __init__(self):
    super().__init__()
    self.at = None

  def on_train_batch_end(self, batch, logs=None):
    if self.at is None:
      jax.block_until_ready(logs)
      self.at = time.perf_counter()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data', type=pathlib.Path, required=True,
                      help='image folder: train/<class>/*.jpg, test/<class>/*.jpg')
  parser.add_argument('--depth', type=int, default=20)
  parser.add_argument('--epochs', type=int, default=182)
  parser.add_argument('--batch-size', type=int, default=128)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--steps-per-execution', type=int, default=1,
                      help='steps per jitted call; best a divisor of the steps per epoch (390 for CIFAR-10)')
  parser.add_argument('--eval-every', type=int, default=1, help='epochs between test evaluations')
  parser.add_argument('--limit-train', type=int, default=0, help='train on this many images (smoke tests)')
  parser.add_argument('--out', type=pathlib.Path)
  parser.add_argument('--state', type=pathlib.Path, help='a folder that makes the run resumable (above)')
  parser.add_argument('--save-every', type=int, default=10, help='epochs between saves of --state')
  args = parser.parse_args()
  start = time.perf_counter()
  stop = []  # a SIGTERM: save after this epoch and exit
  if args.state:
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))

  x_train, y_train = load_split(args.data, 'train', args.limit_train)
  x_test, y_test = load_split(args.data, 'test')
  load_s = time.perf_counter() - start
  pixels = x_train.reshape(-1, 3).astype(np.float64) / 255
  mean, std = pixels.mean(0).astype(np.float32), pixels.std(0).astype(np.float32)
  print(f'loaded {len(x_train)} train / {len(x_test)} test images in {load_s:.1f} s; '
        f'{jax.devices()[0].device_kind}, keras {keras.__version__}, jax {jax.__version__}', flush=True)

  tick = time.perf_counter()
  keras.utils.set_random_seed(args.seed)
  steps = len(x_train) // args.batch_size  # the last partial batch is dropped, as flaxtpu does
  saved = load_state(args.state) if args.state else None
  if saved:
    model, state = saved
    print(f'resuming after epoch {len(state["history"])} from {args.state}', flush=True)
  else:
    model = resnet(args.depth, mean, std)
    model.compile(optimizer=OptaxNesterov(WarmupCosine(0.1, steps, steps * args.epochs), momentum=0.9,
                                          nesterov=True),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
                  metrics=[keras.metrics.CategoricalAccuracy(name='acc')], jit_compile=True,
                  steps_per_execution=args.steps_per_execution)
    state = {'history': [], 'fit_s': [], 'eval_s': 0.0, 'train_s': 0.0, 'end_to_end_s': 0.0, 'attempts': 0,
             'time_to_first_step_s': None}
  state['attempts'] += 1
  build_s = time.perf_counter() - tick
  print(f'{model.name}: {model.count_params():,} parameters (BN statistics included), {steps} steps/epoch, '
        f'built in {build_s:.1f} s', flush=True)
  test_labels = np.eye(NUM_CLASSES, dtype=np.float32)[y_test]
  eval_batch = 1000 if len(x_test) % 1000 == 0 else len(x_test)

  first_step, history, fit_s = FirstStep(), state['history'], state['fit_s']
  train_start = time.perf_counter()
  before = {key: state[key] for key in ('train_s', 'end_to_end_s')}  # the attempts before this one

  def epoch_data(epoch: int):  # a new order and new crops/flips; the last partial batch is dropped
    rng = np.random.default_rng([args.seed, epoch])
    order = rng.permutation(len(x_train))[:steps * args.batch_size]
    return augment(rng, x_train[order]), np.eye(NUM_CLASSES, dtype=np.float32)[y_train[order]]

  host = concurrent.futures.ThreadPoolExecutor(1)  # augments epoch e + 1 while epoch e trains
  first = len(history)
  pending = host.submit(epoch_data, first)
  for epoch in range(first, args.epochs):
    images, labels = pending.result()
    if epoch + 1 < args.epochs:
      pending = host.submit(epoch_data, epoch + 1)
    tick = time.perf_counter()
    logs = model.fit(images, labels, batch_size=args.batch_size, epochs=epoch + 1, initial_epoch=epoch,
                     shuffle=False, verbose=0, callbacks=[first_step]).history
    fit_s.append(time.perf_counter() - tick)  # fit returns after its last step's logs are on the host
    test_acc = None
    if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
      tick = time.perf_counter()
      test_acc = model.evaluate(x_test, test_labels, batch_size=eval_batch, verbose=0,
                                return_dict=True)['acc']
      state['eval_s'] += time.perf_counter() - tick
    elapsed = before['train_s'] + time.perf_counter() - train_start
    history.append((epoch + 1, round(elapsed, 3), test_acc))
    shown = '  -   ' if test_acc is None else f'{test_acc:.4f}'
    print(f'epoch {epoch + 1:3d}  loss {logs["loss"][-1]:.4f}  acc {logs["acc"][-1]:.4f}  test {shown}  '
          f'{elapsed:8.1f} s  {steps * args.batch_size / fit_s[-1]:7.0f} img/s', flush=True)
    if state['time_to_first_step_s'] is None:
      state['time_to_first_step_s'] = first_step.at - train_start  # from the first fit call: compile included
    if args.state and epoch + 1 < args.epochs and (stop or (epoch + 1) % args.save_every == 0):
      state.update(train_s=elapsed, end_to_end_s=before['end_to_end_s'] + time.perf_counter() - start)
      save_state(args.state, model, state)
      if stop:
        print(f'stopped by SIGTERM after epoch {epoch + 1}; saved in {args.state}; run the same command to '
              'resume', flush=True)
        return
  train_s = before['train_s'] + time.perf_counter() - train_start

  accuracies = [acc for _, _, acc in history if acc is not None]
  images_per_epoch = steps * args.batch_size
  result = {
      'framework': 'keras', 'depth': args.depth, 'epochs': args.epochs, 'batch_size': args.batch_size,
      'seed': args.seed, 'steps_per_execution': args.steps_per_execution, 'train_images': len(x_train),
      'final_test_accuracy': accuracies[-1], 'best_test_accuracy': max(accuracies),
      'history': history,  # (epoch, seconds since training start incl. evaluation, test accuracy)
      'fit_seconds': sum(fit_s), 'eval_seconds': state['eval_s'], 'train_wall_seconds': train_s,
      'end_to_end_seconds': before['end_to_end_s'] + time.perf_counter() - start, 'data_load_seconds': load_s,
      'model_build_seconds': build_s, 'attempts': state['attempts'],
      'time_to_first_step_seconds': state['time_to_first_step_s'],
      # images/s over model.fit only (no evaluation, no host augmentation); the first epoch includes compiling
      'images_per_second': images_per_epoch * args.epochs / sum(fit_s),
      'images_per_second_after_epoch_1': (images_per_epoch * (args.epochs - 1) / sum(fit_s[1:])
                                          if args.epochs > 1 else None),
      'keras_version': keras.__version__, 'jax_version': jax.__version__,
      'device_kind': jax.devices()[0].device_kind, 'num_params': model.count_params(),
  }
  print(json.dumps({k: v for k, v in result.items() if k != 'history'}), flush=True)
  if args.out:
    args.out.write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
  main()
