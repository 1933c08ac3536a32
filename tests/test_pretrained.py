"""Published weights: timm, torchvision, big_vision/AugReg and the Hugging Face hub cache, in and out.

Every source model is built here with random weights (no download) and its
logits compared with flaxtpu's on the same images after the import.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from PIL import Image

from flaxtpu import models
from flaxtpu.models import layouts, resnet, vit
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import UserError, join_or
from flaxtpu.transfer import finetune
from flaxtpu.validation import config as config_lib
from flaxtpu.validation import workdir_config
from flaxtpu.weights import pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_torch():
  """torch, torchvision and timm. The x86_64 torchvision wheel beside the CPU build of torch lacks its C
  operators (detection only); its meta registrations are skipped, the classification models work."""
  sys.modules.setdefault('torchvision._meta_registrations',
                         types.ModuleType('torchvision._meta_registrations'))
  torch = pytest.importorskip('torch')
  torchvision = pytest.importorskip('torchvision')
  timm = pytest.importorskip('timm')
  return torch, torchvision, timm


def randomise_batch_norm(torch, model):
  """BatchNorm statistics and affine parameters away from their init, so the import of each counts."""
  generator = torch.Generator().manual_seed(1)
  for module in model.modules():
    if isinstance(module, torch.nn.BatchNorm2d):
      module.running_mean.normal_(0, 0.1, generator=generator)
      module.running_var.uniform_(0.5, 1.5, generator=generator)
      module.weight.data.normal_(1, 0.2, generator=generator)
      module.bias.data.normal_(0, 0.1, generator=generator)
  return model


def randomise_transformer(torch, model):
  """A transformer's weights away from their init, so that its logits depend on the image (at init it
  averages noise images to nearly the same logits, and its layer scales of 1e-5 hide its blocks) and
  reading any tensor wrongly changes them: matrices times 3 (sharper attention), layer scales ~ N(1, 0.2),
  biases, norms and tokens plus N(0, 0.1); the heads' biases stay 0."""
  generator = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, parameter in model.named_parameters():
      if name.startswith('head'):
        continue
      if name.endswith('.gamma'):
        parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
      elif parameter.ndim == 1 or name.endswith(('token', 'latent')):
        parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
      elif parameter.ndim == 2:
        parameter.mul_(3)
  return model


def measure_batch_norm(torch, model, images):
  """Affine BatchNorm parameters away from their init, and running statistics measured on `images`
  (float32 [N, H, W, C]) rather than drawn: random statistics let a deep net's activations explode or
  vanish until its output no longer depends on the input, which hides a wrong import."""
  randomise_batch_norm(torch, model)
  norms = [module for module in model.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]
  for module in norms:
    module.reset_running_stats()
    module.momentum = None  # a cumulative average over the batches seen
  model.train()
  with torch.no_grad():
    for chunk in np.array_split(images, max(1, len(images) // 16)):
      model(torch.from_numpy(np.ascontiguousarray(chunk)).permute(0, 3, 1, 2))
  return model.eval()


def torch_logits(torch, model, images):
  with torch.no_grad():
    return model.eval()(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()


def flaxtpu_logits(tensors, images, model_name=None, **overrides):
  """Imports `tensors` the way init_from does (inferred model, the layout's rules) and applies the model."""
  layout, name, options = pretrained.infer_model(tensors, 'test weights')
  assert model_name in (None, name)
  options.update(overrides)
  model = models.create(name, num_classes=layouts_head(tensors, layout, name), **options)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, *images.shape[1:])),
                                                train=False))
  wanted = {f'{collection}/{key}': leaf.shape for collection in variables
            for key, leaf in traverse_util.flatten_dict(variables[collection], sep='/').items()}
  published = pretrained.Published('test', 'test', layout, name, options, 0, None, (), (), 0, 0.0)
  spec = models.get_spec(name)
  rules = models.layout(name, layout).rules(spec, options, set(tensors))
  adapt = {'params/pos_embedding': lambda array, shape: finetune.resample_position_embeddings(
      array, shape, spec.prefix_tokens(options['pool']))}  # ViTs alone have position embeddings
  loaded = layouts.load(rules, tensors, wanted, 'test weights', adapt)
  assert set(loaded) == set(wanted), set(loaded) ^ set(wanted)
  del published
  tree = {}
  for name_, array in loaded.items():
    collection, key = name_.split('/', 1)
    tree.setdefault(collection, {})[key] = array
  tree = {collection: traverse_util.unflatten_dict(flat, sep='/') for collection, flat in tree.items()}
  return np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(tree, images))


