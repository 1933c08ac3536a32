"""The modern ViT checkpoints (issue 38): DeiT's distillation token, DINOv2's layer scale and registers,
CLIP's pre-norm and QuickGELU, SigLIP's MAP head (pool='map') and MAE's fc_norm (pool='avg').

Source models are timm's, built here with random weights; their norms, biases, tokens and layer scales
are drawn away from their init so that reading each of them wrongly changes the logits.
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_pretrained
from safetensors.numpy import save_file
from test_pretrained import (
  NO_EXTRA_EXPORTS,
  _cli,
  assert_same_function,
  flaxtpu_logits,
  hub_cache,
  import_torch,
  torch_logits,
)

from flaxtpu import models
from flaxtpu.models import layouts
from flaxtpu.optimizers import optim
from flaxtpu.settings.errors import UserError
from flaxtpu.weights import pretrained

# (timm architecture, its model_args, flaxtpu's model, its options): the smallest source of each variant.
VARIANTS = {
    'deit': ('deit_tiny_distilled_patch16_224', {}, 'deit_ti_distilled', {'pool': 'tok'}),
    'dinov2': ('vit_small_patch14_dinov2', {}, 'dinov2_s', {'pool': 'tok'}),
    'dinov2_reg': ('vit_small_patch14_reg4_dinov2', {}, 'dinov2_s_reg', {'pool': 'tok'}),
    'clip': ('vit_base_patch32_clip_224', {}, 'clip_b', {'pool': 'tok'}),
    'clip_quickgelu': ('vit_base_patch32_clip_quickgelu_224', {}, 'clip_b', {'pool': 'tok', 'gelu': 'quick'}),
    'siglip_map': ('vit_tiny_patch16_224', {'class_token': False, 'global_pool': 'map'}, 'vit_ti',
                   {'pool': 'map'}),
    'mae_fc_norm': ('vit_tiny_patch16_224', {'global_pool': 'avg', 'fc_norm': True}, 'vit_ti',
                    {'pool': 'avg'}),
}


def _source(variant: str, size: int, num_classes: int = 10):
  """timm's model of `variant` at `size` px, its vectors and tokens drawn away from their init."""
  torch, _, timm = import_torch()
  architecture, model_args, _, _ = VARIANTS[variant]
  torch.manual_seed(0)
  model = timm.create_model(architecture, img_size=size, num_classes=num_classes, **model_args)
  return test_pretrained.randomise_transformer(torch, model).eval()


def _tensors(model) -> dict:
  return {key: value.numpy().copy() for key, value in model.state_dict().items()}


def _images(count, size, seed=0):
  return np.random.default_rng(seed).normal(size=(count, size, size, 3)).astype(np.float32)


@pytest.mark.parametrize('variant, size', [
    ('deit', 48), ('dinov2', 42), ('dinov2_reg', 56), ('clip_quickgelu', 64), ('siglip_map', 48),
    ('mae_fc_norm', 80)])
def test_import_computes_timms_function(variant, size):
  torch, _, _ = import_torch()
  model = _source(variant, size)
  tensors = _tensors(model)
  _, _, name, options = VARIANTS[variant]
  layout, inferred, inferred_options = pretrained.infer_model(tensors, 'test weights')
  assert (layout, inferred) == ('timm', name)
  assert inferred_options == {'patch_size': model.patch_embed.patch_size[0], 'gelu': 'exact',
                              **{key: value for key, value in options.items() if key != 'gelu'}}
  images = _images(4, size)
  assert_same_function(torch_logits(torch, model, images), flaxtpu_logits(tensors, images, name, **options))


