"""Training throughput and predict latency of the peers flaxtpu is compared to.

Peers: Keras 3 on the TensorFlow backend with XLA (`keras_tf`,
`jit_compile=True`) and without it (`keras_tf_nojit`: Keras' own default on a
CPU-only machine, where `jit_compile="auto"` resolves to False and TensorFlow
runs its graph with oneDNN kernels), Keras 3 on the JAX backend (`keras_jax`),
and PyTorch eager (`torch`, optional). Models: `cnn` (the Keras recipe, 20,042 params) and
`resnet20` (He et al. 2016, CIFAR variant, 272,474 trainable params). Inputs
are one random batch that stays in memory, so the numbers measure the
framework's step, not an input pipeline.

Keras picks its backend once per process, so every measurement runs in its
own subprocess (`--peer ...`), which prints one JSON line; `measure_peer`
launches it and parses that line. Without `--peer` this script is the driver:
it measures every peer and model, prints a table and writes a JSON file.

    python -m benchmarks.shared.peers                         # all peers, both models
    python -m benchmarks.shared.peers --peer keras_tf --model cnn --steps 30 --repeats 5
    python -m benchmarks.shared.peers --peer keras_tf --model cnn --mode predict
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

from benchmarks.shared import harness

PEERS = ('keras_tf', 'keras_tf_nojit', 'keras_jax', 'torch')
MODELS = ('cnn', 'resnet20')
MODES = ('train', 'predict')
KERAS_LOOPS = ('fit', 'train_on_batch')
KERAS_BACKENDS = {'keras_tf': 'tensorflow', 'keras_tf_nojit': 'tensorflow', 'keras_jax': 'jax'}
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
# Step counts that keep one peer measurement near a minute on 2 cores (measured
# there: a ResNet-20 step at batch 128 takes 0.5-1.7 s, a CNN step 40-200 ms).
DEFAULT_STEPS = {('train', 'cnn'): 30, ('train', 'resnet20'): 6,
                 ('predict', 'cnn'): 50, ('predict', 'resnet20'): 20}
DEFAULT_BATCH_SIZE = {'train': 128, 'predict': 64}
TORCH_MISSING = 'torch is not installed (pip install torch==2.13.0); skipped'

# --- data and timing, shared by every peer ---------------------------------------


def random_batch(batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """One NHWC float32 batch in [0, 1) and int32 labels in [0, 10)."""
  rng = np.random.default_rng(seed)
  images = rng.random((batch_size, *IMAGE_SHAPE), dtype=np.float32)
  labels = rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32)
  return images, labels


def time_train(run_steps: Callable[[int], None], steps: int, repeats: int) -> dict[str, Any]:
  """Times `run_steps(steps)` `repeats` times after compile and warm-up.

  `run_steps(n)` must run n training steps and return only once they have
  finished (it syncs on the result), so wall time is compute time.
  """
  start = time.perf_counter()
  run_steps(1)  # trace + compile
  compile_s = time.perf_counter() - start
  run_steps(2)  # first runs after compile are slower (allocations, caches)
  step_s = [s / steps for s in harness.timings(lambda: run_steps(steps), repeats)]
  return {'first_step_s': compile_s, 'step_ms': 1e3 * harness.median(step_s),
          'step_ms_repeats': [1e3 * s for s in step_s]}


def sgemm_gflops(size: int = 2048, calls: int = 10) -> list[float]:
  """GFLOP/s of each of `calls` numpy float32 products of two size x size matrices, on all cores.

  The rate a CPU framework's GEMMs can hope for; callers summarise the calls
  (median, or the best).
  """
  a = np.random.default_rng(0).standard_normal((size, size), np.float32)
  a @ a  # warm-up: thread pool, caches
  return [2 * size**3 / seconds / 1e9 for seconds in harness.timings(lambda: a @ a, calls)]


def time_predict(predict_once: Callable[[], None], calls: int, repeats: int,
                 warmup: int = 5) -> dict[str, Any]:
  """Latency of `predict_once()` (which syncs) over `calls * repeats` calls."""
  start = time.perf_counter()
  predict_once()
  compile_s = time.perf_counter() - start
  for _ in range(warmup):
    predict_once()
  latencies = harness.timings(predict_once, calls * repeats)
  return {'first_call_s': compile_s, 'latency_ms': 1e3 * harness.median(latencies),
          'latency_ms_p10': 1e3 * float(np.percentile(latencies, 10)),
          'latency_ms_p90': 1e3 * float(np.percentile(latencies, 90))}


# --- Keras 3 (either backend): same model code, backend chosen before import -------


def import_keras(backend: str):
  """Imports Keras with `backend`; must happen before anything imports it."""
  os.environ['KERAS_BACKEND'] = backend
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if backend != 'tensorflow':
    # tf.data is still used for `fit`; keep TF off any accelerator that
    # the JAX backend should own.
    tf.config.set_visible_devices([], 'GPU')
  import keras  # pylint: disable=g-import-not-at-top

  if keras.backend.backend() != backend:
    raise RuntimeError(f'Keras was already imported with backend {keras.backend.backend()!r}, '
                       f'wanted {backend!r}')
  return keras


def keras_cnn(keras, num_classes: int = NUM_CLASSES):
  """The seed pipeline's CNN, softmax included: 20,042 parameters at 10 classes.

  The one definition: `keras_reference.py` trains it for accuracy, the peers
  here time it.
  """
  layers = keras.layers
  return keras.Sequential([
      keras.Input(IMAGE_SHAPE),
      layers.Conv2D(32, 3, activation='relu'),
      layers.MaxPooling2D(),
      layers.Conv2D(64, 3, activation='relu'),
      layers.GlobalAveragePooling2D(),
      layers.Dense(num_classes, activation='softmax'),
  ])


def build_keras_model(keras, name: str):
  """`cnn` (the seed recipe) or `resnet20` as a Keras model with softmax."""
  layers = keras.layers
  if name == 'cnn':
    return keras_cnn(keras)
  if name != 'resnet20':
    raise ValueError(f'unknown model {name!r}; valid: {MODELS}')

  def conv_bn(x, filters: int, kernel: int, strides: int):
    # No conv bias: the BatchNorm shift that follows makes it redundant.
    x = layers.Conv2D(filters, kernel, strides=strides, padding='same', use_bias=False)(x)
    return layers.BatchNormalization()(x)

  inputs = keras.Input(IMAGE_SHAPE)
  x = layers.ReLU()(conv_bn(inputs, 16, 3, 1))
  for stage, filters in enumerate((16, 32, 64)):
    for block in range(3):
      strides = 2 if stage > 0 and block == 0 else 1
      y = layers.ReLU()(conv_bn(x, filters, 3, strides))
      y = conv_bn(y, filters, 3, 1)
      shortcut = x
      if strides != 1 or x.shape[-1] != filters:
        shortcut = conv_bn(x, filters, 1, strides)  # projection
      x = layers.ReLU()(layers.Add()([y, shortcut]))
  x = layers.GlobalAveragePooling2D()(x)
  outputs = layers.Dense(NUM_CLASSES, activation='softmax')(x)
  return keras.Model(inputs, outputs, name='resnet20')


def keras_optimizer(keras, model_name: str):
  """Adam(1e-3) for the CNN recipe, SGD + momentum 0.9 for ResNet-20."""
  if model_name == 'cnn':
    return keras.optimizers.Adam(1e-3)
  return keras.optimizers.SGD(0.01, momentum=0.9)


def count_trainable(model) -> int:
  """Trainable parameters (BatchNorm moving statistics excluded)."""
  return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def keras_train(peer: str, model_name: str, batch_size: int, steps: int, repeats: int,
                loop: str) -> dict[str, Any]:
  """Train throughput of a compiled Keras model with `fit` or `train_on_batch`.

  `fit` runs over `tf.data.Dataset.from_tensors(batch).repeat()` -- one
  in-memory batch, no decoding -- the way users train; `train_on_batch`
  feeds backend tensors created once, so no input pipeline is involved.
  """
  backend = KERAS_BACKENDS[peer]
  keras = import_keras(backend)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  keras.utils.set_random_seed(0)
  model = build_keras_model(keras, model_name)
  model.compile(optimizer=keras_optimizer(keras, model_name), loss='sparse_categorical_crossentropy',
                metrics=['accuracy'], jit_compile=peer != 'keras_tf_nojit')
  images, labels = random_batch(batch_size)

  def sync() -> None:
    # Reading a weight waits for every queued update (JAX is async).
    keras.ops.convert_to_numpy(model.trainable_variables[0].value)

  if loop == 'fit':
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()

    def run_steps(n: int) -> None:
      model.fit(dataset, epochs=1, steps_per_epoch=n, verbose=0, shuffle=False)
      sync()
  else:
    x = keras.ops.convert_to_tensor(images)
    y = keras.ops.convert_to_tensor(labels)

    def run_steps(n: int) -> None:
      for _ in range(n):
        model.train_on_batch(x, y)
      sync()

  result = time_train(run_steps, steps, repeats)
  result.update(num_params=count_trainable(model), loop=loop, jit_compile=bool(model.jit_compile),
                versions={'keras': keras.__version__, 'tensorflow': tf.__version__,
                          **_jax_version(backend)})
  return result


def keras_predict(peer: str, model_name: str, batch_size: int, calls: int, repeats: int) -> dict[str, Any]:
  """Latency of one jit-compiled inference call (`training=False`).

  TensorFlow: `@tf.function(jit_compile=True)`, the seed pipeline's predict
  (`keras_tf_nojit`: the same tf.function without XLA).
  JAX: `jax.jit` over `model.stateless_call`, the backend's own equivalent.
  """
  backend = KERAS_BACKENDS[peer]
  keras = import_keras(backend)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  keras.utils.set_random_seed(0)
  model = build_keras_model(keras, model_name)
  images, _ = random_batch(batch_size)
  if backend == 'tensorflow':
    jit_compile = peer != 'keras_tf_nojit'
    predict = tf.function(lambda x: model(x, training=False), jit_compile=jit_compile)
    x = tf.constant(images)

    def predict_once() -> None:
      predict(x).numpy()

    how = f'tf.function(jit_compile={jit_compile})'
  else:
    import jax  # pylint: disable=g-import-not-at-top

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    predict = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])
    x = jax.numpy.asarray(images)

    def predict_once() -> None:
      predict(trainable, non_trainable, x).block_until_ready()

    how = 'jax.jit(model.stateless_call)'

  result = time_predict(predict_once, calls, repeats)
  result.update(num_params=count_trainable(model), predict=how,
                versions={'keras': keras.__version__, 'tensorflow': tf.__version__,
                          **_jax_version(backend)})
  return result


def _jax_version(backend: str) -> dict[str, str]:
  """JAX's version when it is the Keras backend, else nothing."""
  if backend != 'jax':
    return {}
  import jax  # pylint: disable=g-import-not-at-top

  return {'jax': jax.__version__}


