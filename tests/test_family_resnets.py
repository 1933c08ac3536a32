"""ResNet-D, ResNeXt and wide ResNets (the ResNet plug-in) and RegNetX/RegNetY (the RegNet plug-in): the
source model's function from timm's and torchvision's weights, every published architecture recognised
with all its tensors read, and each path (hub, timm folder, .pth, keep_head predict, fine-tune with layer
decay, remat and fsdp, export to timm and back) for the smallest of each family."""

import json
import re

import jax
import numpy as np
import pytest
import test_pretrained
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

from conftest import make_image_folder
from flaxtpu import models
from flaxtpu.models import regnet
from flaxtpu.step import parallel
from flaxtpu.weights import pretrained

# torchvision's RegNets -> flaxtpu's (timm's names; *_tv where torchvision rounds widths otherwise)
TORCHVISION_REGNETS = {
    'regnet_x_400mf': 'regnetx_004_tv', 'regnet_x_800mf': 'regnetx_008', 'regnet_x_1_6gf': 'regnetx_016',
    'regnet_x_3_2gf': 'regnetx_032', 'regnet_y_400mf': 'regnety_004', 'regnet_y_800mf': 'regnety_008_tv',
    'regnet_y_1_6gf': 'regnety_016', 'regnet_y_3_2gf': 'regnety_032', 'regnet_y_8gf': 'regnety_080_tv',
    'regnet_y_16gf': 'regnety_160',
}
TORCHVISION_RESNETS = ('resnext50_32x4d', 'resnext101_32x8d', 'resnext101_64x4d', 'wide_resnet50_2',
                       'wide_resnet101_2')
VARIANTS = [name for name in models.NAMES if models.get_spec(name).family == 'regnet'
            or name.startswith(('resnext', 'wide_resnet')) or re.fullmatch(r'resnet\d+d', name)]


def _source(library: str, architecture: str):
  torch, torchvision, timm = import_torch()
  return timm.create_model(architecture) if library == 'timm' else getattr(torchvision.models, architecture)()


def _meta_state(library: str, architecture: str) -> dict:
  """The source model's state dict, as shapes only where it can be built on torch's meta device (no memory,
  no time; torchvision's RegNets derive their widths with tensors, so they are built for real)."""
  torch, _, _ = import_torch()
  with torch.device('cpu' if architecture in TORCHVISION_REGNETS else 'meta'):
    model = _source(library, architecture)
  return dict(model.state_dict())


@pytest.mark.parametrize('library, architecture', [
    *[('timm', name) for name in VARIANTS if not name.endswith('_tv')],
    *[('torchvision', name) for name in (*TORCHVISION_RESNETS, *TORCHVISION_REGNETS)],
])
def test_every_published_variant_is_recognised_and_read_whole(library, architecture):
  """The file's shapes name the model (timm's name, or torchvision's twin) and its rules read every tensor."""
  tensors = _meta_state(library, architecture)
  layout, name, options = pretrained.infer_model(tensors, 'test weights')
  assert name == TORCHVISION_REGNETS.get(architecture, architecture)
  assert layout == ('torchvision' if architecture in TORCHVISION_REGNETS else 'timm')
  assert not pretrained.check_tensors(tensors, layout, name, options, 'test weights')  # not headless


def test_regnet_stages_are_derived_as_timm_derives_them():
  """(torchvision's derivation: its models' shapes name these specs, in the test above.)"""
  import_torch()
  from timm.models import regnet as timm_regnet  # pylint: disable=g-import-not-at-top
  for name, spec in regnet.FAMILY.specs.items():
    stages, _ = timm_regnet.RegNet._get_stage_args(None, timm_regnet.model_cfgs[name])  # pylint: disable=protected-access
    assert (spec.stage_sizes, spec.widths, spec.group_widths, spec.se_ratio) == (
        tuple(stage['depth'] for stage in stages), tuple(stage['out_chs'] for stage in stages),
        tuple(stage['group_size'] for stage in stages), timm_regnet.model_cfgs[name].se_ratio), name


@pytest.mark.parametrize('library, architecture, name, size', [
    ('timm', 'resnet18d', 'resnet18d', 50),  # odd maps: the shortcut's pooling keeps its partial windows
    ('timm', 'resnet50d', 'resnet50d', 40),
    ('timm', 'resnext50_32x4d', 'resnext50_32x4d', 48),
    ('torchvision', 'wide_resnet50_2', 'wide_resnet50_2', 40),
    ('timm', 'regnetx_002', 'regnetx_002', 56),
    ('timm', 'regnety_002', 'regnety_002', 50),
    ('torchvision', 'regnet_x_400mf', 'regnetx_004_tv', 48),
    ('torchvision', 'regnet_y_400mf', 'regnety_004', 40),
])
def test_import_computes_the_source_models_function(library, architecture, name, size):
  torch, _, _ = import_torch()
  torch.manual_seed(0)
  model = measure_batch_norm(torch, _source(library, architecture), _images(16, size, seed=1))
  tensors = {key: value.numpy() for key, value in model.state_dict().items()}
  images = _images(4, size)
  assert_same_function(torch_logits(torch, model, images), flaxtpu_logits(tensors, images, name))


