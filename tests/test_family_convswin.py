"""ConvNeXt T/S/B/L and Swin T/S/B: timm's function at any image size, every variant recognised, the
layer map as timm groups it, remat and stochastic depth, runs saved before model.downsample, and the
published-weight paths (file, timm folder, hub cache, keep_head predict, fine-tune, export to timm)."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_pretrained
from safetensors.numpy import save_file
from test_pretrained import assert_same_function, flaxtpu_logits, hub_cache, import_torch, torch_logits

from conftest import make_image_folder
from flaxtpu import main, models
from flaxtpu.exporters import export
from flaxtpu.models import registry
from flaxtpu.models.nets import swin
from flaxtpu.modes import predict
from flaxtpu.optimizers import optim
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import UserError
from flaxtpu.transfer import finetune
from flaxtpu.validation import resolution, workdir_config
from flaxtpu.weights import pretrained

VARIANTS = [('convnext_t', 'convnext_tiny'), ('convnext_s', 'convnext_small'),
            ('convnext_b', 'convnext_base'), ('convnext_l', 'convnext_large'),
            ('swin_t', 'swin_tiny_patch4_window7_224'),
            ('swin_s', 'swin_small_patch4_window7_224'), ('swin_b', 'swin_base_patch4_window7_224')]


def _images(count, size, seed=0):
  return np.random.default_rng(seed).normal(size=(count, size, size, 3)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _source(architecture):
  """A timm model with random weights; Swin's bias tables drawn far from their init (std 2 rather than
  0.02), so that a wrong index, mask or table resize shows in the logits."""
  torch, _, timm = import_torch()
  torch.manual_seed(0)
  model = timm.create_model(architecture).eval()
  with torch.no_grad():
    for name, parameter in model.named_parameters():
      if name.endswith('relative_position_bias_table'):
        parameter.normal_(0, 2)
  return model, {key: value.numpy() for key, value in model.state_dict().items()}


def _at_size(architecture, size):
  """timm's model at `size` px with the 224 px weights, loaded as timm loads published weights (its
  checkpoint_filter_fn resizes Swin's tables to windows that small maps shrink)."""
  torch, _, timm = import_torch()
  model, _ = _source(architecture)
  if not architecture.startswith('swin') or size == 224:
    return model
  from timm.models.swin_transformer import checkpoint_filter_fn  # pylint: disable=g-import-not-at-top
  resized = timm.create_model(architecture, img_size=size).eval()
  resized.load_state_dict(checkpoint_filter_fn(dict(model.state_dict()), resized))
  return resized


def test_swin_import_computes_timms_function_at_another_size():
  """72 px: 18/9/5/3 token maps, padded to whole windows (18 -> 21, 9 -> 14), shifted under the mask, the
  last two one shrunk window each (their tables resized): timm's model built at 72 px."""
  torch, _, _ = import_torch()
  _, tensors = _source('swin_tiny_patch4_window7_224')
  images = _images(4, 72)
  assert_same_function(torch_logits(torch, _at_size('swin_tiny_patch4_window7_224', 72), images),
                       flaxtpu_logits(tensors, images, 'swin_t'))


def test_convnext_floors_odd_maps_as_timm():
  """The fix: at 72 px the 18x18 map halves to 9x9, then timm floors it to 4x4; flaxtpu's old SAME padding
  (downsample=ceil: 5x5) is another function."""
  torch, _, _ = import_torch()
  model, tensors = _source('convnext_tiny')
  images = _images(4, 72)
  expected = torch_logits(torch, model, images)
  assert_same_function(expected, flaxtpu_logits(tensors, images, 'convnext_t'))
  ceil = flaxtpu_logits(tensors, images, 'convnext_t', downsample='ceil')
  assert np.abs(ceil - expected).max() > 1e-2 * np.abs(expected).max()


def test_convnext_names_images_too_small_to_floor():
  """16 px at stride 4: 4 -> 2 -> 1 -> nothing; stride 1 keeps 8 px images (as SAME padding did)."""
  with pytest.raises(UserError, match=r'ConvNeXt with patch_size=4 floors a 1x1 map to nothing at stage 4: '
                                      r'it needs images of at least 32x32'):
    jax.eval_shape(lambda: models.create('convnext_t', num_classes=3).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)), train=False))
  variables = jax.eval_shape(lambda: models.create('convnext_t', num_classes=3, patch_size=1).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)), train=False))
  assert variables['params']['head']['kernel'].shape == (768, 3)


