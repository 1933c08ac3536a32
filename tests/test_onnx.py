"""model.onnx (flaxtpu/exporters/onnx_export.py): --mode=export's ONNX model agrees with predict, for every
family."""

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import cifar10
from conftest import make_image_folder
from flaxtpu import models
from flaxtpu.exporters import export, onnx_export
from flaxtpu.loop import train
from flaxtpu.modes import predict, restore
from flaxtpu.settings.errors import UserError
from flaxtpu.step import steps

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason='jax2onnx needs Python 3.11+')
MEAN = np.array([0.49, 0.48, 0.45], np.float32)
STD = np.array([0.25, 0.24, 0.26], np.float32)


def _session(path):
  import onnxruntime
  return onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])


def _relative(got, expected):
  return float(np.abs(got - expected).max() / max(1.0, np.abs(expected).max()))


def _images(count, size, seed):
  return np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def _random_task(name, size, *, num_classes=10, options=None, **task_options):
  """Model `name` with its init perturbed (zero-initialised heads or BatchNorm scales hide nothing) and
  random BatchNorm statistics, as a Task and host ModelState like export.py's."""
  options = dict(options or {})
  model = models.create(name, num_classes=num_classes, **options)
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)), train=False)
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda a: np.asarray(a + 0.05 * rng.standard_normal(a.shape), a.dtype),
                        variables['params'])
  batch_stats = jax.tree.map(lambda a: np.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype),
                             variables.get('batch_stats', {}))
  task = steps.Task(model=model, num_classes=num_classes, image_shape=(size, size, 3), augment=None,
                    label_smoothing=0.0, mean=MEAN, std=STD, **task_options)
  return task, steps.ModelState(params=params, batch_stats=batch_stats)


def _convert_and_compare(tmp_path, task, state, batches=(5, 1)):
  """Exports `task` to tmp_path/model.onnx -> (its onnx_model entry, max relative logit difference to
  predict's logits_fn over `batches`, max |probabilities - their definition|)."""
  summary = onnx_export.export(str(tmp_path), task, state, export._logits_function)
  assert summary['onnx_error'] is None and summary['onnx'] == 'model.onnx'
  session = _session(str(tmp_path / 'model.onnx'))
  logits_fn = jax.jit(export._logits_function(task))
  variables = {'params': state.params, 'batch_stats': state.batch_stats}
  diffs, probability_diffs = [], []
  for seed, count in enumerate(batches):
    images = _images(count, task.image_shape[0], seed)
    logits, probabilities = session.run(['logits', 'probabilities'], {'images': images})
    expected = np.asarray(logits_fn(variables, images))
    diffs.append(_relative(logits, expected))
    made = jax.nn.sigmoid(logits) if task.multilabel else jax.nn.softmax(logits, axis=-1)
    probability_diffs.append(float(np.abs(probabilities - np.asarray(made)).max()))
  return summary['onnx_model'], max(diffs), max(probability_diffs)


def test_jax2onnx_internals_that_flaxtpu_patches_are_where_they_were():
  # The pinned jax2onnx; these are what onnx_export reaches into. A new release that moves them fails here.
  import onnx_ir
  from jax2onnx.plugins import _ir_shapes, plugin_system
  from jax2onnx.plugins.jax.lax import pad, reduce_window_max
  jax2onnx = onnx_export._converter()
  assert onnx_export._version('jax2onnx') == onnx_export.CONVERTER_VERSION == '0.17.1'
  with open(os.path.join(os.path.dirname(__file__), '..', 'Makefile')) as f:  # what `make install` installs
    assert f'JAX2ONNX := jax2onnx=={onnx_export.CONVERTER_VERSION}\n' in f.read()
  assert callable(jax2onnx.to_onnx) and callable(plugin_system.import_all_plugins)
  assert isinstance(plugin_system.PLUGIN_REGISTRY, dict) and len(plugin_system.PLUGIN_REGISTRY) > 400
  ours = plugin_system.PLUGIN_REGISTRY['reduce_window_max']
  assert type(ours).__name__ == 'NHWCMaxPool'
  assert isinstance(ours, reduce_window_max.ReduceWindowMaxPrimitivePlugin)
  assert str(_ir_shapes._to_ir_dim_for_shape('batch')) == 'batch'
  assert pad.ir is not onnx_ir and pad.ir.TensorType is onnx_ir.TensorType  # fix 2's module proxy
  assert [str(d) for d in pad.ir.Shape([_ir_shapes._to_ir_dim_for_shape('batch'), 3])] == ['batch', '3']
  # Lax-only: no shim outside the lax plugins binds anything.
  shims = [entry for entry in plugin_system.PLUGIN_REGISTRY.values()
           if not type(entry).__module__.startswith('jax2onnx.plugins.jax.lax')]
  assert shims and not [entry for entry in shims if type(entry).binding_specs()]


