"""EfficientNet and MobileNetV3: blocks as timm and torchvision build them, imports equal to the source's
function (PyTorch and TensorFlow padding, timm's and torchvision's layouts), and every path a published
model takes: files, a timm folder, the hub, predict, fine-tuning with layer decay, remat and fsdp, export.

Source models are built here with random weights; the big variants are compared in
benchmarks/accuracy/pretrained_parity.py.
"""

import json

import jax
import numpy as np
import pytest
import test_pretrained
from PIL import Image
from test_pretrained import (
  NO_EXTRA_EXPORTS,
  _cli,
  _images,
  assert_same_function,
  flaxtpu_logits,
  hub_cache,
  import_torch,
  measure_batch_norm,
  torch_logits,
)
from test_remat import _grad_fn

from flaxtpu import models
from flaxtpu.models import efficientnet, mbconv, mobilenetv3
from flaxtpu.optimizers import optim
from flaxtpu.settings.errors import UserError
from flaxtpu.weights import pretrained

TIMM_NAMES = {**{name: name for name in efficientnet.SPECS},
              'mobilenetv3_l': 'mobilenetv3_large_100', 'mobilenetv3_s': 'mobilenetv3_small_100'}
TORCHVISION_NAMES = {**{name: name for name in efficientnet.SPECS},
                     'mobilenetv3_l': 'mobilenet_v3_large', 'mobilenetv3_s': 'mobilenet_v3_small'}


def _source(library: str, architecture: str, size: int):
  """The source model, its BatchNorm statistics measured on images of `size`, and its state dict."""
  torch, torchvision, timm = import_torch()
  torch.manual_seed(0)
  model = (timm.create_model(architecture) if library == 'timm'
           else getattr(torchvision.models, architecture)())
  model = measure_batch_norm(torch, model, _images(16, size, seed=1))
  return model, {key: value.numpy() for key, value in model.state_dict().items()}


# Sizes that are not multiples of 32: odd maps (72 -> 36 -> 18 -> 9 -> 5 -> 3) meet strided convs.
@pytest.mark.parametrize('library, architecture, name, size', [
    ('timm', 'efficientnet_b0', 'efficientnet_b0', 56),
    ('timm', 'tf_efficientnet_b0', 'efficientnet_b0', 72),
    ('torchvision', 'efficientnet_b0', 'efficientnet_b0', 40),
    ('timm', 'mobilenetv3_small_100', 'mobilenetv3_s', 64),
    ('timm', 'tf_mobilenetv3_small_100', 'mobilenetv3_s', 72),
    ('torchvision', 'mobilenet_v3_large', 'mobilenetv3_l', 40),  # BatchNorm eps 1e-3: folded in
    ('torchvision', 'mobilenet_v3_small', 'mobilenetv3_s', 72),
])
def test_import_computes_the_source_models_function(library, architecture, name, size):
  torch = import_torch()[0]
  model, tensors = _source(library, architecture, size)
  images = _images(4, size)
  padding = 'same' if architecture.startswith('tf_') else 'torch'
  assert_same_function(torch_logits(torch, model, images),
                       flaxtpu_logits(tensors, images, name, padding=padding))


def _timm_block(block) -> tuple:
  """A timm block module as (kind, kernel, stride, in, mid, out, SE width, activation, skip)."""
  kind = {'DepthwiseSeparableConv': 'ds', 'InvertedResidual': 'ir', 'ConvBnAct': 'cn'}[type(block).__name__]
  spatial = block.conv if kind == 'cn' else block.conv_dw
  first = block.conv if kind == 'cn' else (block.conv_pw if kind == 'ir' else block.conv_dw)
  last = {'cn': 'conv', 'ir': 'conv_pwl', 'ds': 'conv_pw'}[kind]
  se = getattr(getattr(block, 'se', None), 'conv_reduce', None)
  act = {'SiLU': 'silu', 'ReLU': 'relu', 'Hardswish': 'hard_swish'}[type(block.bn1.act).__name__]
  return (kind, spatial.kernel_size[0], spatial.stride[0], first.in_channels, spatial.out_channels,
          getattr(block, last).out_channels, se.out_channels if se else 0, act, block.has_skip)


