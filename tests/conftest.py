"""Every test sees 8 CPU devices (like a TPU v3-8); XLA reads this before JAX starts."""

import hashlib
import os
import sys
import tempfile

# The suite's programs are small and run a few steps: compiling them is most of its time. LLVM's optimisation
# level 0 compiles XLA:CPU programs in about half the time (the same HLO; a float result can differ from the
# default's in its last bit, so every run that a test compares to another compiles this way: see cli_env).
# FLAXTPU_TEST_XLA_OPT=1 leaves XLA's default.
OPTIMISE_FLAG = '' if os.environ.get('FLAXTPU_TEST_XLA_OPT') else '--xla_backend_optimization_level=0'
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           f' --xla_force_host_platform_device_count=8 {OPTIMISE_FLAG}')


def cli_env(environ=None):
  """The environment of a CLI process that picks its own devices: this one's (or `environ`) without
  XLA_FLAGS but for the suite's optimisation level (that of the runs in this process it is compared to)."""
  environ = {k: v for k, v in (os.environ if environ is None else environ).items() if k != 'XLA_FLAGS'}
  if OPTIMISE_FLAG:
    environ['XLA_FLAGS'] = OPTIMISE_FLAG
  return environ


os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# Decoded splits (dataset.decoded_cache_dir '') go to a folder of this test process, never the user's.
os.environ['XDG_CACHE_HOME'] = tempfile.mkdtemp(prefix='flaxtpu-test-cache-')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `configs` is importable as in the CLI

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

# Real CIFAR-10 as an image folder, for the slow accuracy tests: FLAXTPU_CIFAR10=/path/to/cifar10.
CIFAR10 = os.environ.get('FLAXTPU_CIFAR10', '')


def make_image_folder(root, *, classes=('cat', 'dog', 'frog'), train_per_class=16,
                      test_per_class=7, size=8, mode='RGB', seed=0):
  """A learnable toy dataset: each class has its own brightness band."""
  rng = np.random.default_rng(seed)
  channels = 3 if mode == 'RGB' else 1
  for split, count in (('train', train_per_class), ('test', test_per_class)):
    for label, name in enumerate(classes):
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      for i in range(count):
        pixels = rng.integers(0, 60, (size, size, channels)) + label * 80
        Image.fromarray(pixels.astype(np.uint8).squeeze(), mode).save(
            os.path.join(folder, f'{i:03d}.png'))
  return str(root)


def make_mixed_folder(root, *, classes=('cat', 'dog', 'frog'), train_per_class=18, test_per_class=9,
                      seed=0):
  """Photos as users have them: 12-59 px of any aspect, JPEG and PNG, RGB, grayscale, CMYK,
  palette, alpha and 16-bit, a .DS_Store in every class. Class c is brightness 80c..80c+60."""
  rng = np.random.default_rng(seed)
  kinds = [('RGB', '.jpg'), ('L', '.png'), ('CMYK', '.jpeg'), ('P', '.png'), ('RGBA', '.PNG'),
           ('LA', '.png'), ('I;16', '.png'), ('RGB', '.png'), ('L', '.jpg')]
  for split, count in (('train', train_per_class), ('test', test_per_class)):
    for label, name in enumerate(classes):
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      for i in range(count):
        height, width = rng.integers(12, 60, 2)
        pixels = (rng.integers(0, 60, (height, width, 3)) + label * 80).astype(np.uint8)
        mode, extension = kinds[i % len(kinds)]
        image = Image.fromarray(pixels, 'RGB')
        if mode == 'I;16':
          image = Image.fromarray(pixels.mean(axis=2).astype(np.uint16) * 257)
        elif mode == 'CMYK':
          # Stored as CMYK by the file, read back to the same RGB.
          image = image.convert('CMYK')
        elif mode in ('RGBA', 'LA'):
          image = image.convert(mode)
          image.putalpha(255)
        else:
          image = image.convert(mode)
        image.save(os.path.join(folder, f'{i:03d}{extension}'))
      with open(os.path.join(folder, '.DS_Store'), 'wb') as f:
        f.write(b'\0\1 not an image')
  return str(root)