@pytest.mark.parametrize('name', ['resnet18d', 'resnext50_32x4d', 'regnety_002'])
def test_remat_gives_the_same_gradients(name):
  grad, params, batch_stats = _grad_fn(name, 'none')
  reference = grad(params, batch_stats)
  grad, _, _ = _grad_fn(name, 'full')
  for x, y in zip(jax.tree.leaves(reference), jax.tree.leaves(grad(params, batch_stats))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_torchvision_pth_file_is_read_in_torchvisions_layout(tmp_path):
  torch, torchvision, _ = import_torch()
  torch.manual_seed(0)
  path = str(tmp_path / 'regnet_y_400mf.pth')
  torch.save(torchvision.models.regnet_y_400mf().state_dict(), path)
  published = pretrained.describe(path)
  assert (published.layout, published.model, published.num_classes, published.head) == (
      'torchvision', 'regnety_004', 1000, 'fc.bias')


# --- every path, for the smallest of each family ----------------------------------------------------


@pytest.fixture(scope='module', params=['resnet18d', 'regnety_002'])
def published(request, tmp_path_factory):
  """(model, HF_HOME caching hf-hub:timm/<model>.test, its local timm folder, a 64 px photo, timm's top-5)."""
  torch, _, timm = import_torch()
  from timm.models._hub import save_for_hf  # pylint: disable=g-import-not-at-top
  name = request.param
  torch.manual_seed(0)
  mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
  model = measure_batch_norm(torch, timm.create_model(name), _images(16, 64, seed=1))
  folder = tmp_path_factory.mktemp(f'{name}_timm')
  save_for_hf(model, str(folder), safe_serialization=True,
              data_config={'input_size': (3, 64, 64), 'crop_pct': 1.0, 'interpolation': 'bicubic',
                           'mean': tuple(mean), 'std': tuple(std)})
  home = str(tmp_path_factory.mktemp('hf_home'))
  hub_cache(home, f'timm/{name}.test', {file: (folder / file).read_bytes()
                                        for file in ('config.json', 'model.safetensors')})
  photo = str(tmp_path_factory.mktemp('photo') / 'photo.png')
  pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8)
  from PIL import Image  # pylint: disable=g-import-not-at-top
  Image.fromarray(pixels).save(photo)
  logits = torch_logits(torch, model, ((pixels / 255.0 - mean) / std)[None].astype(np.float32))[0]
  return name, home, str(folder), photo, np.argsort(-logits)[:5]


def test_keep_head_predict_from_the_hub_gives_timms_top5(published, tmp_path):
  name, home, _, photo, top5 = published
  output = tmp_path / 'predictions.csv'
  result = _cli('--mode=predict', f'--config.init_from.checkpoint=hf-hub:timm/{name}.test',
                f'--config.predict.input={photo}', '--config.predict.top_k=5',
                f'--config.predict.output_csv={output}', env={'HF_HOME': home, 'HF_HUB_OFFLINE': '1'})
  assert result.returncode == 0, result.stderr[-2000:]
  import csv  # pylint: disable=g-import-not-at-top
  with open(output, newline='') as f:
    (row,) = list(csv.DictReader(f))
  names = pretrained.imagenet_class_names()
  assert [row[f'class_{rank}'] for rank in range(1, 6)] == [names[index] for index in top5]


def test_finetune_from_a_timm_folder_with_layer_decay_remat_and_fsdp_exports_to_timm(published, tmp_path):
  """A 2-step fine-tune (layer-wise lr decay, remat, parameters split over 2 devices) from the local timm
  folder; its timm export loads in timm with the SavedModel's logits and init_from reads it back. (RegNet's
  grouped convolutions split their kernels' inputs under fsdp: parallel.fsdp_spec.)"""
  torch, _, timm = import_torch()
  name, _, folder, _, _ = published
  photos = make_image_folder(tmp_path / 'photos', size=40)
  workdir = tmp_path / 'run'
  result = _cli('--config=configs/finetune.py', f'--workdir={workdir}', f'--config.dataset.folder={photos}',
                f'--config.init_from.checkpoint={folder}', '--config.dataset.image_size=32',
                '--config.num_train_steps=2', '--config.batch_size=8', '--config.cpu_devices=2',
                '--config.mesh.fsdp=2', '--config.mesh.fsdp_min_size=1024', '--config.model.remat=full',
                '--config.optimizer.layer_decay=0.75', '--config.compilation_cache_dir=none')
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((workdir / 'config.json').read_text())['model']['name'] == name
  result = _cli('--mode=export', f'--workdir={workdir}', *NO_EXTRA_EXPORTS)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((workdir / 'export' / 'export.json').read_text())['timm']['architecture'] == name

  test_pretrained.timm_export_computes_the_saved_model(torch, timm, workdir, 4, 32)
  assert pretrained.describe(str(workdir / 'export' / 'timm')).model == name


def test_fsdp_splits_a_grouped_kernel_over_its_inputs_or_not_at_all():
  """Split over its outputs, a grouped convolution's kernel aborts XLA:CPU's partitioner on its gradient
  (docs/performance.md); other kernels keep the largest divisible dimension, depthwise ones too."""
  P = jax.sharding.PartitionSpec
  assert parallel.fsdp_spec((3, 3, 8, 152), 2, 1024) == P(None, None, 'fsdp', None)  # regnetx_002's
  assert parallel.fsdp_spec((3, 3, 8, 152), 16, 1024) == P()
  assert parallel.fsdp_spec((1, 1, 56, 152), 2, 1024) == P(None, None, None, 'fsdp')
  assert parallel.fsdp_spec((3, 3, 1, 960), 2, 1024) == P(None, None, None, 'fsdp')  # depthwise
  assert parallel.fsdp_spec((3, 3, 256, 256), 2, 1024) == P(None, None, 'fsdp', None)