@pytest.mark.parametrize('name', list(TIMM_NAMES))
def test_every_variant_has_the_sources_blocks_and_tensors(name):
  """Channel rounding, depth multipliers, SE widths, activations and skips as timm builds them (no weights
  allocated); the tensors of timm's and torchvision's models are exactly those the layouts read."""
  torch, torchvision, timm = import_torch()
  spec = models.get_spec(name)
  with torch.device('meta'):
    source = timm.create_model(TIMM_NAMES[name])
    theirs = [_timm_block(block) for stage in source.blocks for block in stage]
    other = getattr(torchvision.models, TORCHVISION_NAMES[name])()
  ours = [(b.kind, b.kernel, b.stride, b.in_chs, b.mid_chs, b.out_chs, b.se_chs, b.act, b.skip)
          for _, b in mbconv.block_names(spec)]
  assert ours == theirs
  assert (spec.stem, spec.features) == (source.conv_stem.out_channels, source.conv_head.out_channels)
  assert spec.torchvision_eps == other.features[0][1].eps
  for model in (source, other):
    tensors = {key: np.broadcast_to(np.float32(0), value.shape) for key, value in model.state_dict().items()}
    layout, inferred, options = pretrained.infer_model(tensors, 'test weights')
    assert (inferred, options) == (name, {'padding': 'torch'})
    rules = models.layout(name, layout).rules(spec, options, set(tensors))
    assert {rule.source for rule in rules} | models.layout(name, layout).unread(tensors) == set(tensors)


@pytest.mark.parametrize('name', ['efficientnet_b0', 'mobilenetv3_s'])
def test_layer_decay_counts_the_layers_as_timms_group_matcher(name):
  """Every timm parameter's layer (timm.optim's layer decay: group_matcher, the unmatched last) is the
  layer of the flaxtpu parameter it becomes."""
  torch, _, timm = import_torch()
  from timm.models import group_parameters  # pylint: disable=g-import-not-at-top
  with torch.device('meta'):
    source = timm.create_model(TIMM_NAMES[name])
  layer_map = group_parameters(source, source.group_matcher(coarse=False), reverse=True)
  head = max(layer_map.values())  # the unmatched parameters' group
  parameters = dict(source.named_parameters())
  depths = {}
  for rule in models.layout(name, 'timm').rules(models.get_spec(name), {}, ()):
    for target in rule.targets:
      if target.startswith('params/') and rule.source in parameters:
        depths[rule.source] = (layer_map[rule.source], optim.layer_depth(name, target[7:]))
  assert set(depths) == set(parameters)
  assert all(theirs == ours for theirs, ours in depths.values()), depths
  assert models.layer_depths(name)[1] == head


def test_a_tf_port_is_named_by_its_config_and_computes_another_function_unpadded(tmp_path):
  """timm's tf_efficientnet_b0 holds efficientnet_b0's tensors: its folder's config.json makes the run
  pad as TensorFlow; read from a bare .pth or .safetensors, the padding is the user's to name."""
  torch, _, _ = import_torch()
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from timm.models._hub import save_for_hf  # pylint: disable=g-import-not-at-top
  model, tensors = _source('timm', 'tf_efficientnet_b0', 40)
  save_for_hf(model, str(tmp_path / 'folder'), safe_serialization=True)
  torch.save(model.state_dict(), tmp_path / 'weights.pth')
  save_file(tensors, str(tmp_path / 'weights.safetensors'))
  described = {path: pretrained.describe(str(tmp_path / path))
               for path in ('folder', 'weights.pth', 'weights.safetensors')}
  assert {path: (found.model, found.options['padding'], found.num_classes)
          for path, found in described.items()} == {
              'folder': ('efficientnet_b0', 'same', 1000), 'weights.pth': ('efficientnet_b0', 'torch', 1000),
              'weights.safetensors': ('efficientnet_b0', 'torch', 1000)}
  images = _images(2, 40)
  expected = torch_logits(torch, model, images)
  unpadded = flaxtpu_logits(tensors, images, 'efficientnet_b0')
  assert np.abs(unpadded - expected).max() > 1e-2 * np.abs(expected).max()
  with pytest.raises(UserError, match='torchvision\'s EfficientNet pads as PyTorch'):
    models.layout('efficientnet_b0', 'torchvision').rules(models.get_spec('efficientnet_b0'),
                                                          {'padding': 'same'}, ())


def test_a_variant_no_flaxtpu_model_has_is_named():
  torch, _, timm = import_torch()
  with torch.device('meta'):
    source = timm.create_model('mobilenetv3_large_075')
  tensors = {key: np.broadcast_to(np.float32(0), value.shape) for key, value in source.state_dict().items()}
  with pytest.raises(UserError, match=r'test weights holds a MobileNetV3 with \(1, 2, 3, 4, 2, 3, 1\) '
                     r'blocks of widths \(16, 24, 32, 64, 88, 120, 720\), which no flaxtpu model matches; '
                     'supported: mobilenetv3_l, mobilenetv3_s'):
    pretrained.infer_model(tensors, 'test weights')