def test_a_big_vision_siglip_npz_imports_its_map_head(tmp_path):
  """big_vision's SigLIP image tower (params/img/, stacked blocks, MAPHead_0, tanh GELU) computes timm's
  function of the same tensors; timm's own .npz reader reads the file back to them."""
  torch, _, timm = import_torch()
  architecture, model_args, _, _ = VARIANTS['siglip_map']
  torch.manual_seed(0)
  source = timm.create_model(architecture, img_size=48, num_classes=10, act_layer='gelu_tanh', **model_args)
  source = test_pretrained.randomise_transformer(torch, source).eval()
  path = str(tmp_path / 'siglip.npz')
  test_pretrained.siglip_npz(_tensors(source), 12, path)
  check = timm.create_model(architecture, img_size=48, num_classes=10, act_layer='gelu_tanh', **model_args)
  check.load_pretrained(path)  # timm's big_vision reader agrees with the writer
  assert all(torch.equal(check.state_dict()[key], value) for key, value in source.state_dict().items())
  tensors = pretrained.read_tensors(path)
  assert pretrained.infer_model(tensors, path) == ('big_vision', 'vit_ti',
                                                   {'patch_size': 16, 'pool': 'map', 'gelu': 'tanh'})
  images = _images(4, 48)
  assert_same_function(torch_logits(torch, source, images), flaxtpu_logits(tensors, images, 'vit_ti'))
  del tensors['params/img/MAPHead_0/MlpBlock_0/Dense_1/bias']
  with pytest.raises(UserError, match='MAPHead_0/MlpBlock_0/Dense_1/bias'):
    flaxtpu_logits(tensors, images, 'vit_ti')


@pytest.mark.parametrize('variant, source_size, size', [('deit', 32, 48), ('dinov2_reg', 28, 42),
                                                         ('mae_fc_norm', 48, 32)])
def test_another_size_resamples_the_grids_embeddings_and_keeps_the_prefix_tokens(variant, source_size, size):
  """As timm's checkpoint_filter_fn does: the class/distillation tokens' embeddings kept (DeiT), none for the
  class token and registers (DINOv2 with registers, timm's no_embed_class)."""
  torch, _, timm = import_torch()
  from timm.models.vision_transformer import checkpoint_filter_fn  # pylint: disable=g-import-not-at-top
  native = _source(variant, source_size)
  architecture, model_args, name, options = VARIANTS[variant]
  resized = timm.create_model(architecture, img_size=size, num_classes=10, **model_args)
  resized.load_state_dict(checkpoint_filter_fn(native.state_dict(), resized))
  images = _images(2, size)
  assert_same_function(torch_logits(torch, resized, images),
                       flaxtpu_logits(_tensors(native), images, name, **options))


def test_distilled_deit_averages_its_two_heads_in_training_too():
  """flaxtpu trains no teacher: the distillation head learns the labels through the mean (timm's default,
  distilled_training=False)."""
  model = models.create('deit_ti_distilled', num_classes=3, patch_size=8, pool='tok')
  images = jnp.asarray(_images(2, 16))
  variables = model.init(jax.random.PRNGKey(0), images, train=False)
  params = jax.tree.map(lambda x: x + 0.01, variables['params'])  # heads start at zero
  features = model.apply({'params': params}, images, train=False, capture_intermediates=True,
                         mutable=['intermediates'])[1]['intermediates']
  heads = [features[name]['__call__'][0] for name in ('head', 'head_dist')]
  expected = (heads[0] + heads[1]) / 2
  np.testing.assert_allclose(model.apply({'params': params}, images, train=True), expected, rtol=1e-6)
  with pytest.raises(UserError, match="config.model.pool='gap': DeiT's distilled models read"):
    models.create('deit_ti_distilled', num_classes=3, pool='gap')


@pytest.mark.parametrize('name, options, expected', [
    ('deit_ti_distilled', {'pool': 'tok'}, {'dist': 0.5**14, 'cls': 0.5**14, 'head_dist/kernel': 1.0,
                                            'block1/attention/query/kernel': 0.5**13}),
    ('dinov2_s_reg', {'pool': 'tok'}, {'registers': 0.5**14, 'block12/ls2': 0.5**2, 'block1/ls1': 0.5**13,
                                       'encoder_norm/scale': 0.5**1}),
    ('clip_b', {'pool': 'tok'}, {'norm_pre/scale': 0.5**14, 'embedding/kernel': 0.5**14}),
    ('vit_ti', {'pool': 'map'}, {'map_head/probe': 1.0, 'map_head/attention/key/kernel': 1.0}),
    ('vit_ti', {'pool': 'avg'}, {'fc_norm/scale': 1.0, 'cls': 0.5**14}),
])
def test_layer_decay_places_the_new_parts_as_timms_group_matcher(name, options, expected):
  """Tokens and norm_pre with the embeddings; what the matcher leaves out (fc_norm, attn_pool, head_dist)
  with the head."""
  model = models.create(name, num_classes=10, patch_size=8, **options)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)), train=False))
  multipliers = optim.layer_decay_multipliers(name, params['params'], 0.5)
  assert {key: multipliers[key] for key in expected} == expected