@pytest.mark.parametrize('name, architecture', VARIANTS)
def test_every_variant_is_recognised_with_timms_parameter_count(name, architecture):
  """Shapes only (timm's model on the meta device, zero-stride arrays): the file's tensors name the variant,
  the layout reads every one, and flaxtpu's model has timm's number of parameters."""
  torch, _, timm = import_torch()
  model = timm.create_model(architecture, device='meta')
  tensors = {key: np.broadcast_to(np.float32(0), value.shape) for key, value in model.state_dict().items()}
  layout, found, options = pretrained.infer_model(tensors, 'test weights')
  assert (layout, found, options['patch_size']) == ('timm', name, 4)
  assert not pretrained.check_tensors(tensors, layout, found, options, 'test weights')  # not headless
  variables = jax.eval_shape(lambda: models.create(name, num_classes=1000).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3)), train=False))
  assert sum(leaf.size for leaf in jax.tree.leaves(variables['params'])) == sum(
      parameter.numel() for parameter in model.parameters())


def test_a_swin_with_other_windows_is_refused_by_name():
  _, _, timm = import_torch()
  model = timm.create_model('swin_base_patch4_window12_384', device='meta')
  tensors = {key: np.broadcast_to(np.float32(0), value.shape) for key, value in model.state_dict().items()}
  with pytest.raises(UserError, match=r'test weights is a Swin Transformer with 12x12 windows; flaxtpu\'s '
                                      r'Swin models \(swin_t, swin_s, swin_b\) have 7x7 windows'):
    pretrained.infer_model(tensors, 'test weights')


@pytest.mark.parametrize('name, architecture', [VARIANTS[0], VARIANTS[4]])
def test_layer_map_is_timms_group_matcher(name, architecture):
  """optimizer.layer_decay's layer of every parameter is the group timm's group_matcher puts its tensor in."""
  _, _, timm = import_torch()
  from timm.models._manipulate import group_parameters  # pylint: disable=g-import-not-at-top
  model = timm.create_model(architecture, device='meta')
  groups = group_parameters(model, model.group_matcher())
  timm_layer = {key: layer for layer, keys in enumerate(groups.values()) for key in keys}
  rules = models.layout(name, 'timm').rules(models.get_spec(name), {}, ())
  ours = {rule.source: optim.layer_depth(name, rule.targets[0].split('/', 1)[1]) for rule in rules}
  assert ours == timm_layer


def _grads(model, images):
  variables = model.init(jax.random.PRNGKey(0), images, train=False)
  loss = lambda params: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({'params': params}, images, train=True, rngs={'dropout': jax.random.PRNGKey(1)}),
      jnp.arange(len(images)) % 10).mean()
  return jax.jit(jax.grad(loss))(variables['params'])


@pytest.mark.parametrize('name', ['convnext_t', 'swin_t'])
def test_remat_gives_the_same_gradients_with_stochastic_depth(name):
  images = jnp.asarray(_images(4, 40))  # Swin: 10x10 tokens, padded and shifted; ConvNeXt: 5 -> 2 -> 1
  plain = _grads(models.create(name, num_classes=10, drop_path=0.3), images)
  remat = _grads(models.create(name, num_classes=10, drop_path=0.3, remat='full'), images)
  for x, y in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def _checkpoints(jaxpr) -> int:
  """The jax.checkpoint (remat) equations in a jaxpr, those in nested jaxprs included."""
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)  # a ClosedJaxpr's
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in ('checkpoint', 'remat2')  # jax.checkpoint's primitive, by version
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, 'eqns') or hasattr(getattr(sub, 'jaxpr', None), 'eqns'):
          count += _checkpoints(sub)
  return count


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_swin_remat_mlps_recomputes_the_first_stages_mlps_and_nothing_changes(remat):
  """model.remat_mlps=N: the MLP branches of the first N stages under jax.checkpoint (Swin-T: 2 + 2
  blocks for N=2; with remat=full nested in each block's), the same parameters and gradients."""
  images = jnp.asarray(_images(4, 40))
  plain = models.create('swin_t', num_classes=10, drop_path=0.3, remat=remat)
  mlps = models.create('swin_t', num_classes=10, drop_path=0.3, remat=remat, remat_mlps=2)
  variables = plain.init(jax.random.PRNGKey(0), images, train=False)
  assert jax.tree.map(jnp.shape, mlps.init(jax.random.PRNGKey(0), images, train=False)) == jax.tree.map(
      jnp.shape, variables)
  blocks = 12 if remat == 'full' else 0  # remat=full: every block is one checkpoint of its own
  for model, expected in ((plain, blocks), (mlps, blocks + 4)):
    loss = lambda params, model=model: model.apply({'params': params}, images, train=True,
                                                   rngs={'dropout': jax.random.PRNGKey(1)}).sum()
    assert _checkpoints(jax.make_jaxpr(loss)(variables['params'])) == expected
  for x, y in zip(jax.tree.leaves(_grads(plain, images)), jax.tree.leaves(_grads(mlps, images))):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_swin_stochastic_depth_drops_branches_at_train_time_only():
  model = models.create('swin_t', num_classes=10, drop_path=0.5)
  images = jnp.asarray(_images(8, 32))
  variables = model.init(jax.random.PRNGKey(0), images, train=False)
  train = lambda seed: model.apply(variables, images, train=True, rngs={'dropout': jax.random.PRNGKey(seed)})
  assert not np.allclose(train(1), train(2))
  evaluation = model.apply(variables, images, train=False)
  np.testing.assert_array_equal(evaluation, models.create('swin_t', num_classes=10).apply(
      variables, images, train=False))


