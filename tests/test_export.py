"""--mode=export: a SavedModel and a TFLite model that run without JAX and agree with predict."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from configs import cifar10
from conftest import make_image_folder
from flaxtpu.exporters import export
from flaxtpu.loop import train
from flaxtpu.modes import predict, restore
from flaxtpu.settings.errors import UserError

ONNX = sys.version_info >= (3, 11)  # jax2onnx, the ONNX converter, needs Python 3.11+

# Loads both exported models with TensorFlow alone and prints their logits for batches of 1 and 5. JAX is
# installed here and TensorFlow's TFLite module imports it when it can, so the script makes it unimportable
# first, as on a server without it.
SERVE_WITHOUT_JAX = r'''
import importlib.abc, json, sys, warnings

class NoJax(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'flaxtpu'):
      raise ImportError(f'{name} is blocked: the export must serve without it')

sys.meta_path.insert(0, NoJax())
import numpy as np
import onnxruntime
import tensorflow as tf
export_dir, images_path = sys.argv[1:]
images = np.load(images_path)
model = tf.saved_model.load(f'{export_dir}/saved_model')
serve = model.signatures['serving_default']
result = {'inputs': {k: [v.dtype.name, v.shape.as_list()]
                     for k, v in serve.structured_input_signature[1].items()},
          'outputs': sorted(serve.structured_outputs), 'saved_model': [], 'probabilities': [], 'tflite': [],
          'onnx': [],
          'class_names': [name.decode() for name in model.class_names.numpy()]}
with warnings.catch_warnings():
  warnings.simplefilter('ignore')
  interpreter = tf.lite.Interpreter(model_path=f'{export_dir}/model.tflite')
  tflite = interpreter.get_signature_runner('serving_default')
onnx = onnxruntime.InferenceSession(f'{export_dir}/model.onnx', providers=['CPUExecutionProvider']) if (
    sys.version_info >= (3, 11)) else None  # jax2onnx needs Python 3.11+
for batch in (images[:1], images[1:6]):
  outputs = serve(images=tf.constant(batch))
  result['saved_model'].append(outputs['logits'].numpy().tolist())
  result['probabilities'].append(outputs['probabilities'].numpy().tolist())
  result['tflite'].append(tflite(images=batch)['logits'].tolist())
  result['onnx'].append(onnx.run(['logits'], {'images': batch})[0].tolist() if onnx else [])
result['modules'] = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'flaxtpu'))
print(json.dumps(result))
'''


def _config(folder, **overrides):
  config = cifar10.get_config()  # the Keras CNN: the smallest model, so the run stays short
  config.dataset.folder = folder
  config.batch_size = 16
  config.num_train_steps = 3
  config.log_every_steps = 3
  config.eval_every_steps = 3
  config.checkpoint_every_steps = 3
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  folder = make_image_folder(tmp_path_factory.mktemp('images'), test_per_class=3)  # 9 eval images
  workdir = str(tmp_path_factory.mktemp('run'))
  config = _config(folder)
  train.train_and_evaluate(config, workdir)
  return config, workdir, export.export_checkpoint(config, workdir)


def test_export_writes_checked_models_and_report(exported):
  config, workdir, summary = exported
  directory = os.path.join(workdir, 'export')
  assert sorted(os.listdir(directory)) == ['README.md', 'class_names.txt', 'export.json',
                                           *(['model.onnx'] if ONNX else []), 'model.tflite',
                                           'model_fp16.tflite', 'model_int8.tflite', 'saved_model']
  assert os.path.isfile(os.path.join(directory, 'saved_model', 'saved_model.pb'))
  assert not [name for name in os.listdir(workdir) if name.startswith('.export')]  # no staging left
  with open(os.path.join(directory, 'export.json')) as f:
    assert json.load(f) == json.loads(json.dumps(summary))
  assert summary['step'] == 3 and summary['class_names'] == ['cat', 'dog', 'frog']
  assert summary['signature']['inputs'] == {'images': {'dtype': 'uint8', 'shape': [None, 8, 8, 3]}}
  assert summary['tflite'] == 'model.tflite' and summary['tflite_error'] is None
  assert not summary['tflite_needs_flex_ops']
  check = summary['check']
  assert check['num_images'] == 9
  for name in ('saved_model', 'tflite', *(['onnx'] if ONNX else [])):
    assert check[name]['max_abs_diff'] <= check[name]['allowed_abs_diff']
    assert check[name]['tolerance'] == export.TOLERANCES['float32'][name]
  with open(os.path.join(directory, 'class_names.txt')) as f:
    assert f.read().splitlines() == ['cat', 'dog', 'frog']


def test_exported_models_run_without_jax_and_match_predict(exported, tmp_path):
  config, workdir, _ = exported
  images = np.random.default_rng(0).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
  np.save(tmp_path / 'images.npy', images)
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  result = subprocess.run([sys.executable, '-c', SERVE_WITHOUT_JAX, os.path.join(workdir, 'export'),
                           str(tmp_path / 'images.npy')], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  served = json.loads(result.stdout.splitlines()[-1])
  assert served['modules'] == []  # TensorFlow alone: no JAX, Flax or flaxtpu behind it
  assert served['inputs'] == {'images': ['uint8', [None, 8, 8, 3]]}
  assert served['outputs'] == ['logits', 'probabilities']
  assert served['class_names'] == ['cat', 'dog', 'frog']
  placement, state, _, _ = restore.restore(config, workdir)
  expected = predict.predict_logits(placement, state, images, config.batch_size)
  scale = max(1.0, np.abs(expected).max())
  for batch, rows in ((0, slice(0, 1)), (1, slice(1, 6))):  # batch sizes 1 and 5
    np.testing.assert_allclose(served['saved_model'][batch], expected[rows], rtol=0,
                               atol=export.TOLERANCES['float32']['saved_model'] * scale)
    np.testing.assert_allclose(served['tflite'][batch], expected[rows], rtol=0,
                               atol=export.TOLERANCES['float32']['tflite'] * scale)
    if ONNX:
      np.testing.assert_allclose(served['onnx'][batch], expected[rows], rtol=0,
                                 atol=export.TOLERANCES['float32']['onnx'] * scale)
    probabilities = np.asarray(served['probabilities'][batch])
    np.testing.assert_allclose(probabilities.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(probabilities.argmax(-1), expected[rows].argmax(-1))


def _copy_of_run(workdir, destination):
  """The trained run without its export."""
  shutil.copytree(workdir, destination, ignore=shutil.ignore_patterns('export'))
  return str(destination)


@pytest.mark.parametrize('failure', ['tolerance 0', 'wrong logits'])
def test_failed_check_leaves_nothing_behind(failure, exported, tmp_path, monkeypatch):
  config, workdir, _ = exported
  copy = _copy_of_run(workdir, tmp_path / 'run')
  if failure == 'tolerance 0':
    monkeypatch.setitem(export.TOLERANCES, 'float32', {'saved_model': 0.0, 'tflite': 0.0})
    match = 'SavedModel logits differ from flaxtpu predict by up to'
  else:
    real = export._logits_function
    monkeypatch.setattr(export, '_logits_function', lambda task: lambda v, x: real(task)(v, x) + 0.01)
    match = r'SavedModel logits differ .* more than the 0.0001 allowed'
  with pytest.raises(UserError, match=match):
    export.export_checkpoint(config, copy)
  assert sorted(os.listdir(copy)) == sorted(n for n in os.listdir(workdir) if n != 'export')


@pytest.mark.parametrize('layout', [{'parallelism': 'pmap'}, {'mesh.fsdp': 2, 'mesh.fsdp_min_size': 1024}])
def test_export_gathers_pmap_copies_and_fsdp_shards(layout, exported, tmp_path):
  # Checkpoints hold the global layout whatever trained them; restore lays the parameters out as the
  # config says (one copy per device under pmap, kernels split over 2 devices under fsdp).
  config, workdir, _ = exported
  run = _copy_of_run(workdir, tmp_path / 'run')
  summary = export.export_checkpoint(_config(config.dataset.folder, **layout), run)
  for name in ('saved_model', 'tflite'):
    assert summary['check'][name]['max_abs_diff'] <= summary['check'][name]['allowed_abs_diff']
  assert os.path.isfile(os.path.join(run, 'export', 'saved_model', 'saved_model.pb'))


def test_export_of_a_calibrated_run_serves_the_calibrated_logits(exported, tmp_path):
  """calibration.json's temperature divides the served logits, in the one function predict shares."""
  config, workdir, _ = exported
  run = _copy_of_run(workdir, tmp_path / 'run')
  with open(os.path.join(run, 'calibration.json'), 'w') as f:
    json.dump({'temperature': 4.0, 'step': 3, 'weights': 'raw', 'tta': 'none', 'num_classes': 3,
               'coverage': 0.9, 'set_threshold': 0.9, 'set_score': 'aps', 'randomize': False,
               'raps_lambda': 0.0, 'raps_k': 0, 'seed': 0}, f)
  summary = export.export_checkpoint(config, run)
  assert summary['temperature'] == 4.0
  images = np.random.default_rng(1).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
  placement, state, _, record = restore.restore(config, run, calibrated=False)
  raw = predict.predict_logits(placement, state, images, config.batch_size)
  assert record['calibration'] is None
  import tensorflow as tf
  served = tf.saved_model.load(os.path.join(run, 'export', 'saved_model')).signatures['serving_default']
  np.testing.assert_allclose(served(images=tf.constant(images))['logits'].numpy(), raw / 4.0, rtol=0,
                             atol=1e-4 * max(1.0, np.abs(raw).max()))
