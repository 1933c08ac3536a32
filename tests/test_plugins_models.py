"""A model family is a plug-in: one defined here, registered with one line, is built by `models.create`,
recognised in a published safetensors file, imported through init_from's path, and counted by layer decay.

Also: every built-in model's parameters are all placed by its family's layer-depth map, and the registry
imports no JAX."""

import inspect
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from safetensors.numpy import save_file

from flaxtpu import models
from flaxtpu.models import layouts
from flaxtpu.models.family import Family, Layout, Spec
from flaxtpu.optimizers import optim
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import UserError, join_or
from flaxtpu.transfer import finetune
from flaxtpu.weights import pretrained

# --- the toy family: a network and its plug-in ----------------------------------------------------


class ToyNet(nn.Module):
  """3x3 VALID convolution + ReLU, global average pooling, a dense head."""
  num_classes: int
  width: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.relu(nn.Conv(self.width, (3, 3), padding='VALID', dtype=self.dtype, name='stem')(x))
    return nn.Dense(self.num_classes, dtype=self.dtype, name='head')(jnp.mean(x, axis=(1, 2)))


def _build(spec, *, num_classes, dtype, wrap, bn_axis_name):
  del wrap, bn_axis_name
  return ToyNet(num_classes=num_classes, width=spec.widths[0], dtype=dtype)


def _recognise(tensors, where):
  if 'features.weight' not in tensors or 'classifier.weight' not in tensors:
    return None
  width = tensors['features.weight'].shape[0]
  return TOY.twin(where, f'a toy net of width {width}', widths=(width,)), {}


# A timm-style layout: PyTorch's OIHW convolution and [out, in] linear layer.
TOY_LAYOUT = Layout('timm', ('toy',), _recognise,
                    rules=lambda spec, options, keys: [*layouts.dense('features', 'stem', layouts.conv),
                                                       *layouts.dense('classifier', 'head')],
                    head=lambda keys: 'classifier.bias')
TOY = Family('toy', {'toy_net': Spec('toy', widths=(8,))}, _build,
             layers=lambda spec: [('stem',), ('head',)], title='toy net', layouts=(TOY_LAYOUT,),
             input_kernel='params/stem/kernel')


@pytest.fixture
def toy_family():
  models.register(TOY)
  yield TOY
  models.unregister(TOY.name)
  assert 'toy_net' not in models.NAMES


def _toy_file(tmp_path, classes=3, width=8, channels=3):
  rng = np.random.default_rng(0)
  tensors = {'features.weight': rng.normal(size=(width, channels, 3, 3)).astype(np.float32),
             'features.bias': rng.normal(size=(width,)).astype(np.float32),
             'classifier.weight': rng.normal(size=(classes, width)).astype(np.float32),
             'classifier.bias': rng.normal(size=(classes,)).astype(np.float32)}
  path = str(tmp_path / 'toy.safetensors')
  save_file(tensors, path)
  return path, tensors


def _numpy_logits(tensors, images):
  windows = sliding_window_view(images, (3, 3), axis=(1, 2))  # [n, rows, cols, channels, 3, 3]
  features = np.einsum('nijchw,ochw->nijo', windows, tensors['features.weight']) + tensors['features.bias']
  pooled = np.maximum(features, 0).mean(axis=(1, 2))
  return pooled @ tensors['classifier.weight'].T + tensors['classifier.bias']


def test_a_registered_family_is_created_and_imports_its_published_weights(toy_family, tmp_path):
  assert models.NAMES[-1] == 'toy_net' and models.get_family('toy_net') is toy_family
  path, tensors = _toy_file(tmp_path)
  published = pretrained.describe(path)
  assert (published.layout, published.model, published.options, published.num_classes) == (
      'timm', 'toy_net', {}, 3)
  assert (published.mean, published.std, published.image_size) == (
      (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 224)  # timm's defaults for a convolutional network

  model = models.create('toy_net', num_classes=3, image_shape=(10, 10, 3))
  assert isinstance(model, ToyNet) and model.width == 8
  images = np.random.default_rng(1).normal(size=(2, 10, 10, 3)).astype(np.float32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 10, 10, 3))))
  wanted = {f'params/{name}': leaf.shape for name, leaf in optim.named_leaves(shapes['params']).items()}
  config = defaults.get_config()
  config.model.name = 'toy_net'
  config.init_from.checkpoint = path
  arrays = finetune._published_arrays(config, published, wanted)  # pylint: disable=protected-access
  assert set(arrays) == set(wanted)
  np.testing.assert_array_equal(arrays['params/stem/kernel'],
                                tensors['features.weight'].transpose(2, 3, 1, 0))  # OIHW -> HWIO
  np.testing.assert_array_equal(arrays['params/stem/bias'], tensors['features.bias'])
  np.testing.assert_array_equal(arrays['params/head/kernel'], tensors['classifier.weight'].T)
  np.testing.assert_array_equal(arrays['params/head/bias'], tensors['classifier.bias'])

  params = {'stem': {'kernel': arrays['params/stem/kernel'], 'bias': arrays['params/stem/bias']},
            'head': {'kernel': arrays['params/head/kernel'], 'bias': arrays['params/head/bias']}}
  logits = np.asarray(model.apply({'params': params}, images, train=False))
  np.testing.assert_allclose(logits, _numpy_logits(tensors, images), rtol=1e-5, atol=1e-5)

  # Its declared input kernel: 1-channel images get the RGB kernel summed over its colours.
  gray = finetune._published_arrays(config, published, {'params/stem/kernel': (3, 3, 1, 8)})
  np.testing.assert_allclose(gray['params/stem/kernel'],
                             tensors['features.weight'].transpose(2, 3, 1, 0).sum(axis=2, keepdims=True))