def layouts_head(tensors, layout, name):
  return int(pretrained._head(tensors, layout, name).shape[0])  # pylint: disable=protected-access


def assert_same_function(expected, actual):
  relative = np.abs(actual - expected).max() / np.abs(expected).max()
  assert relative <= 1e-4, relative
  assert (actual.argmax(-1) == expected.argmax(-1)).all()


def _images(count, size, seed=0):
  return np.random.default_rng(seed).normal(size=(count, size, size, 3)).astype(np.float32)


@pytest.mark.parametrize('source, name, size', [
    ('timm:resnet18', 'resnet18', 64),
    ('torchvision:resnet50', 'resnet50', 64),
    ('torchvision:resnet34', 'resnet34', 48),
    ('timm:convnext_tiny', 'convnext_t', 64),
    ('timm:vit_tiny_patch16_224', 'vit_ti', 224),
    ('timm:vit_small_patch32_224', 'vit_s', 224),
])
def test_import_computes_the_source_models_function(source, name, size):
  torch, torchvision, timm = import_torch()
  library, architecture = source.split(':')
  torch.manual_seed(0)
  model = (timm.create_model(architecture) if library == 'timm'
           else getattr(torchvision.models, architecture)())
  images = _images(4, size)
  model = measure_batch_norm(torch, model, _images(16, size, seed=1))
  tensors = {key: value.numpy() for key, value in model.state_dict().items()}
  assert_same_function(torch_logits(torch, model, images), flaxtpu_logits(tensors, images, name))


def test_resnet_same_padding_is_another_function():
  """What model.padding fixes: XLA's SAME pads stride-2 windows one pixel later than PyTorch."""
  torch, _, timm = import_torch()
  torch.manual_seed(0)
  model = randomise_batch_norm(torch, timm.create_model('resnet18'))
  tensors = {key: value.numpy() for key, value in model.state_dict().items()}
  images = _images(4, 64)
  expected = torch_logits(torch, model, images)
  same = flaxtpu_logits(tensors, images, padding='same')
  assert np.abs(same - expected).max() / np.abs(expected).max() > 1e-2


def test_vit_at_another_size_resamples_position_embeddings_as_timm():
  torch, _, timm = import_torch()
  from timm.models.vision_transformer import checkpoint_filter_fn  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  native = timm.create_model('vit_tiny_patch16_224')
  state = native.state_dict()
  for size in (64, 288):
    resized = timm.create_model('vit_tiny_patch16_224', img_size=size)
    resized.load_state_dict(checkpoint_filter_fn(dict(state), resized))  # timm's own resampling
    images = _images(2, size)
    tensors = {key: value.numpy() for key, value in state.items()}
    assert_same_function(torch_logits(torch, resized, images), flaxtpu_logits(tensors, images))