def test_remat_gives_the_same_gradients():
  grad, params, batch_stats = _grad_fn('mobilenetv3_s', 'none')
  reference = grad(params, batch_stats)
  grad, _, _ = _grad_fn('mobilenetv3_s', 'full')
  for x, y in zip(jax.tree.leaves(reference), jax.tree.leaves(grad(params, batch_stats))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _hub(tmp_path, library_architecture: str, repo: str):
  """HF_HOME with `repo` cached as timm publishes it, and the source model."""
  _, _, timm = import_torch()
  from timm.models._hub import save_for_hf  # pylint: disable=g-import-not-at-top
  model, _ = _source('timm', library_architecture, 64)
  folder = tmp_path / 'saved'
  save_for_hf(model, str(folder), safe_serialization=True,
              data_config={'input_size': (3, 64, 64), 'crop_pct': 1.0, 'interpolation': 'bicubic',
                           'mean': (0.485, 0.456, 0.406), 'std': (0.229, 0.224, 0.225)})
  home = str(tmp_path / 'hf_home')
  hub_cache(home, repo, {name: (folder / name).read_bytes() for name in ('config.json', 'model.safetensors')})
  assert json.loads((folder / 'config.json').read_text())['architecture'] == library_architecture
  return home, model


def test_hub_tf_port_predicts_the_published_head(tmp_path):
  """hf-hub:timm/tf_efficientnet_b0 (its config.json: TensorFlow's padding) predicts timm's top-5."""
  torch = import_torch()[0]
  home, model = _hub(tmp_path, 'tf_efficientnet_b0', 'timm/tf_efficientnet_b0.test')
  pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8)
  Image.fromarray(pixels).save(tmp_path / 'photo.png')
  mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
  logits = torch_logits(torch, model, ((pixels / 255.0 - mean) / std)[None].astype(np.float32))[0]
  top5 = np.argsort(-logits)[:5]
  test_pretrained.predict_top5_from_the_hub(tmp_path, home, 'hf-hub:timm/tf_efficientnet_b0.test',
                                            tmp_path / 'photo.png', top5)


def test_finetune_with_layer_decay_remat_and_fsdp_exports_to_timm(tmp_path):
  """hf-hub MobileNetV3-S -> a 2-step fine-tune (configs/finetune.py, layer decay, remat, parameters
  split over 2 devices) on a 3-class folder at 32 px -> export: timm loads the exported folder and computes
  the SavedModel's logits."""
  torch, _, timm = import_torch()
  from conftest import make_image_folder  # pylint: disable=g-import-not-at-top
  home, _ = _hub(tmp_path, 'mobilenetv3_small_100', 'timm/mobilenetv3_small_100.test')
  env = {'HF_HOME': home, 'HF_HUB_OFFLINE': '1'}
  folder = make_image_folder(tmp_path / 'photos', size=40)
  workdir = tmp_path / 'run'
  result = _cli('--config=configs/finetune.py', f'--workdir={workdir}', f'--config.dataset.folder={folder}',
                '--config.init_from.checkpoint=hf-hub:timm/mobilenetv3_small_100.test',
                '--config.dataset.image_size=32', '--config.num_train_steps=2', '--config.batch_size=8',
                '--config.cpu_devices=2', '--config.mesh.fsdp=2', '--config.mesh.fsdp_min_size=1024',
                '--config.optimizer.layer_decay=0.8', '--config.model.remat=full',
                '--config.compilation_cache_dir=none', env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((workdir / 'config.json').read_text())['model']['name'] == 'mobilenetv3_s'
  result = _cli('--mode=export', f'--workdir={workdir}', *NO_EXTRA_EXPORTS, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((workdir / 'export' / 'export.json').read_text())['timm']['architecture'] == (
      'mobilenetv3_small_100')
  test_pretrained.timm_export_computes_the_saved_model(torch, timm, workdir, 4, 32)


def test_the_tf_padding_exports_as_timms_tf_port():
  options = {'padding': 'same'}
  assert pretrained.timm_architecture('efficientnet_b3', options, (32, 32, 3), 5)[0] == 'tf_efficientnet_b3'
  assert pretrained.timm_architecture('mobilenetv3_l', options, (32, 32, 3), 5)[0] == (
      'tf_mobilenetv3_large_100')
  assert mobilenetv3.FAMILY.preprocessing({}, 'timm', options).mean == (0.5, 0.5, 0.5)