def test_swin_table_resize_is_timms():
  torch, _, _ = import_torch()
  from timm.layers import resize_rel_pos_bias_table  # pylint: disable=g-import-not-at-top
  table = np.random.default_rng(0).normal(size=(169, 3)).astype(np.float32)
  for window in ((3, 3), (7, 4), (1, 7)):
    expected = resize_rel_pos_bias_table(torch.from_numpy(table), new_window_size=window,
                                         new_bias_shape=((2 * window[0] - 1) * (2 * window[1] - 1), 3))
    np.testing.assert_allclose(swin.table_resize(7, window) @ table, expected.numpy(), atol=1e-5)
  assert swin.table_resize(7, (7, 7)) is None


def test_convnext_runs_saved_before_model_downsample_keep_ceil():
  """Runs saved before the key recorded model.padding (which ConvNeXt never read) and no downsample."""
  saved = json.loads(json.dumps(defaults.get_config().to_dict()))
  saved['model']['name'] = 'convnext_t'
  assert workdir_config.from_saved(saved).model.downsample == 'floor'
  del saved['model']['downsample']
  restored = workdir_config.from_saved(saved)
  assert (restored.model.downsample, restored.model.padding) == ('ceil', 'torch')
  saved['model']['name'] = 'swin_t'
  assert workdir_config.from_saved(saved).model.downsample == 'floor'  # not a Swin option


@pytest.fixture
def in_process(monkeypatch):
  """main.run in this process: JAX runs already (on the suite's CPU devices)."""
  monkeypatch.setattr(main, '_start_jax', lambda config: jax)


def _run_config(folder, name, **overrides):
  config = defaults.get_config()
  config.dataset.folder = str(folder)
  config.model.name = name
  config.batch_size = 8
  config.num_train_steps = 2
  config.compilation_cache_dir = 'none'
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture
def small_convnext_t(monkeypatch):
  """convnext_t with one block a stage and narrow stages: the family's stem and stride-2 downsamples (what
  model.downsample rounds) at a twentieth of the compile time."""
  small = dataclasses.replace(models.get_spec('convnext_t'), stage_sizes=(1, 1, 1, 1), widths=(8, 16, 24, 32))
  monkeypatch.setitem(registry._SPECS, 'convnext_t', small)  # pylint: disable=protected-access
  registry.layer_depths.cache_clear()
  yield
  monkeypatch.undo()
  registry.layer_depths.cache_clear()


def test_an_old_convnext_run_evaluates_as_it_trained(tmp_path, in_process, small_convnext_t):
  """A run at 36 px (9x9 -> 5x5 under ceil, 4x4 under floor) trained as flaxtpu trained before the key,
  its config.json and records as such a run wrote them: eval restores it with ceil and reproduces its eval
  loss; a config at today's default (floor) gets the run's ceil back (resolution.keep_saved_function), so
  it reproduces the loss too, and so does a resumed training. (A small convnext_t: small_convnext_t.)"""
  folder = make_image_folder(tmp_path / 'photos', size=36, train_per_class=4, test_per_class=2)
  workdir = str(tmp_path / 'run')
  main.run(_run_config(folder, 'convnext_t', **{'model.downsample': 'ceil'}), workdir, 'train', None)
  trained = json.loads(open(os.path.join(workdir, 'results.json')).read())['eval_loss']
  path = os.path.join(workdir, 'config.json')
  saved = json.loads(open(path).read())
  del saved['model']['downsample']
  with open(path, 'w') as f:
    json.dump(saved, f)
  losses = {}
  for downsample in ('ceil', 'floor'):
    restored = workdir_config.get_config(workdir)
    if downsample == 'floor':
      restored.model.downsample = 'floor'
    assert restored.model.downsample == downsample
    main.run(restored, workdir, 'eval', None)
    losses[downsample] = json.loads(open(os.path.join(workdir, 'eval.json')).read())['eval_loss']
  assert losses['ceil'] == pytest.approx(trained, rel=1e-5)
  assert losses['floor'] == pytest.approx(trained, rel=1e-5)  # the saved run's function was kept

  # Resuming its training under today's default keeps the run's function: the saved ceil wins.
  resumed = _run_config(folder, 'convnext_t', num_train_steps=3)
  assert resumed.model.downsample == 'floor'
  resolution.keep_saved_function(resumed, workdir)
  assert resumed.model.downsample == 'ceil'