def test_both_fixes_max_pool_with_padding_and_pad_under_a_symbolic_batch(tmp_path):
  # Without fix 1 onnxruntime refuses the max pool ('Unsupported pooling size'); without fix 2 the pad of
  # a symbolic batch raises InconclusiveDimensionOperation while converting.
  import flax.linen as nn
  jax2onnx = onnx_export._converter()

  def pooled(x):
    x = jnp.pad(x, ((0, 0), (1, 2), (0, 1), (0, 0)))
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))

  model = jax2onnx.to_onnx(pooled, [jax.ShapeDtypeStruct(('batch', 8, 8, 4), jnp.float32)],
                           input_names=['x'])
  session = _session(model.SerializeToString())
  for count in (1, 3):
    x = np.random.default_rng(count).standard_normal((count, 8, 8, 4)).astype(np.float32)
    np.testing.assert_array_equal(session.run(None, {'x': x})[0], np.asarray(pooled(x)))


def test_tta_multilabel_remat_and_bfloat16_flow_through(tmp_path):
  # The SavedModel's function, whatever the run evaluates with: flip and translate TTA, sigmoid
  # probabilities, remat-wrapped stages; a bfloat16 model goes out as its float32 clone.
  task, state = _random_task('cnn', 16, options={'remat': 'full'}, flip_tta=True, translate_tta=2,
                             multilabel=True)
  (tmp_path / 'f32').mkdir()
  details, diff, probability_diff = _convert_and_compare(tmp_path / 'f32', task, state)
  assert diff <= 1e-5 and probability_diff <= 1e-6, (diff, probability_diff)
  assert details['compute_dtype'] == 'float32' and details['opset'] == 23 and details['ir_version'] == 10
  bfloat16, _ = _random_task('cnn', 16, options={'dtype': 'bfloat16'})
  (tmp_path / 'bf16').mkdir()
  details, diff, _ = _convert_and_compare(tmp_path / 'bf16', bfloat16, state)
  assert diff <= export.TOLERANCES['bfloat16']['onnx'], diff
  float32 = onnx_export.runner(str(tmp_path / 'bf16' / 'model.onnx'))(_images(4, 16, 9))
  clone = dataclasses.replace(bfloat16, model=bfloat16.model.clone(dtype=jnp.float32))
  exact = export._logits_function(clone)({'params': state.params, 'batch_stats': state.batch_stats},
                                          _images(4, 16, 9))
  assert _relative(float32, np.asarray(exact)) <= 1e-5  # the float32 clone's function, not bfloat16's


def test_weights_beyond_protobufs_cap_go_beside_the_graph(tmp_path, monkeypatch):
  # Over ~1.8 GB of weights (a ViT-L in float32 is 1.2 GB) would pass the 2 GiB protobuf cap: they go to
  # model.onnx.data, which onnxruntime reads from beside model.onnx. Here with the threshold at 0 bytes.
  monkeypatch.setattr(onnx_export, '_SINGLE_FILE_BYTES', 0)
  task, state = _random_task('cnn', 16)
  details, diff, _ = _convert_and_compare(tmp_path, task, state)
  assert details['external_data'] == 'model.onnx.data' and diff <= 1e-5
  assert sorted(os.listdir(tmp_path)) == ['model.onnx', 'model.onnx.data']
  assert os.path.getsize(tmp_path / 'model.onnx.data') > os.path.getsize(tmp_path / 'model.onnx')


def test_a_model_jax2onnx_cannot_convert_gives_no_onnx_and_says_why(tmp_path, monkeypatch):
  task, state = _random_task('cnn', 16)
  jax2onnx = onnx_export._converter()

  def unsupported(*args, **kwargs):
    raise NotImplementedError('No plugin registered for primitive: some_new_primitive\n(details)')

  monkeypatch.setattr(jax2onnx, 'to_onnx', unsupported)
  error = ('jax2onnx 0.17.1 could not convert the model: NotImplementedError: No plugin registered for '
           'primitive: some_new_primitive')
  assert onnx_export.export(str(tmp_path), task, state, export._logits_function) == {
      'onnx': None, 'onnx_model': None, 'onnx_error': error}
  assert os.listdir(tmp_path) == []


