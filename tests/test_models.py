import jax
import jax.numpy as jnp
import pytest

from flaxtpu import models
from flaxtpu.errors import UserError

# Parameter counts at 10 classes (CIFAR family with projection shortcuts).
EXPECTED_PARAMS = {
    'cnn': 20_042,  # == the Keras model's model.count_params()
    'resnet20': 272_474,
    'resnet32': 466_906,
    'resnet56': 855_770,
    'resnet18': 11_181_642,
    'resnet50': 23_528_522,
}


def _init(model, shape):
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(shape), train=False))


@pytest.mark.parametrize('name, count', EXPECTED_PARAMS.items())
def test_parameter_counts(name, count):
  variables = _init(models.create(name, num_classes=10), (1, 32, 32, 3))
  assert sum(x.size for x in jax.tree.leaves(variables['params'])) == count


def test_cnn_layers_match_keras():
  params = _init(models.create('cnn', num_classes=10), (1, 32, 32, 3))['params']
  shapes = {path: leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  assert sorted(shapes.values()) == sorted([(3, 3, 3, 32), (32,), (3, 3, 32, 64), (64,), (64, 10), (10,)])


@pytest.mark.parametrize('name', models.NAMES)
@pytest.mark.parametrize('shape, classes', [((2, 32, 32, 3), 10), ((2, 28, 28, 1), 7)])
def test_output_shapes(name, shape, classes):
  if name in ('resnet101', 'resnet152', 'resnet110') and shape[1] == 28:
    pytest.skip('deep variants: one input shape is enough')
  model = models.create(name, num_classes=classes)
  variables = _init(model, shape)
  logits = jax.eval_shape(lambda v: model.apply(v, jnp.zeros(shape), train=False), variables)
  assert logits.shape == (shape[0], classes)
  assert logits.dtype == jnp.float32
  assert ('batch_stats' in variables) == (name != 'cnn')


def test_unknown_model_lists_valid_names():
  with pytest.raises(UserError, match="unknown model 'vgg16'; choose one of: cnn, resnet20"):
    models.create('vgg16', num_classes=10)


def test_bfloat16_model_keeps_float32_params_and_logits():
  model = models.create('resnet20', num_classes=10, dtype='bfloat16')
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 32, 32, 3)), train=False)
  assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype('float32')}
  logits, updates = model.apply(variables, jnp.ones((2, 32, 32, 3)), train=True, mutable=['batch_stats'])
  assert logits.dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(updates)} == {jnp.dtype('float32')}