def test_remat_of_a_block_with_layer_scale_gives_the_same_gradients():
  """The block is the remat unit (model.remat wraps it, as for every ViT); layer scale is what DINOv2 adds
  inside it."""
  from flaxtpu.models.nets import vit  # pylint: disable=g-import-not-at-top
  tokens = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 32)), jnp.float32)
  block = lambda unit: unit(4, 64, True, drop_path=0.2, layer_scale=True)
  params = block(vit.EncoderBlock).init(jax.random.PRNGKey(0), tokens)['params']
  assert params['ls1'].shape == (32,) and np.allclose(params['ls2'], 1e-5)
  params = jax.tree.map(lambda x: x + 0.1, params)

  def gradients(unit):
    loss = lambda p: (block(unit).apply({'params': p}, tokens, rngs={'dropout': jax.random.PRNGKey(1)})
                      ** 2).sum()
    return jax.jit(jax.grad(loss))(params)

  flat = lambda tree: np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])
  expected, actual = flat(gradients(vit.EncoderBlock)), flat(gradients(nn.remat(vit.EncoderBlock)))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def _arrays(tensors: dict, name: str, options: dict, size: int) -> dict:
  """flaxtpu's arrays {'params/...': array} of timm `tensors` (as init_from reads them)."""
  model = models.create(name, num_classes=10, **options)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)),
                                                train=False))
  wanted = {f'params/{key}': leaf.shape for key, leaf in optim.named_leaves(variables['params']).items()}
  return layouts.load(pretrained.timm_rules(name, options), tensors, wanted, 'test')


@pytest.mark.parametrize('variant, size', [('deit', 32), ('dinov2_reg', 28), ('clip_quickgelu', 32),
                                           ('siglip_map', 32), ('mae_fc_norm', 32)])
def test_export_to_timm_loads_in_timm_with_the_same_function_and_reads_back_bitwise(variant, size, tmp_path):
  torch, _, timm = import_torch()
  source = _source(variant, size)
  _, _, name, options = VARIANTS[variant]
  options = {'patch_size': source.patch_embed.patch_size[0], 'gelu': 'exact', **options}
  arrays = _arrays(_tensors(source), name, options, size)
  classes = [f'c{index}' for index in range(10)]
  pretrained.write_timm(str(tmp_path), model=name, options=options, arrays=arrays, class_names=classes,
                        mean=(0.5,) * 3, std=(0.5,) * 3, image_shape=(size, size, 3), crop_fraction=1.0,
                        image_size_key=size)
  loaded = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
  images = _images(2, size)
  np.testing.assert_allclose(torch_logits(torch, loaded, images), torch_logits(torch, source, images),
                             rtol=1e-5, atol=1e-5)
  published = pretrained.describe(str(tmp_path))
  assert (published.model, published.options) == (name, options)
  again = _arrays(pretrained.read_tensors(str(tmp_path / 'model.safetensors')), name, options, size)
  assert all(np.array_equal(again[key], arrays[key]) for key in arrays) and set(again) == set(arrays)