@pytest.fixture(scope='module')
def swin_published(tmp_path_factory):
  """swin_t's weights as a .safetensors file, a .pth file, a local timm folder and a hub cache."""
  torch, _, _ = import_torch()
  from timm.models._hub import save_for_hf  # pylint: disable=g-import-not-at-top
  model, tensors = _source('swin_tiny_patch4_window7_224')
  root = tmp_path_factory.mktemp('swin')
  save_file({key: np.ascontiguousarray(value) for key, value in tensors.items()},
            str(root / 'swin.safetensors'))
  torch.save(model.state_dict(), str(root / 'swin.pth'))
  save_for_hf(model, str(root / 'folder'), safe_serialization=True)
  home = str(root / 'hf_home')
  hub_cache(home, 'timm/swin_tiny_patch4_window7_224.test',
            {name: (root / 'folder' / name).read_bytes() for name in ('config.json', 'model.safetensors')})
  return root, home


def test_swin_published_paths_are_recognised(swin_published, monkeypatch):
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  root, home = swin_published
  monkeypatch.setenv('HF_HOME', home)
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', os.path.join(home, 'hub'))
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
  for spec in (root / 'swin.safetensors', root / 'swin.pth', root / 'folder',
               'hf-hub:timm/swin_tiny_patch4_window7_224.test'):
    pretrained.describe.cache_clear()
    published = pretrained.describe(str(spec))
    assert (published.model, published.num_classes, published.crop_fraction) == ('swin_t', 1000, 0.9), spec
  pretrained.describe.cache_clear()


def test_swin_keep_head_predict_at_another_size_is_timms(swin_published):
  """--mode=predict's path straight from the published file at 72 px: timm's logits built at 72 px."""
  torch, _, _ = import_torch()
  root, _ = swin_published
  config = defaults.get_config()
  config.init_from.checkpoint = str(root / 'swin.safetensors')
  config.dataset.image_size = 72
  config.cpu_devices = 1
  config.compilation_cache_dir = 'none'
  pretrained.describe.cache_clear()
  pretrained.apply_defaults(config)
  placement, state, _, record = finetune.published_model(config)
  pixels = np.random.default_rng(0).integers(0, 256, (8, 72, 72, 3)).astype(np.uint8)
  ours = predict.predict_logits(placement, state, pixels, 8)  # a batch over the suite's 8 devices
  mean, std = (np.asarray(record['normalization'][key], np.float32) for key in ('mean', 'std'))
  theirs = torch_logits(torch, _at_size('swin_tiny_patch4_window7_224', 72),
                        ((pixels / 255.0 - mean) / std).astype(np.float32))
  assert_same_function(theirs, ours)


@pytest.mark.slow  # 2-20 min on 2 shared cores; the parity and keep_head tests check the function
def test_swin_finetune_from_a_timm_folder_exports_back_to_timm(swin_published, tmp_path, in_process):
  """configs/finetune.py from a local timm folder at 36 px (9/5/3/2 tokens: padded, shifted, shrunk windows)
  with layer decay and fsdp -> export: timm.create_model loads export/timm with the SavedModel's logits."""
  torch, _, timm = import_torch()

  from configs import finetune as finetune_recipe  # pylint: disable=g-import-not-at-top
  root, _ = swin_published
  folder = make_image_folder(tmp_path / 'photos', size=36, train_per_class=4, test_per_class=2)
  config = finetune_recipe.get_config()
  config.update_from_flattened_dict({
      'dataset.folder': str(folder), 'init_from.checkpoint': str(root / 'folder'), 'dataset.image_size': 36,
      'num_train_steps': 2, 'batch_size': 8, 'compilation_cache_dir': 'none',
      'optimizer.layer_decay': 0.75, 'mesh.fsdp': 2, 'mesh.fsdp_min_size': 1024,
      'export.onnx': False, 'export.quantize': ()})  # test_onnx and test_deploy test those
  workdir = str(tmp_path / 'run')
  pretrained.describe.cache_clear()
  main.run(config, workdir, 'train', None)
  restored = workdir_config.get_config(workdir)
  assert restored.model.name == 'swin_t'
  summary = export.export_checkpoint(restored, workdir)
  assert summary['timm']['architecture'] == 'swin_tiny_patch4_window7_224'
  assert summary['timm']['model_args']['img_size'] == [36, 36]
  test_pretrained.timm_export_computes_the_saved_model(torch, timm, workdir, 4, 36)