def _registered(text: str, families) -> str:
  """The message part listing `families` as flaxtpu lists them ('a, b or c'), as a regex."""
  return re.escape(join_or([text(family) for family in families]))


def test_a_registered_family_has_no_timm_export_unless_it_declares_an_architecture(toy_family):
  timm_families = [family for family in models.families() if family.timm_architecture]
  assert toy_family not in timm_families
  with pytest.raises(UserError, match="toy_net has no timm twin; timm's layout exists for "
                     + re.escape(join_or([family.listed() for family in timm_families], 'and')) + '$'):
    pretrained.timm_architecture('toy_net', {}, (8, 8, 3), 3)


def test_a_file_of_no_family_lists_the_registered_families(toy_family, tmp_path):
  readers = [family for family in models.families() if family.layouts]
  assert readers[-1] is toy_family
  assert [family.title for family in readers[:3]] == ['ResNet', 'ViT', 'ConvNeXt']
  with pytest.raises(UserError, match=r'is not a ' + _registered(lambda family: family.title, readers)
                     + r" in timm's, torchvision's, big_vision's or toy's layout \(its tensors: x"):
    pretrained.infer_model({'x': np.zeros(1)}, 'test weights')


def test_layer_decay_counts_the_family_layers_and_refuses_a_parameter_outside_them(toy_family):
  params = {'stem': {'kernel': np.ones((3, 3, 3, 8)), 'bias': np.ones(8)},
            'head': {'kernel': np.ones((8, 3)), 'bias': np.ones(3)}}
  names = ('stem/kernel', 'stem/bias', 'head/kernel')
  assert [optim.layer_depth('toy_net', name) for name in names] == [0, 0, 1]
  assert optim.model_layers('toy_net') == [('stem',)]
  assert optim.layer_decay_multipliers('toy_net', params, 0.5) == {
      'stem/kernel': 0.5, 'stem/bias': 0.5, 'head/kernel': 1.0, 'head/bias': 1.0}
  with pytest.raises(UserError, match=r"parameter 'extra/kernel' of toy_net is in no layer of the 'toy' "
                                      r"family's layer-depth map"):
    optim.layer_decay_multipliers('toy_net', {**params, 'extra': {'kernel': np.ones((2, 2))}}, 0.5)


def test_registering_a_taken_name_is_refused(toy_family):
  with pytest.raises(ValueError, match="'toy' or one of its models"):
    models.register(toy_family)


def test_a_family_reading_an_option_config_model_lacks_is_refused():
  """`create` passes a family the config.model keys it names, by name: an unknown one would break every
  run of its models, so registering it fails, naming the keys there are."""
  unknown = Family('toy2', {'toy2_net': Spec('toy2', widths=(8,))}, _build,
                   options=('patch_size', 'width_mult'), layers=lambda spec: [('stem',), ('head',)],
                   title='toy net')
  with pytest.raises(ValueError, match=r"^model family 'toy2' reads options patch_size, width_mult; "
                                       r"config.model has only patch_size, pool, .*, remat_mlps$"):
    models.register(unknown)
  assert 'toy2_net' not in models.NAMES
  assert set(models.OPTIONS) <= set(inspect.signature(models.create).parameters)  # each one a create option


# Every built-in model, one test each (the registry's names at collection, before any test's plug-in).
@pytest.mark.parametrize('name', models.NAMES)
def test_every_model_places_every_parameter_in_its_layer_map(name):
  """No built-in parameter falls outside its family's layer-depth map (the head is a listed layer)."""
  options = {'patch_size': 4, 'pool': 'tok'} if 'pool' in models.get_spec(name).options else (
      {'patch_size': 4} if 'patch_size' in models.get_spec(name).options else {})
  model = models.create(name, num_classes=10, **options)
  images = jnp.zeros((1, 32, 32, 3))
  variables = jax.eval_shape(lambda model=model: model.init(jax.random.PRNGKey(0), images, train=False))
  _, head = models.layer_depths(name)
  depths = {optim.layer_depth(name, path) for collection in variables.values()
            for path in optim.named_leaves(collection)}
  assert depths == set(range(head + 1)), name  # every layer holds parameters, the head last


def test_the_registry_and_the_published_weights_import_no_jax():
  code = ('import sys, flaxtpu.models, flaxtpu.weights.pretrained; '
          'print(sorted({"jax", "flax"} & set(sys.modules)), flaxtpu.models.get_spec("vit_ti").options)')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert result.stdout.split('\n')[0] == "[] ('patch_size', 'pool', 'dropout', 'drop_path', 'gelu')"