def test_a_file_a_timm_folder_and_the_hub_describe_dinov2_with_its_preprocessing(tmp_path, monkeypatch):
  """DINOv2's own preprocessing (ImageNet's mean/std, crop 1.0) at the size its embeddings were trained
  at, from a bare file; a timm folder's config.json says more (QuickGELU) and wins."""
  source = _source('dinov2_reg', 56)
  tensors = _tensors(source)
  save_file(tensors, str(tmp_path / 'dinov2.safetensors'))
  published = pretrained.describe(str(tmp_path / 'dinov2.safetensors'))
  assert (published.model, published.options['pool'], published.num_classes) == ('dinov2_s_reg', 'tok', 10)
  assert (published.mean, published.crop_fraction, published.image_size) == (
      (0.485, 0.456, 0.406), 1.0, 56)
  clip = _tensors(_source('clip', 64))
  folder = tmp_path / 'clip'
  folder.mkdir()
  save_file(clip, str(folder / 'model.safetensors'))
  (folder / 'config.json').write_text(json.dumps({'architecture': 'vit_base_patch32_clip_quickgelu_224',
                                                  'num_classes': 10}))
  home = str(tmp_path / 'hf')
  hub_cache(home, 'timm/clip.test', {name: (folder / name).read_bytes()
                                     for name in ('config.json', 'model.safetensors')})
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  import huggingface_hub.constants  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', os.path.join(home, 'hub'))
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
  for spec in (str(folder), 'hf-hub:timm/clip.test'):
    published = pretrained.describe(spec)
    assert (published.model, published.options['gelu'], published.mean) == (
        'clip_b', 'quick', (0.48145466, 0.4578275, 0.40821073))


def test_a_deit_iii_is_named_as_what_flaxtpu_lacks():
  """Layer scale without registers whose position embeddings skip the class token (timm's deit3_*)."""
  tensors = _tensors(_source('dinov2', 28))
  tensors['pos_embed'] = tensors['pos_embed'][:, 1:]
  with pytest.raises(UserError, match=r'do not cover its 1 prefix tokens .* \(e\.g\. a DeiT III'):
    pretrained.infer_model(tensors, 'test weights')


def test_finetune_a_distilled_deit_from_the_hub_with_fsdp_and_layer_decay_and_export_it(tmp_path):
  """hf-hub DeiT-Ti distilled (trained at 32 px) -> a 2-step fine-tune on a 3-class folder at 48 px (the
  position embeddings resampled), parameters split over 2 devices, layer decay; the export's timm folder
  loads in timm with the SavedModel's logits."""
  torch, _, timm = import_torch()
  from timm.models._hub import save_for_hf  # pylint: disable=g-import-not-at-top

  from conftest import make_image_folder  # pylint: disable=g-import-not-at-top
  saved = tmp_path / 'saved'
  save_for_hf(_source('deit', 32, num_classes=1000), str(saved), safe_serialization=True)
  home = str(tmp_path / 'hf')
  hub_cache(home, 'timm/deit.test', {name: (saved / name).read_bytes()
                                     for name in ('config.json', 'model.safetensors')})
  folder = make_image_folder(tmp_path / 'photos', size=48, train_per_class=8, test_per_class=2)
  workdir = tmp_path / 'run'
  env = {'HF_HOME': home, 'HF_HUB_OFFLINE': '1'}
  result = _cli('--config=configs/finetune.py', f'--workdir={workdir}', f'--config.dataset.folder={folder}',
                '--config.init_from.checkpoint=hf-hub:timm/deit.test', '--config.dataset.image_size=48',
                '--config.num_train_steps=2', '--config.batch_size=8', '--config.cpu_devices=2',
                '--config.mesh.fsdp=2', '--config.mesh.fsdp_min_size=1024',
                '--config.optimizer.layer_decay=0.75', '--config.compilation_cache_dir=none', env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  config = json.loads((workdir / 'config.json').read_text())
  assert (config['model']['name'], config['model']['pool']) == ('deit_ti_distilled', 'tok')
  assert config['dataset']['mean'] == pytest.approx([0.485, 0.456, 0.406])
  result = _cli('--mode=export', f'--workdir={workdir}', *NO_EXTRA_EXPORTS, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((workdir / 'export' / 'export.json').read_text())['timm']['architecture'] == (
      'deit_tiny_distilled_patch16_224')
  test_pretrained.timm_export_computes_the_saved_model(torch, timm, workdir, 2, 48)