def tiny_dataset():
  """64 in-memory 8x8 images of 3 brightness classes: a dataset without files, for step-level tests."""
  from flaxtpu.data import pipeline
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 3, 64).astype(np.int32)
  images = (rng.integers(0, 80, (64, 8, 8, 3)) + labels[:, None, None, None] * 80).astype(np.uint8)
  examples = pipeline.Examples(images=images, labels=labels)
  return pipeline.Dataset(train=examples, eval=examples, class_names=('a', 'b', 'c'), image_shape=(8, 8, 3),
                          mean=np.full(3, 0.4, np.float32), std=np.full(3, 0.3, np.float32),
                          transform=pipeline.Transform())


@pytest.fixture(scope='session')
def image_folder(tmp_path_factory):
  return make_image_folder(tmp_path_factory.mktemp('images'))


def restore_checkpoint(workdir, step):
  """A saved train state as arrays on one device, whatever mesh wrote it."""
  import jax
  import orbax.checkpoint as ocp
  path = os.path.join(workdir, 'checkpoints', str(step), 'state')
  checkpointer = ocp.StandardCheckpointer()
  metadata = checkpointer.metadata(path).item_metadata
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
  return jax.tree.map(np.asarray, checkpointer.restore(path, target))


def metric_rows(workdir):
  """A run's metrics.jsonl records without the timing fields (how fast, not what was computed)."""
  import json
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  timing = ('images_per_sec', 'input_wait_fraction')
  return [{k: v for k, v in row.items() if k not in timing} for row in rows]


def assert_same_state(a, b):
  """Two pytrees of arrays are bitwise equal, leaf by leaf."""
  import jax
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def signal_at_step(monkeypatch, step_to_signal):
  """SIGTERM to this process when the data pipeline reaches a step (like a preemption)."""
  import signal

  from flaxtpu.data import loaders
  real = loaders.train_batches

  def batches(*args, **kwargs):
    for step, batch in enumerate(real(*args, **kwargs), kwargs['first_step'] + 1):
      if step == step_to_signal:
        os.kill(os.getpid(), signal.SIGTERM)
      yield batch

  monkeypatch.setattr(loaders, 'train_batches', batches)


def tree_digest(root):
  """sha256 of the names and bytes of every file under `root`, in a fixed order (equal = untouched)."""
  digest = hashlib.sha256()
  for folder, _, names in sorted(os.walk(root)):
    for name in sorted(names):
      with open(os.path.join(folder, name), 'rb') as f:
        digest.update(name.encode() + f.read())
  return digest.hexdigest()


# `make test-quick` (DEVELOPING.md): the tests that catch most breakage in a few minutes on 2 cores, marked
# `quick` here by name so that no test file has to know. Whole files of pure logic and config checks, and
# from the heavy files the one or two tests that exercise the path end to end (a short train and resume).
QUICK_FILES = {
    'test_config.py',  # config validation
    'test_readme.py',  # every README and docs command parses
    'test_old_imports.py', 'test_layout.py',  # the package layout and its old import paths
    'test_sampling.py', 'test_preprocess.py', 'test_augment.py',
    'test_hub_names.py', 'test_class_matching.py', 'test_time_budget.py', 'test_optimizers.py',
}
QUICK_TESTS = {
    'test_train.py::test_training_lowers_the_loss_on_a_fixed_batch',
    'test_train.py::test_jit_on_8_devices_equals_one_device',  # the sharded step equals one device's
    'test_train.py::test_batch_that_does_not_divide_over_devices_is_named',
    'test_checkpoint.py::test_keeps_the_latest_n_plus_the_best',
    'test_main.py::test_split_file_names_keep_the_slice',
    'test_main.py::test_bad_input_is_one_line_and_nonzero',
    'test_main.py::test_bad_config_file_is_one_line',
}


def pytest_configure(config):
  config.addinivalue_line('markers', 'quick: the inner loop, make test-quick (set here by file, test name)')


def pytest_collection_modifyitems(config, items):
  for item in items:
    name = os.path.basename(str(item.path))
    if name in QUICK_FILES or f'{name}::{item.originalname}' in QUICK_TESTS:
      item.add_marker(pytest.mark.quick)