def augreg_npz(state: dict, depth: int, path: str) -> None:
  """A timm ViT's weights written in the AugReg (`vision_transformer`) .npz layout, the inverse of timm's
  own reader, which the test runs to check it."""
  width = state['patch_embed.proj.weight'].shape[0]
  heads = {192: 3, 384: 6, 768: 12}[width]
  arrays = {'embedding/kernel': state['patch_embed.proj.weight'].transpose(2, 3, 1, 0),
            'embedding/bias': state['patch_embed.proj.bias'], 'cls': state['cls_token'],
            'Transformer/posembed_input/pos_embedding': state['pos_embed'],
            'Transformer/encoder_norm/scale': state['norm.weight'],
            'Transformer/encoder_norm/bias': state['norm.bias'],
            'head/kernel': state['head.weight'].T, 'head/bias': state['head.bias']}
  for index in range(depth):
    block, prefix = f'blocks.{index}.', f'Transformer/encoderblock_{index}/'
    qkv_w = state[block + 'attn.qkv.weight'].reshape(3, heads, width // heads, width)
    qkv_b = state[block + 'attn.qkv.bias'].reshape(3, heads, width // heads)
    for part, name in enumerate(('query', 'key', 'value')):
      arrays[f'{prefix}MultiHeadDotProductAttention_1/{name}/kernel'] = qkv_w[part].transpose(2, 0, 1)
      arrays[f'{prefix}MultiHeadDotProductAttention_1/{name}/bias'] = qkv_b[part]
    arrays[f'{prefix}MultiHeadDotProductAttention_1/out/kernel'] = (
        state[block + 'attn.proj.weight'].T.reshape(heads, width // heads, width))
    arrays[f'{prefix}MultiHeadDotProductAttention_1/out/bias'] = state[block + 'attn.proj.bias']
    for norm, name in (('norm1', 'LayerNorm_0'), ('norm2', 'LayerNorm_2')):
      arrays[f'{prefix}{name}/scale'], arrays[f'{prefix}{name}/bias'] = (state[f'{block}{norm}.weight'],
                                                                        state[f'{block}{norm}.bias'])
    for fc, dense in (('fc1', 'Dense_0'), ('fc2', 'Dense_1')):
      arrays[f'{prefix}MlpBlock_3/{dense}/kernel'] = state[f'{block}mlp.{fc}.weight'].T
      arrays[f'{prefix}MlpBlock_3/{dense}/bias'] = state[f'{block}mlp.{fc}.bias']
  np.savez(path, **arrays)


def siglip_npz(state: dict, depth: int, path: str) -> None:
  """A timm ViT with attention pooling (global_pool='map', no class token) written as big_vision writes a
  SigLIP: the image tower under params/img/ (pos_embedding at its top, the blocks stacked along axis 0 as
  its scan does, MlpBlock_0, LayerNorm_1, MAPHead_0), beside a text tower and the loss's t and b, which
  no ViT reads. The inverse of timm's own reader, which the tests run to check it."""
  width = state['patch_embed.proj.weight'].shape[0]
  heads = {192: 3, 384: 6, 768: 12, 1024: 16}[width]
  split = lambda w: w.reshape(-1, heads, width // heads, width).transpose(0, 3, 1, 2)  # [parts, width, h, d]
  out_kernel = lambda w: w.T.reshape(heads, width // heads, width)
  arrays = {'embedding/kernel': state['patch_embed.proj.weight'].transpose(2, 3, 1, 0),
            'embedding/bias': state['patch_embed.proj.bias'], 'pos_embedding': state['pos_embed'],
            'Transformer/encoder_norm/scale': state['norm.weight'],
            'Transformer/encoder_norm/bias': state['norm.bias'],
            'head/kernel': state['head.weight'].T, 'head/bias': state['head.bias'],
            'MAPHead_0/probe': state['attn_pool.latent'],
            'MAPHead_0/LayerNorm_0/scale': state['attn_pool.norm.weight'],
            'MAPHead_0/LayerNorm_0/bias': state['attn_pool.norm.bias'],
            'MAPHead_0/MultiHeadDotProductAttention_0/out/kernel': out_kernel(state['attn_pool.proj.weight']),
            'MAPHead_0/MultiHeadDotProductAttention_0/out/bias': state['attn_pool.proj.bias']}
  for source, names in (('q', ('query',)), ('kv', ('key', 'value'))):
    kernels = split(state[f'attn_pool.{source}.weight'])
    biases = state[f'attn_pool.{source}.bias'].reshape(len(names), heads, width // heads)
    for part, name in enumerate(names):
      arrays[f'MAPHead_0/MultiHeadDotProductAttention_0/{name}/kernel'] = kernels[part]
      arrays[f'MAPHead_0/MultiHeadDotProductAttention_0/{name}/bias'] = biases[part]
  for fc, dense in (('fc1', 'Dense_0'), ('fc2', 'Dense_1')):
    arrays[f'MAPHead_0/MlpBlock_0/{dense}/kernel'] = state[f'attn_pool.mlp.{fc}.weight'].T
    arrays[f'MAPHead_0/MlpBlock_0/{dense}/bias'] = state[f'attn_pool.mlp.{fc}.bias']
  blocks = {}
  for index in range(depth):
    block = lambda name, i=index: state[f'blocks.{i}.{name}']
    qkv = split(block('attn.qkv.weight'))
    qkv_b = block('attn.qkv.bias').reshape(3, heads, width // heads)
    layer = {'LayerNorm_0/scale': block('norm1.weight'), 'LayerNorm_0/bias': block('norm1.bias'),
             'LayerNorm_1/scale': block('norm2.weight'), 'LayerNorm_1/bias': block('norm2.bias'),
             'MultiHeadDotProductAttention_0/out/kernel': out_kernel(block('attn.proj.weight')),
             'MultiHeadDotProductAttention_0/out/bias': block('attn.proj.bias')}
    for part, name in enumerate(('query', 'key', 'value')):
      layer[f'MultiHeadDotProductAttention_0/{name}/kernel'] = qkv[part]
      layer[f'MultiHeadDotProductAttention_0/{name}/bias'] = qkv_b[part]
    for fc, dense in (('fc1', 'Dense_0'), ('fc2', 'Dense_1')):
      layer[f'MlpBlock_0/{dense}/kernel'] = block(f'mlp.{fc}.weight').T
      layer[f'MlpBlock_0/{dense}/bias'] = block(f'mlp.{fc}.bias')
    for name, value in layer.items():
      blocks.setdefault(name, []).append(value)
  arrays.update({f'Transformer/encoderblock/{name}': np.stack(values) for name, values in blocks.items()})
  np.savez(path, **{f'params/img/{name}': value for name, value in arrays.items()},
           **{'params/txt/Embed_0/embedding': np.zeros((8, 4), np.float32),
              'params/t': np.ones(1, np.float32), 'params/b': np.zeros(1, np.float32)})


def test_big_vision_npz_imports_with_tanh_gelu(tmp_path):
  torch, _, timm = import_torch()
  torch.manual_seed(0)
  source = timm.create_model('vit_tiny_patch16_224', act_layer='gelu_tanh')  # AugReg trained with tanh GELU
  state = {key: value.numpy() for key, value in source.state_dict().items()}
  path = str(tmp_path / 'Ti_16.npz')
  augreg_npz(state, 12, path)
  check = timm.create_model('vit_tiny_patch16_224', act_layer='gelu_tanh')
  check.load_pretrained(path)  # timm's reader of the layout agrees with the writer above
  assert all(torch.equal(check.state_dict()[key], value) for key, value in source.state_dict().items())

  tensors = pretrained.read_tensors(path)
  layout, name, options = pretrained.infer_model(tensors, path)
  assert (layout, name, options) == ('big_vision', 'vit_ti',
                                     {'patch_size': 16, 'pool': 'tok', 'gelu': 'tanh'})
  images = _images(2, 224)
  assert_same_function(torch_logits(torch, source, images), flaxtpu_logits(tensors, images))


def test_a_file_of_another_model_names_the_first_tensor_and_both_shapes(tmp_path):
  torch, _, timm = import_torch()
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / 'resnet18.safetensors')
  save_file(timm.create_model('resnet18').state_dict(), path)
  published = pretrained.describe(path)
  assert (published.model, published.num_classes, published.image_size) == ('resnet18', 1000, 224)
  spec = models.get_spec('resnet50')
  wanted = {'params/stage1_block1/Conv_0/kernel': (1, 1, 64, 64)}
  with pytest.raises(UserError, match=r"tensor 'layer1.0.conv1.weight' has shape \(64, 64, 3, 3\).*"
                                      r"needs \(1, 1, 64, 64\)"):
    layouts.load(resnet.resnet_rules(spec.stage_sizes, True), pretrained.read_tensors(path), wanted, path)
  with pytest.raises(UserError, match=r"no tensor 'layer1.2.conv1.weight'"):
    spec = models.get_spec('resnet34')
    layouts.load(resnet.resnet_rules(spec.stage_sizes, False), pretrained.read_tensors(path),
                 {'params/stage1_block3/Conv_0/kernel': (3, 3, 64, 64)}, path)
  broken = tmp_path / 'broken.safetensors'
  broken.write_bytes(b'not a safetensors file')
  with pytest.raises(UserError, match='cannot be read as .safetensors'):
    pretrained.read_tensors(str(broken))


def timm_export_computes_the_saved_model(torch, timm, workdir, count: int, size: int):
  """timm's model from WORKDIR/export/timm (`timm.create_model('local-dir:...')`), asserted to compute the
  exported SavedModel's logits on `count` random uint8 images of `size` px (normalised by its config.json's
  mean/std) to 1e-4 relative; returned for further checks."""
  model = timm.create_model(f'local-dir:{workdir}/export/timm', pretrained=True).eval()
  images = np.random.default_rng(1).integers(0, 256, (count, size, size, 3)).astype(np.uint8)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  saved_model = tf.saved_model.load(os.path.join(str(workdir), 'export', 'saved_model'))
  serve = saved_model.signatures['serving_default']
  expected = serve(images=tf.constant(images))['logits'].numpy()
  mean, std = np.array(model.pretrained_cfg['mean']), np.array(model.pretrained_cfg['std'])
  actual = torch_logits(torch, model, ((images / 255.0 - mean) / std).astype(np.float32))
  assert np.abs(actual - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
  return model


def hub_cache(home, repo: str, files: dict) -> None:
  """`files` ({name: bytes}) laid out as huggingface_hub caches a download of `repo` under HF_HOME=`home`."""
  folder = os.path.join(home, 'hub', 'models--' + repo.replace('/', '--'))
  commit = hashlib.sha1(repo.encode()).hexdigest()
  os.makedirs(os.path.join(folder, 'refs'), exist_ok=True)
  with open(os.path.join(folder, 'refs', 'main'), 'w') as f:
    f.write(commit)
  os.makedirs(os.path.join(folder, 'blobs'), exist_ok=True)
  os.makedirs(os.path.join(folder, 'snapshots', commit), exist_ok=True)
  for name, content in files.items():
    blob = hashlib.sha256(content).hexdigest()
    with open(os.path.join(folder, 'blobs', blob), 'wb') as f:
      f.write(content)
    os.symlink(os.path.join('..', '..', 'blobs', blob), os.path.join(folder, 'snapshots', commit, name))


@pytest.fixture(scope='module')
def resnet18_hub(tmp_path_factory):
  """HF_HOME with hf-hub:timm/resnet18.test cached as timm publishes it (model.safetensors + config.json),
  a 224 px photo, and timm's top-5 for it."""
  torch, _, timm = import_torch()
  from timm.models._hub import save_for_hf  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = randomise_batch_norm(torch, timm.create_model('resnet18'))
  folder = tmp_path_factory.mktemp('saved')
  save_for_hf(model, str(folder), safe_serialization=True,
              data_config={'input_size': (3, 224, 224), 'crop_pct': 1.0, 'interpolation': 'bicubic',
                           'mean': (0.485, 0.456, 0.406), 'std': (0.229, 0.224, 0.225)})
  home = str(tmp_path_factory.mktemp('hf_home'))
  hub_cache(home, 'timm/resnet18.test', {name: (folder / name).read_bytes()
                                         for name in ('config.json', 'model.safetensors')})
  photo = str(tmp_path_factory.mktemp('photo') / 'photo.png')
  pixels = np.random.default_rng(0).integers(0, 256, (224, 224, 3)).astype(np.uint8)
  Image.fromarray(pixels).save(photo)
  mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
  logits = torch_logits(torch, model, ((pixels / 255.0 - mean) / std)[None].astype(np.float32))[0]
  probabilities = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
  return home, photo, np.argsort(-probabilities)[:5], probabilities


# An export test about the timm folder or the SavedModel skips ONNX and the quantized TFLite models
# (test_onnx and test_deploy test those): each adds 10-30 s per export.
NO_EXTRA_EXPORTS = ('--config.export.onnx=false', '--config.export.quantize=()')


def _cli(*args, env=None, timeout=900):
  environment = {**os.environ, **(env or {})}
  return subprocess.run([sys.executable, '-m', 'flaxtpu.main', *args], capture_output=True, text=True,
                        cwd=ROOT, env=environment, timeout=timeout)


def predict_top5_from_the_hub(tmp_path, home: str, checkpoint: str, photo, top5):
  """--mode=predict of `photo` with the published head of `checkpoint` from the offline hub cache `home`:
  asserts its five classes are ImageNet's `top5` -> (the CSV row, the finished process)."""
  output = tmp_path / 'predictions.csv'
  result = _cli('--mode=predict', f'--config.init_from.checkpoint={checkpoint}',
                f'--config.predict.input={photo}', '--config.predict.top_k=5',
                f'--config.predict.output_csv={output}', env={'HF_HOME': home, 'HF_HUB_OFFLINE': '1'})
  assert result.returncode == 0, result.stderr[-2000:]
  names = pretrained.imagenet_class_names()
  import csv  # pylint: disable=g-import-not-at-top
  with open(output, newline='') as f:
    (row,) = list(csv.DictReader(f))
  assert [row[f'class_{rank}'] for rank in range(1, 6)] == [names[index] for index in top5]
  return row, result


def test_hub_cache_offline_predicts_the_published_head(resnet18_hub, tmp_path):
  home, photo, top5, probabilities = resnet18_hub
  row, result = predict_top5_from_the_hub(tmp_path, home, 'hf-hub:timm/resnet18.test', photo, top5)
  names = pretrained.imagenet_class_names()
  assert float(row['probability_1']) == pytest.approx(probabilities[top5[0]], rel=1e-3)
  assert f'{names[top5[0]]} {probabilities[top5[0]]:.3f}' in result.stdout


def test_hub_name_not_cached_offline_fails_fast_in_one_line(tmp_path):
  for env in ({'HF_HUB_OFFLINE': '1'}, {'HF_ENDPOINT': 'http://127.0.0.1:9', 'HF_HUB_OFFLINE': '0'}):
    started = time.monotonic()
    result = _cli('--mode=predict', '--config.init_from.checkpoint=hf-hub:timm/resnet50.a1_in1k',
                  f'--config.predict.input={tmp_path}', env={'HF_HOME': str(tmp_path / 'hf'), **env})
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith('error: ')
            and 'hf download timm/resnet50.a1_in1k' in lines[0])
    assert elapsed < 10, elapsed


def test_published_defaults_fill_only_what_the_config_left_open(resnet18_hub, monkeypatch):
  home, _, _, _ = resnet18_hub
  monkeypatch.setenv('HF_HOME', home)
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  import huggingface_hub.constants  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', os.path.join(home, 'hub'))
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
  pretrained.describe.cache_clear()
  config = defaults.get_config()
  config.init_from.checkpoint = 'hf-hub:timm/resnet18.test'
  config.dataset.image_size = 64  # set by the user: kept
  assert pretrained.apply_defaults(config)
  assert config.model.name == 'resnet18' and config.model.padding == 'torch'
  assert config.dataset.normalize == 'fixed'
  assert tuple(config.dataset.mean) == pytest.approx((0.485, 0.456, 0.406))
  assert (config.dataset.image_size, config.dataset.crop_fraction) == (64, 1.0)
  config_lib.validate(config)


def test_runs_saved_before_the_variants_keep_their_function():
  saved = defaults.get_config().to_dict()
  for key in ('padding', 'gelu'):
    del saved['model'][key]
  saved['model']['name'] = 'resnet18'
  assert workdir_config.from_saved(saved).model.padding == 'same'
  saved['model']['name'] = 'vit_s'
  restored = workdir_config.from_saved(saved)
  assert (restored.model.gelu, restored.model.padding) == ('tanh', 'torch')  # padding: not a ViT option
  saved_today = json.loads(json.dumps(defaults.get_config().to_dict()))
  assert workdir_config.from_saved(saved_today).model.gelu == 'exact'


def test_finetune_from_the_hub_records_preprocessing_and_exports_to_timm(resnet18_hub, tmp_path):
  """hf-hub ResNet-18 -> a 2-step fine-tune on a 3-class folder at 32 px: the hub's preprocessing is the run's
  (config.json, checkpoint, eval); the export's timm folder loads in timm with the SavedModel's logits, and
  init_from reads it back to the same arrays."""
  torch, _, timm = import_torch()
  from conftest import make_image_folder  # pylint: disable=g-import-not-at-top
  home = resnet18_hub[0]
  env = {'HF_HOME': home, 'HF_HUB_OFFLINE': '1'}
  folder = make_image_folder(tmp_path / 'photos', size=40)
  workdir = tmp_path / 'run'
  result = _cli('--config=configs/finetune.py', f'--workdir={workdir}', f'--config.dataset.folder={folder}',
                '--config.init_from.checkpoint=hf-hub:timm/resnet18.test', '--config.dataset.image_size=32',
                '--config.num_train_steps=2', '--config.batch_size=8', '--config.cpu_devices=2',
                '--config.compilation_cache_dir=none', env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['model']['name'] == 'resnet18' and saved['dataset']['normalize'] == 'fixed'
  assert saved['dataset']['mean'] == pytest.approx([0.485, 0.456, 0.406])
  assert (saved['dataset']['image_size'], saved['dataset']['crop_fraction']) == (32, 1.0)
  results = json.loads((workdir / 'results.json').read_text())

  result = _cli('--mode=eval', f'--workdir={workdir}', env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  evaluation = json.loads((workdir / 'eval.json').read_text())
  assert evaluation['eval_accuracy'] == pytest.approx(results['eval_accuracy'])

  result = _cli('--mode=export', f'--workdir={workdir}', *NO_EXTRA_EXPORTS, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  exported = json.loads((workdir / 'export' / 'export.json').read_text())
  assert exported['timm']['architecture'] == 'resnet18'
  assert exported['normalization']['mean'] == pytest.approx([0.485, 0.456, 0.406])

  model = timm_export_computes_the_saved_model(torch, timm, workdir, 4, 32)
  assert model.num_classes == 3 and model.pretrained_cfg['mean'] == pytest.approx((0.485, 0.456, 0.406))

  published = pretrained.describe(str(workdir / 'export' / 'timm'))
  assert ((published.model, published.num_classes, published.class_names)
          == ('resnet18', 3, ('cat', 'dog', 'frog')))


def test_an_rgb_first_layer_sees_gray_images_as_the_rgb_model_does():
  kernel = np.random.default_rng(0).normal(size=(7, 7, 3, 64)).astype(np.float32)
  gray = finetune.to_one_channel(kernel, (7, 7, 1, 64))
  assert gray.shape == (7, 7, 1, 64)
  image = np.random.default_rng(1).normal(size=(1, 7, 7, 1)).astype(np.float32)
  as_rgb = np.einsum('nhwc,hwco->no', np.repeat(image, 3, axis=-1), kernel)
  np.testing.assert_allclose(np.einsum('nhwc,hwco->no', image, gray), as_rgb, rtol=1e-5)
  assert finetune.to_one_channel(kernel, (5, 5, 1, 64)).shape == kernel.shape  # other mismatches left to load



# --- files that do not hold exactly the model they are read as ------------------------------------


@pytest.fixture(scope='module')
def resnet18_state():
  """timm's resnet18 state dict (num_batches_tracked included) as numpy arrays."""
  torch, _, timm = import_torch()
  torch.manual_seed(0)
  model = randomise_batch_norm(torch, timm.create_model('resnet18'))
  return {key: value.numpy().copy() for key, value in model.state_dict().items()}


def _saved(tmp_path, name, tensors):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / f'{name}.safetensors')
  save_file(tensors, path)
  return path


def _exactly(line: str) -> str:
  """The pattern of one whole line."""
  return f'^{re.escape(line)}$'


def test_a_file_with_tensors_the_model_has_no_place_for_is_not_read_in_part(resnet18_state, tmp_path):
  """An SE-ResNet-18 is not read as a ResNet-18 without its squeeze-excitation; nor is any extra tensor."""
  torch, _, timm = import_torch()
  assert pretrained.describe(_saved(tmp_path, 'resnet18', resnet18_state)).model == 'resnet18'  # counters ok
  torch.manual_seed(0)
  se = {key: value.numpy() for key, value in timm.create_model('seresnet18').state_dict().items()}
  path = _saved(tmp_path, 'seresnet18', se)
  with pytest.raises(UserError, match=_exactly(
      f'{path} looks like an SE-ResNet or SE-ResNeXt (squeeze-excitation) (its layer1.0.se.* tensors), which '
      f'flaxtpu has no model for; supported: {pretrained._supported()}')):  # pylint: disable=protected-access
    pretrained.describe(path)
  path = _saved(tmp_path, 'extra', {**resnet18_state, 'extra.weight': np.ones(3, np.float32)})
  with pytest.raises(UserError, match=_exactly(
      f"{path} holds 1 tensor that resnet18 (timm's layout) has no place for ('extra.weight'): it is another "
      'architecture or a variant (extra.*) that flaxtpu has no model for; read without them it would compute '
      'another function')):
    pretrained.describe(path)


def test_a_non_finite_tensor_is_named(resnet18_state):
  """One NaN in a BatchNorm statistic, two Infs in a kernel: timm computes NaN, flaxtpu refuses the file."""
  images = _images(1, 32)
  nan = dict(resnet18_state)
  nan['layer1.0.bn1.running_mean'] = nan['layer1.0.bn1.running_mean'].copy()
  nan['layer1.0.bn1.running_mean'][3] = np.nan
  with pytest.raises(UserError, match=_exactly(
      "test weights: tensor 'layer1.0.bn1.running_mean' holds 1 NaN/Inf value (of 64); the file is damaged "
      'or was saved from a diverged model: use another copy of the weights')):
    flaxtpu_logits(nan, images)
  inf = dict(resnet18_state)
  inf['layer3.1.conv2.weight'] = inf['layer3.1.conv2.weight'].copy()
  inf['layer3.1.conv2.weight'][0, 0, :, 0] = [np.inf, -np.inf, 1.0]
  with pytest.raises(UserError, match=re.escape("tensor 'layer3.1.conv2.weight' holds 2 NaN/Inf values "
                                                '(of 589824)')):
    flaxtpu_logits(inf, images)


def test_a_headless_file_trains_a_new_head_but_cannot_predict_or_keep_its_head(resnet18_state, tmp_path):
  """timm's num_classes=0: no fc.*. A run that trains a new head reads the rest; predict, eval, a
  distillation teacher (finetune.published_model) and keep_head need the head: one line each."""
  path = _saved(tmp_path, 'headless', {key: value for key, value in resnet18_state.items()
                                       if not key.startswith('fc.')})
  published = pretrained.describe(path)
  assert (published.model, published.num_classes, published.class_names, published.head) == (
      'resnet18', 0, None, 'fc.bias')
  config = defaults.get_config()
  config.init_from.checkpoint = path
  assert pretrained.apply_defaults(config) and config.model.name == 'resnet18'
  model = models.create('resnet18', num_classes=5, padding='torch')
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False))
  wanted = {f'{collection}/{key}': leaf.shape for collection in shapes
            for key, leaf in traverse_util.flatten_dict(shapes[collection], sep='/').items()
            if not key.startswith('Dense_0')}  # init_from's new head
  arrays = finetune._published_arrays(config, published, wanted)  # pylint: disable=protected-access
  assert set(arrays) == set(wanted)
  np.testing.assert_array_equal(arrays['params/Conv_0/kernel'],
                                resnet18_state['conv1.weight'].transpose(2, 3, 1, 0))
  with pytest.raises(UserError, match=_exactly(
      f"{path} has no classifier (no tensor 'fc.bias': a headless checkpoint, as timm saves with "
      'num_classes=0), so it cannot score images as it is; fine-tune it on labelled images first (train with '
      'init_from: a new head is trained)')):
    finetune.published_model(config)
  config.init_from.keep_head = True
  with pytest.raises(UserError, match=_exactly(
      f"config.init_from.keep_head=True keeps the head of {path}, but it has none (no tensor 'fc.bias': a "
      'headless checkpoint, as timm saves with num_classes=0); drop keep_head to train a new head for the '
      "data's classes")):
    finetune._init_from_published(config, None, None, None, ())  # pylint: disable=protected-access


def test_a_missing_tensor_is_named(resnet18_state, tmp_path):
  for deleted in ('layer2.1.conv2.weight', 'layer4.1.conv1.weight', 'bn1.running_var', 'fc.weight'):
    path = _saved(tmp_path, deleted, {key: value for key, value in resnet18_state.items() if key != deleted})
    with pytest.raises(UserError, match=_exactly(
        f"{path} lacks tensor '{deleted}' of resnet18 (timm's layout), which its other tensors are: the file "
        'is incomplete or damaged; download it again or save the whole model.state_dict()')):
      pretrained.describe(path)


@pytest.mark.parametrize('library, architecture, named', [
    ('timm', 'seresnet18', 'an SE-ResNet or SE-ResNeXt (squeeze-excitation) (its layer1.0.se.* tensors)'),
    ('timm', 'mobilenetv2_100',
     'a timm MobileNetV2 or another EfficientNet-like net (its conv_stem.* tensors)'),
    ('torchvision', 'mobilenet_v2', 'a torchvision MobileNetV2 (its features.1.conv.* tensors)'),
])
def test_a_file_of_another_architecture_is_named_as_what_it_is(library, architecture, named):
  torch, torchvision, timm = import_torch()
  model = (timm.create_model(architecture) if library == 'timm'
           else getattr(torchvision.models, architecture)())
  tensors = {key: value.numpy() for key, value in model.state_dict().items()}
  supported = join_or([f'{family.title} ({family.listed()})' for family in models.families()
                       if family.layouts])
  assert supported.startswith('ResNet (resnet18-152')
  with pytest.raises(UserError, match=_exactly(
      f"test weights looks like {named}, which flaxtpu has no model for; supported: {supported} in timm's, "
      "torchvision's or big_vision's layout")):
    pretrained.infer_model(tensors, 'test weights')


def test_a_big_vision_checkpoint_may_hold_more_than_its_vit_outside_the_vit_prefix():
  """Its optimizer's state and a text tower are no tensors of the ViT; under the ViT's prefix all are."""
  keys = {'params/img/embedding/kernel', 'params/img/head/bias', 'params/txt/Embed_0/embedding', 'opt/mu/x'}
  assert vit.BIG_VISION.unread(keys) == {'params/txt/Embed_0/embedding', 'opt/mu/x'}
  assert vit.BIG_VISION.unread({'embedding/kernel', 'pre_logits/kernel'}) == set()
  assert vit.BIG_VISION.head({'params/img/embedding/kernel'}) == 'params/img/head/bias'  # even headless


def test_a_file_of_another_model_than_the_named_one_is_one_line(resnet18_state, tmp_path):
  """model.name=resnet34 named with a resnet18 file: read in part it would compute neither (issue 43)."""
  path = _saved(tmp_path, 'resnet18', resnet18_state)
  config = defaults.get_config()
  config.init_from.checkpoint = path
  config.model.name = 'resnet34'
  assert pretrained.apply_defaults(config) and config.model.name == 'resnet34'  # the user's choice is kept
  with pytest.raises(UserError, match=_exactly(
      f"config.init_from.checkpoint={path!r} holds resnet18 but config.model.name='resnet34'; drop "
      "model.name (the weights' model is used) or give resnet34 weights")):
    finetune._published_arrays(config, pretrained.describe(path), {})  # pylint: disable=protected-access