def _config(folder, name):
  config = cifar10.get_config()
  config.update_from_flattened_dict({
      'dataset.folder': folder, 'model.name': name, 'batch_size': 8, 'num_train_steps': 2,
      'log_every_steps': 2, 'eval_every_steps': 2, 'checkpoint_every_steps': 2,
      'compilation_cache_dir': 'none'})
  return config


@pytest.fixture(scope='module', params=['cnn', 'resnet20'])
def exported(request, tmp_path_factory):
  """A 2-step run of the model on 32x32 images (3 classes, 9 eval images), exported."""
  folder = make_image_folder(tmp_path_factory.mktemp('images'), train_per_class=6, test_per_class=3, size=32)
  workdir = str(tmp_path_factory.mktemp('run'))
  config = _config(folder, request.param)
  train.train_and_evaluate(config, workdir)
  return config, workdir, export.export_checkpoint(config, workdir)


def test_export_writes_a_checked_onnx_model(exported):
  config, workdir, summary = exported
  directory = os.path.join(workdir, 'export')
  assert 'model.onnx' in os.listdir(directory)
  assert not os.path.exists(os.path.join(directory, 'model.onnx.data'))  # small weights: one file
  with open(os.path.join(directory, 'export.json')) as f:
    assert json.load(f)['onnx_model'] == json.loads(json.dumps(summary['onnx_model']))
  assert summary['onnx'] == 'model.onnx' and summary['onnx_error'] is None
  details = summary['onnx_model']
  assert (details['opset'], details['ir_version'], details['compute_dtype']) == (23, 10, 'float32')
  assert details['converter'].startswith('jax2onnx 0.17.1 ') and details['nodes'] > 20
  check = summary['check']['onnx']
  assert check['tolerance'] == export.TOLERANCES['float32']['onnx'] == 1e-4
  assert check['batch_sizes'] == [9, 1] and summary['check']['num_images'] == 9
  assert check['max_abs_diff'] <= check['allowed_abs_diff']
  scale = check['allowed_abs_diff'] / check['tolerance']
  assert check['max_abs_diff'] / scale <= 1e-5  # measured: well inside the tolerance


def test_onnxruntime_on_new_images_gives_predicts_logits_and_probabilities(exported):
  config, workdir, _ = exported
  session = _session(os.path.join(workdir, 'export', 'model.onnx'))
  assert [(i.name, i.type, i.shape) for i in session.get_inputs()] == [
      ('images', 'tensor(uint8)', ['batch', 32, 32, 3])]
  assert [(o.name, o.type, o.shape) for o in session.get_outputs()] == [
      ('logits', 'tensor(float)', ['batch', 3]), ('probabilities', 'tensor(float)', ['batch', 3])]
  images = _images(5, 32, seed=7)  # a batch size the export check did not run
  logits, probabilities = session.run(['logits', 'probabilities'], {'images': images})
  placement, state, _, _ = restore.restore(config, workdir)
  expected = predict.predict_logits(placement, state, images, config.batch_size)
  assert _relative(logits, expected) <= 1e-5
  np.testing.assert_allclose(probabilities, np.asarray(jax.nn.softmax(expected, axis=-1)), rtol=0, atol=1e-6)


def _snapshot(directory):
  return {os.path.relpath(os.path.join(root, name), directory):
          hashlib.sha256(open(os.path.join(root, name), 'rb').read()).hexdigest()
          for root, _, names in os.walk(directory) for name in names}


@pytest.mark.parametrize('exported', ['cnn'], indirect=True)
def test_an_onnx_model_that_disagrees_fails_the_export_and_leaves_the_old_one(exported, tmp_path,
                                                                               monkeypatch):
  config, workdir, _ = exported
  run = str(tmp_path / 'run')
  shutil.copytree(workdir, run)  # with its export
  before, listing = _snapshot(run), sorted(os.listdir(run))
  real = onnx_export.runner
  monkeypatch.setattr(onnx_export, 'runner', lambda path: lambda images: real(path)(images) + 0.01)
  with pytest.raises(UserError, match=r'the ONNX logits differ from flaxtpu predict by up to 0.01 on 9 eval '
                                      r'images, more than the .* allowed .*; nothing was exported'):
    export.export_checkpoint(config, run)
  assert sorted(os.listdir(run)) == listing and _snapshot(run) == before  # no staging, the same export