# --- PyTorch eager (optional dependency) -------------------------------------------


def build_torch_model(torch, name: str):
  """The same two models in PyTorch, returning logits (softmax in the loss)."""
  nn = torch.nn
  if name == 'cnn':
    return nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, NUM_CLASSES))
  if name != 'resnet20':
    raise ValueError(f'unknown model {name!r}; valid: {MODELS}')

  def conv_bn(in_filters: int, filters: int, kernel: int, stride: int):
    return nn.Sequential(nn.Conv2d(in_filters, filters, kernel, stride, padding=kernel // 2, bias=False),
                         nn.BatchNorm2d(filters))

  class BasicBlock(nn.Module):
    def __init__(self, in_filters: int, filters: int, stride: int):
      super().__init__()
      self.conv1 = conv_bn(in_filters, filters, 3, stride)
      self.conv2 = conv_bn(filters, filters, 3, 1)
      self.shortcut = (conv_bn(in_filters, filters, 1, stride)
                       if stride != 1 or in_filters != filters else nn.Identity())

    def forward(self, x):
      y = self.conv2(torch.relu(self.conv1(x)))
      return torch.relu(y + self.shortcut(x))

  blocks, in_filters = [], 16
  for stage, filters in enumerate((16, 32, 64)):
    for block in range(3):
      stride = 2 if stage > 0 and block == 0 else 1
      blocks.append(BasicBlock(in_filters, filters, stride))
      in_filters = filters
  return nn.Sequential(conv_bn(3, 16, 3, 1), nn.ReLU(), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                       nn.Linear(64, NUM_CLASSES))


def import_torch():
  """PyTorch, or None when it is not installed (it is an optional peer)."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return torch


def torch_model_and_batch(torch, model_name: str, batch_size: int, channels_last: bool):
  """A PyTorch model and one random NCHW batch (images, labels) in memory.

  PyTorch's CPU convolutions (oneDNN) are faster on channels-last memory
  (measured here: ~1.3-2x for both models), which is PyTorch's own advice
  for CNNs on CPU; `channels_last=False` gives the plain NCHW default.
  """
  torch.manual_seed(0)
  model = build_torch_model(torch, model_name)
  images, labels = random_batch(batch_size)
  # Transpose once, outside the timing: PyTorch's logical layout is NCHW.
  x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
  if channels_last:
    model = model.to(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
  return model, x, torch.from_numpy(labels).long()


def torch_train(model_name: str, batch_size: int, steps: int, repeats: int,
                channels_last: bool) -> dict[str, Any]:
  """Train throughput of an eager PyTorch loop on one batch in memory."""
  torch = import_torch()
  if torch is None:
    return {'skipped': TORCH_MISSING}
  model, x, y = torch_model_and_batch(torch, model_name, batch_size, channels_last)
  model.train()
  if model_name == 'cnn':
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
  else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
  loss_fn = torch.nn.CrossEntropyLoss()  # softmax is inside the loss

  def run_steps(n: int) -> None:
    for _ in range(n):
      optimizer.zero_grad(set_to_none=True)
      logits = model(x)
      loss = loss_fn(logits, y)
      loss.backward()
      optimizer.step()
      # Accuracy too, as Keras computes it in its train step.
      (logits.argmax(1) == y).float().mean()
    loss.item()  # CPU eager is synchronous; this only guards the claim

  result = time_train(run_steps, steps, repeats)
  result.update(num_params=sum(p.numel() for p in model.parameters()), loop='eager',
                channels_last=channels_last, threads=torch.get_num_threads(),
                versions={'torch': torch.__version__})
  return result


def torch_predict(model_name: str, batch_size: int, calls: int, repeats: int,
                  channels_last: bool) -> dict[str, Any]:
  """Latency of an eager PyTorch forward in eval mode under inference_mode."""
  torch = import_torch()
  if torch is None:
    return {'skipped': TORCH_MISSING}
  model, x, _ = torch_model_and_batch(torch, model_name, batch_size, channels_last)
  model.eval()

  def predict_once() -> None:
    with torch.inference_mode():
      torch.softmax(model(x), dim=-1)

  result = time_predict(predict_once, calls, repeats)
  result.update(num_params=sum(p.numel() for p in model.parameters()), predict='eager, inference_mode',
                channels_last=channels_last, threads=torch.get_num_threads(),
                versions={'torch': torch.__version__})
  return result


# --- one measurement in this process, or many through subprocesses -----------------


def run_in_process(peer: str, model: str, mode: str, batch_size: int, steps: int, repeats: int,
                   keras_loop: str = 'fit', torch_channels_last: bool = True) -> dict[str, Any]:
  """Measures one peer here; Keras peers need a process of their own."""
  if peer == 'torch':
    if mode == 'train':
      result = torch_train(model, batch_size, steps, repeats, torch_channels_last)
    else:
      result = torch_predict(model, batch_size, steps, repeats, torch_channels_last)
  elif mode == 'train':
    result = keras_train(peer, model, batch_size, steps, repeats, keras_loop)
  else:
    result = keras_predict(peer, model, batch_size, steps, repeats)
  if 'step_ms' in result:
    result['images_per_sec'] = batch_size / (result['step_ms'] / 1e3)
    result['images_per_sec_repeats'] = [batch_size / (ms / 1e3) for ms in result['step_ms_repeats']]
  return {'peer': peer, 'model': model, 'mode': mode, 'batch_size': batch_size, 'steps': steps,
          'repeats': repeats, **result}


def measure_peer(peer: str, model: str, batch_size: int | None = None, steps: int | None = None,
                 repeats: int = 5, mode: str = 'train', keras_loop: str = 'fit',
                 torch_channels_last: bool = True, timeout_s: float = 600) -> dict[str, Any]:
  """Runs one measurement in a fresh subprocess and returns its JSON result.

  Train results carry `images_per_sec` (median over repeats); predict
  results carry `latency_ms` (median over calls). `other_cpu_load` is how
  many cores other processes kept busy meanwhile: on a shared machine,
  anything well above 0 means the number is pessimistic. A missing
  optional peer returns `{"skipped": reason, ...}` instead of raising.
  """
  batch_size = batch_size or DEFAULT_BATCH_SIZE[mode]
  steps = steps or DEFAULT_STEPS[(mode, model)]
  layout = '--torch-channels-last' if torch_channels_last else '--no-torch-channels-last'
  options = (f'--peer {peer} --model {model} --mode {mode} --batch-size {batch_size} --steps {steps} '
             f'--repeats {repeats} --keras-loop {keras_loop} {layout}')
  command = [sys.executable, '-m', 'benchmarks.shared.peers', *options.split()]
  with harness.cpu_load() as load:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=harness.ROOT)
  json_lines = [line for line in done.stdout.splitlines() if line.startswith('{')]
  if done.returncode != 0 or not json_lines:
    raise RuntimeError(f'{" ".join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}')
  result = json.loads(json_lines[-1])
  result['process_wall_s'], result['other_cpu_load'] = load['seconds'], load['other_cpu_load']
  return result


def describe(result: dict[str, Any]) -> str:
  """One table row for a result."""
  name = f'{result["peer"]:<14} {result["model"]:<9} {result["mode"]:<8}'
  if 'skipped' in result:
    return f'{name} {result["skipped"]}'
  load = f'other load {result.get("other_cpu_load", float("nan")):.2f}'
  if result['mode'] == 'train':
    return (f'{name} {result["images_per_sec"]:7.0f} img/s {result["step_ms"]:7.1f} ms/step  '
            f'first step {result["first_step_s"]:5.1f} s  {load}  '
            f'({result["loop"]}, batch {result["batch_size"]}, {result["num_params"]:,} params)')
  return (f'{name} {result["latency_ms"]:7.2f} ms latency  '
          f'p10-p90 {result["latency_ms_p10"]:.2f}-{result["latency_ms_p90"]:.2f} ms  {load}  '
          f'({result["predict"]}, batch {result["batch_size"]})')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog='\n'.join(__doc__.splitlines()[1:]))
  parser.add_argument(
      '--peer', choices=PEERS,
      help='measure this peer in this process and print one JSON line (driver mode when omitted)')
  parser.add_argument('--model', choices=MODELS, default='cnn')
  parser.add_argument('--mode', choices=MODES, default='train')
  parser.add_argument('--peers', nargs='+', choices=PEERS, default=PEERS,
                      help='driver mode: peers to measure')
  parser.add_argument('--models', nargs='+', choices=MODELS, default=MODELS,
                      help='driver mode: models to train')
  parser.add_argument('--batch-size', type=int, help='default: 128 for train, 64 for predict')
  parser.add_argument('--steps', type=int,
                      help=f'train steps (or predict calls) per repeat; default per model: {DEFAULT_STEPS}')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--keras-loop', choices=KERAS_LOOPS, default='fit',
                      help='Keras peers: model.fit over an in-memory tf.data batch, or a train_on_batch loop')
  parser.add_argument('--torch-channels-last', action=argparse.BooleanOptionalAction, default=True,
                      help='torch peer: channels-last memory format (threads: set OMP_NUM_THREADS)')
  harness.out_argument(parser, 'peers.json')  # driver mode: every result
  args = parser.parse_args()

  if args.peer:
    batch_size = args.batch_size or DEFAULT_BATCH_SIZE[args.mode]
    steps = args.steps or DEFAULT_STEPS[(args.mode, args.model)]
    result = run_in_process(args.peer, args.model, args.mode, batch_size, steps, args.repeats,
                            args.keras_loop, args.torch_channels_last)
    print(json.dumps(result), flush=True)
    return

  # Driver: train every (peer, model), then the CNN predict latency.
  jobs = [(peer, model, 'train') for model in args.models for peer in args.peers]
  jobs += [(peer, 'cnn', 'predict') for peer in args.peers]
  results = []
  for peer, model, mode in jobs:
    result = measure_peer(peer, model, args.batch_size, args.steps, args.repeats, mode, args.keras_loop,
                          args.torch_channels_last)
    print(describe(result), flush=True)
    results.append(result)
  machine = {'platform': platform.platform(), 'processor': platform.processor(), 'cpu_count': os.cpu_count()}
  harness.write_results(args.out, {'machine': machine, 'results': results})


if __name__ == '__main__':
  main()