@pytest.mark.parametrize('exported', ['cnn'], indirect=True)
def test_without_jax2onnx_the_export_goes_on_and_says_so(exported, tmp_path, monkeypatch, caplog):
  config, workdir, _ = exported
  run = str(tmp_path / 'run')
  shutil.copytree(workdir, run, ignore=shutil.ignore_patterns('export'))
  monkeypatch.setitem(sys.modules, 'jax2onnx', None)  # as if not installed: find_spec and import fail
  with caplog.at_level(logging.WARNING):
    summary = export.export_checkpoint(config, run)
  error = 'jax2onnx not installed (pip install \'flaxtpu[onnx]\' and pip install --no-deps jax2onnx==0.17.1)'
  assert (summary['onnx'], summary['onnx_error'], summary['onnx_model']) == (None, error, None)
  assert 'onnx' not in summary['check'] and summary['check']['saved_model']['max_abs_diff'] >= 0
  assert 'model.onnx' not in os.listdir(os.path.join(run, 'export'))
  assert {'saved_model', 'model.tflite', 'export.json'} <= set(os.listdir(os.path.join(run, 'export')))
  assert [r.getMessage() for r in caplog.records if 'ONNX' in r.getMessage()] == [
      f'export: no ONNX model: {error}']


# One model of every family in models.families(), with the options that change the graph: name, image
# size, create() options. Random perturbed weights, 10 classes; batches 5 and 1 from one graph.
SWEEP = [
    ('cnn', 32, {}),
    ('cnn', 32, {'remat': 'full'}),
    ('fastnet', 32, {}),
    ('resnet20', 32, {}),
    ('resnet20', 32, {'padding': 'same', 'remat': 'full'}),
    ('resnet18', 32, {}),
    ('resnet18d', 32, {}),
    ('resnext50_32x4d', 32, {}),
    ('regnetx_002', 32, {}),
    ('regnety_002', 32, {}),
    ('vit_ti', 32, {'patch_size': 8}),
    ('vit_ti', 32, {'patch_size': 8, 'gelu': 'tanh', 'pool': 'tok'}),
    ('vit_ti', 32, {'patch_size': 8, 'pool': 'map'}),
    ('deit_ti_distilled', 32, {'patch_size': 8, 'pool': 'tok'}),
    ('dinov2_s_reg', 28, {}),
    ('clip_b', 32, {'patch_size': 16, 'gelu': 'quick', 'pool': 'tok'}),
    ('convnext_t', 32, {}),
    ('swin_t', 32, {}),
    ('efficientnet_b0', 32, {}),
    ('efficientnet_b0', 32, {'padding': 'same'}),
    ('mobilenetv3_s', 32, {}),
]
SWEEP_TABLE = os.environ.get('FLAXTPU_ONNX_TABLE')  # a file the sweep appends its rows to


def test_the_sweep_covers_every_family():
  assert {models.get_spec(name).family for name, *_ in SWEEP} == {family.name for family in models.families()}


@pytest.mark.slow
@pytest.mark.parametrize('name, size, options', SWEEP, ids=[
    '-'.join([name, *(f'{k}={v}' for k, v in options.items())]) for name, _, options in SWEEP])
def test_every_family_exports_to_onnx_within_1e_4_of_predict(name, size, options, tmp_path):
  task, state = _random_task(name, size, options=options)
  started = time.perf_counter()
  details, diff, probability_diff = _convert_and_compare(tmp_path, task, state)
  row = (f'| {name} {" ".join(f"{k}={v}" for k, v in options.items())} | {size} | {diff:.1e} | '
         f'{probability_diff:.1e} | {details["nodes"]} | {details["convert_seconds"]:.1f} | '
         f'{time.perf_counter() - started:.1f} |')
  print(row)
  if SWEEP_TABLE:
    with open(SWEEP_TABLE, 'a') as f:
      f.write(row + '\n')
  assert diff <= 1e-4 and probability_diff <= 1e-5, row
