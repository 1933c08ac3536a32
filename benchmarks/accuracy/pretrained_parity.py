"""Published weights, imported: flaxtpu's logits against the source framework's on the same images.

    python -m benchmarks.accuracy.pretrained_parity  # every architecture and layout, 256 images each
    python -m benchmarks.accuracy.pretrained_parity --images 32 --only resnet18

Each source model is built locally with random weights (no download; BatchNorm statistics measured
on images, not drawn): timm's
ResNets, ViTs (DeiT, DINOv2, CLIP, SigLIP too) and ConvNeXt, torchvision's ResNets, and big_vision/AugReg .npz
files (SigLIP's too) written from a timm ViT built with the tanh GELU. The weights go
through the path a user's do: a .safetensors/.npz file named by
`init_from.checkpoint`, `finetune.published_model` (model inferred, mapped,
normalisation from the source) and `modes.predict.predict_logits` on uint8 images;
the source model sees the same uint8 images normalised by the same numbers.
ViTs and Swins are also compared at a second size against timm's own resampling
of their position embeddings / relative position tables, ConvNeXts at 176 px
(odd maps). Prints max |logit difference|, that difference relative to the
largest logit, and top-1 agreement; writes JSON to --out-dir.
"""

import argparse
import copy
import importlib
import json
import os
import sys
import tempfile
import time
import types

from benchmarks.shared import harness

# (label, library, architecture, flaxtpu model, native size, a second size or None)
CASES = [
    ('resnet18 timm', 'timm', 'resnet18', 'resnet18', 224, None),
    ('resnet50 timm', 'timm', 'resnet50', 'resnet50', 224, None),
    ('resnet18 torchvision', 'torchvision', 'resnet18', 'resnet18', 224, None),
    ('resnet34 torchvision', 'torchvision', 'resnet34', 'resnet34', 224, None),
    ('resnet50 torchvision', 'torchvision', 'resnet50', 'resnet50', 224, None),
    ('vit_ti/16 timm', 'timm', 'vit_tiny_patch16_224', 'vit_ti', 224, 384),
    ('vit_s/16 timm', 'timm', 'vit_small_patch16_224', 'vit_s', 224, 64),
    ('vit_s/32 timm', 'timm', 'vit_small_patch32_224', 'vit_s', 224, 384),
    ('vit_b/16 timm', 'timm', 'vit_base_patch16_224', 'vit_b', 224, None),
    ('vit_b/32 timm', 'timm', 'vit_base_patch32_224', 'vit_b', 224, None),
    ('vit_ti/16 big_vision npz', 'npz', 'vit_tiny_patch16_224', 'vit_ti', 224, 384),
    ('vit_s/16 big_vision npz', 'npz', 'vit_small_patch16_224', 'vit_s', 224, None),
    ('vit_b/16 big_vision npz', 'npz', 'vit_base_patch16_224', 'vit_b', 224, None),
    ('convnext_t timm', 'timm', 'convnext_tiny', 'convnext_t', 224, None),
    # EfficientNet and MobileNetV3 at 224 px and at 200 (not a multiple of 32); tf: timm's TensorFlow ports
    # (model.padding=same, as a bare file of one needs)
    ('efficientnet_b0 timm', 'timm', 'efficientnet_b0', 'efficientnet_b0', 224, 200),
    ('efficientnet_b0 tf timm', 'timm', 'tf_efficientnet_b0', 'efficientnet_b0', 224, 200),
    ('efficientnet_b0 torchvision', 'torchvision', 'efficientnet_b0', 'efficientnet_b0', 224, 200),
    ('efficientnet_b1 timm', 'timm', 'efficientnet_b1', 'efficientnet_b1', 224, 200),
    ('efficientnet_b1 tf timm', 'timm', 'tf_efficientnet_b1', 'efficientnet_b1', 224, 200),
    ('efficientnet_b1 torchvision', 'torchvision', 'efficientnet_b1', 'efficientnet_b1', 224, 200),
    ('efficientnet_b2 timm', 'timm', 'efficientnet_b2', 'efficientnet_b2', 224, 200),
    ('efficientnet_b2 tf timm', 'timm', 'tf_efficientnet_b2', 'efficientnet_b2', 224, 200),
    ('efficientnet_b2 torchvision', 'torchvision', 'efficientnet_b2', 'efficientnet_b2', 224, 200),
    ('efficientnet_b3 timm', 'timm', 'efficientnet_b3', 'efficientnet_b3', 224, 200),
    ('efficientnet_b3 tf timm', 'timm', 'tf_efficientnet_b3', 'efficientnet_b3', 224, 200),
    ('efficientnet_b3 torchvision', 'torchvision', 'efficientnet_b3', 'efficientnet_b3', 224, 200),
    ('efficientnet_b4 timm', 'timm', 'efficientnet_b4', 'efficientnet_b4', 224, 200),
    ('efficientnet_b4 tf timm', 'timm', 'tf_efficientnet_b4', 'efficientnet_b4', 224, 200),
    ('efficientnet_b4 torchvision', 'torchvision', 'efficientnet_b4', 'efficientnet_b4', 224, 200),
    ('efficientnet_b5 timm', 'timm', 'efficientnet_b5', 'efficientnet_b5', 224, 200),
    ('efficientnet_b5 tf timm', 'timm', 'tf_efficientnet_b5', 'efficientnet_b5', 224, 200),
    ('efficientnet_b5 torchvision', 'torchvision', 'efficientnet_b5', 'efficientnet_b5', 224, 200),
    ('efficientnet_b6 timm', 'timm', 'efficientnet_b6', 'efficientnet_b6', 224, 200),
    ('efficientnet_b6 tf timm', 'timm', 'tf_efficientnet_b6', 'efficientnet_b6', 224, 200),
    ('efficientnet_b6 torchvision', 'torchvision', 'efficientnet_b6', 'efficientnet_b6', 224, 200),
    ('efficientnet_b7 timm', 'timm', 'efficientnet_b7', 'efficientnet_b7', 224, 200),
    ('efficientnet_b7 tf timm', 'timm', 'tf_efficientnet_b7', 'efficientnet_b7', 224, 200),
    ('efficientnet_b7 torchvision', 'torchvision', 'efficientnet_b7', 'efficientnet_b7', 224, 200),
    ('mobilenetv3_l timm', 'timm', 'mobilenetv3_large_100', 'mobilenetv3_l', 224, 200),
    ('mobilenetv3_l tf timm', 'timm', 'tf_mobilenetv3_large_100', 'mobilenetv3_l', 224, 200),
    ('mobilenetv3_l torchvision', 'torchvision', 'mobilenet_v3_large', 'mobilenetv3_l', 224, 200),
    ('mobilenetv3_s timm', 'timm', 'mobilenetv3_small_100', 'mobilenetv3_s', 224, 200),
    ('mobilenetv3_s tf timm', 'timm', 'tf_mobilenetv3_small_100', 'mobilenetv3_s', 224, 200),
    ('mobilenetv3_s torchvision', 'torchvision', 'mobilenet_v3_small', 'mobilenetv3_s', 224, 200),
    ('convnext_t timm', 'timm', 'convnext_tiny', 'convnext_t', 224, 176),
    ('convnext_s timm', 'timm', 'convnext_small', 'convnext_s', 224, 176),
    ('convnext_b timm', 'timm', 'convnext_base', 'convnext_b', 224, 176),
    ('convnext_l timm', 'timm', 'convnext_large', 'convnext_l', 224, 176),
    ('swin_t timm', 'timm', 'swin_tiny_patch4_window7_224', 'swin_t', 224, 176),
    ('swin_s timm', 'timm', 'swin_small_patch4_window7_224', 'swin_s', 224, 176),
    ('swin_b timm', 'timm', 'swin_base_patch4_window7_224', 'swin_b', 224, 200),
    # The deepest last: each costs what three of the others do on a CPU.
    ('resnet101 torchvision', 'torchvision', 'resnet101', 'resnet101', 224, None),
    ('resnet152 torchvision', 'torchvision', 'resnet152', 'resnet152', 224, None),
    # ResNet-D, ResNeXt, wide ResNets and RegNets: also at 176 px (not a multiple of 32)
    ('resnet18d timm', 'timm', 'resnet18d', 'resnet18d', 224, 176),
    ('resnet34d timm', 'timm', 'resnet34d', 'resnet34d', 224, 176),
    ('resnet50d timm', 'timm', 'resnet50d', 'resnet50d', 224, 176),
    ('resnet101d timm', 'timm', 'resnet101d', 'resnet101d', 224, 176),
    ('resnet152d timm', 'timm', 'resnet152d', 'resnet152d', 224, 176),
    ('resnext50_32x4d timm', 'timm', 'resnext50_32x4d', 'resnext50_32x4d', 224, 176),
    ('resnext50_32x4d torchvision', 'torchvision', 'resnext50_32x4d', 'resnext50_32x4d', 224, 176),
    ('resnext101_32x4d timm', 'timm', 'resnext101_32x4d', 'resnext101_32x4d', 224, 176),
    ('resnext101_32x8d timm', 'timm', 'resnext101_32x8d', 'resnext101_32x8d', 224, 176),
    ('resnext101_32x8d torchvision', 'torchvision', 'resnext101_32x8d', 'resnext101_32x8d', 224, 176),
    ('resnext101_64x4d timm', 'timm', 'resnext101_64x4d', 'resnext101_64x4d', 224, 176),
    ('resnext101_64x4d torchvision', 'torchvision', 'resnext101_64x4d', 'resnext101_64x4d', 224, 176),
    ('wide_resnet50_2 timm', 'timm', 'wide_resnet50_2', 'wide_resnet50_2', 224, 176),
    ('wide_resnet50_2 torchvision', 'torchvision', 'wide_resnet50_2', 'wide_resnet50_2', 224, 176),
    ('wide_resnet101_2 timm', 'timm', 'wide_resnet101_2', 'wide_resnet101_2', 224, 176),
    ('wide_resnet101_2 torchvision', 'torchvision', 'wide_resnet101_2', 'wide_resnet101_2', 224, 176),
    ('regnetx_002 timm', 'timm', 'regnetx_002', 'regnetx_002', 224, 176),
    ('regnetx_004 timm', 'timm', 'regnetx_004', 'regnetx_004', 224, 176),
    ('regnetx_006 timm', 'timm', 'regnetx_006', 'regnetx_006', 224, 176),
    ('regnetx_008 timm', 'timm', 'regnetx_008', 'regnetx_008', 224, 176),
    ('regnetx_016 timm', 'timm', 'regnetx_016', 'regnetx_016', 224, 176),
    ('regnetx_032 timm', 'timm', 'regnetx_032', 'regnetx_032', 224, 176),
    ('regnety_002 timm', 'timm', 'regnety_002', 'regnety_002', 224, 176),
    ('regnety_004 timm', 'timm', 'regnety_004', 'regnety_004', 224, 176),
    ('regnety_006 timm', 'timm', 'regnety_006', 'regnety_006', 224, 176),
    ('regnety_008 timm', 'timm', 'regnety_008', 'regnety_008', 224, 176),
    ('regnety_016 timm', 'timm', 'regnety_016', 'regnety_016', 224, 176),
    ('regnety_032 timm', 'timm', 'regnety_032', 'regnety_032', 224, 176),
    ('regnety_040 timm', 'timm', 'regnety_040', 'regnety_040', 224, 176),
    ('regnety_080 timm', 'timm', 'regnety_080', 'regnety_080', 224, 176),
    ('regnety_160 timm', 'timm', 'regnety_160', 'regnety_160', 224, 176),
    ('regnet_x_400mf torchvision', 'torchvision', 'regnet_x_400mf', 'regnetx_004_tv', 224, 176),
    ('regnet_x_800mf torchvision', 'torchvision', 'regnet_x_800mf', 'regnetx_008', 224, 176),
    ('regnet_x_1_6gf torchvision', 'torchvision', 'regnet_x_1_6gf', 'regnetx_016', 224, 176),
    ('regnet_x_3_2gf torchvision', 'torchvision', 'regnet_x_3_2gf', 'regnetx_032', 224, 176),
    ('regnet_y_400mf torchvision', 'torchvision', 'regnet_y_400mf', 'regnety_004', 224, 176),
    ('regnet_y_800mf torchvision', 'torchvision', 'regnet_y_800mf', 'regnety_008_tv', 224, 176),
    ('regnet_y_1_6gf torchvision', 'torchvision', 'regnet_y_1_6gf', 'regnety_016', 224, 176),
    ('regnet_y_3_2gf torchvision', 'torchvision', 'regnet_y_3_2gf', 'regnety_032', 224, 176),
    ('regnet_y_8gf torchvision', 'torchvision', 'regnet_y_8gf', 'regnety_080_tv', 224, 176),
    ('regnet_y_16gf torchvision', 'torchvision', 'regnet_y_16gf', 'regnety_160', 224, 176),
    # ViT variants (DINOv2 built at 518 px)
    ('deit_ti distilled timm', 'timm', 'deit_tiny_distilled_patch16_224', 'deit_ti_distilled', 224, 176),
    ('deit_s distilled timm', 'timm', 'deit_small_distilled_patch16_224', 'deit_s_distilled', 224, 176),
    ('deit_b distilled timm', 'timm', 'deit_base_distilled_patch16_224', 'deit_b_distilled', 224, 176),
    ('dinov2_s timm', 'timm', 'vit_small_patch14_dinov2', 'dinov2_s', 224, 182),  # from 518 px
    ('dinov2_s_reg timm', 'timm', 'vit_small_patch14_reg4_dinov2', 'dinov2_s_reg', 224, 182),
    ('dinov2_b timm', 'timm', 'vit_base_patch14_dinov2', 'dinov2_b', 224, 182),
    ('dinov2_b_reg timm', 'timm', 'vit_base_patch14_reg4_dinov2', 'dinov2_b_reg', 224, 182),
    ('clip_b/16 timm', 'timm', 'vit_base_patch16_clip_224', 'clip_b', 224, 176),
    ('clip_b/16 quickgelu timm', 'timm', 'vit_base_patch16_clip_quickgelu_224', 'clip_b', 224, 176),
    ('clip_b/32 timm', 'timm', 'vit_base_patch32_clip_224', 'clip_b', 224, 160),
    ('siglip_b/16 (vit_b map) timm', 'timm', 'vit_base_patch16_siglip_224', 'vit_b', 224, 176),
    # big_vision's SigLIP .npz: the image tower under params/img/, stacked blocks, MAPHead_0, tanh GELU
    ('siglip_b/16 big_vision npz', 'siglip_npz', 'vit_base_patch16_siglip_224', 'vit_b', 224, 176),
    ('vit_b/16 fc_norm avg timm', 'timm', 'vit_base_patch16_224', 'vit_b', 224, 176),
    ('dinov2_l timm', 'timm', 'vit_large_patch14_dinov2', 'dinov2_l', 224, 182),
    ('dinov2_l_reg timm', 'timm', 'vit_large_patch14_reg4_dinov2', 'dinov2_l_reg', 224, 182),
    ('clip_l/14 timm', 'timm', 'vit_large_patch14_clip_224', 'clip_l', 224, 182),
]
# The source's own arguments where the architecture's defaults are not the case's (timm keyword arguments).
MODEL_ARGS = {'vit_b/16 fc_norm avg timm': {'global_pool': 'avg', 'fc_norm': True}}
# timm's config.json beside the weights, where the tensors cannot say (QuickGELU).
CONFIGS = {'clip_b/16 quickgelu timm': {'architecture': 'vit_base_patch16_clip_quickgelu_224'}}


def compare(case, images: int, directory: str) -> list[dict]:
  import numpy as np  # pylint: disable=g-import-not-at-top

  from flaxtpu.modes import predict  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  from flaxtpu.transfer import finetune  # pylint: disable=g-import-not-at-top
  from flaxtpu.weights import pretrained  # pylint: disable=g-import-not-at-top
  from tests import test_pretrained  # the tests' source-model helpers  # pylint: disable=g-import-not-at-top
  torch, torchvision, timm = test_pretrained.import_torch()
  label, library, architecture, model_name, size, second = case
  torch.manual_seed(0)
  if library == 'torchvision':
    source = getattr(torchvision.models, architecture)()
  else:
    # a head for every case (DINOv2's and SigLIP's published weights have none: num_classes=0)
    model_args = {'num_classes': 1000, **({'act_layer': 'gelu_tanh'} if library in ('npz', 'siglip_npz')
                                          else MODEL_ARGS.get(label, {}))}
    source = timm.create_model(architecture, **model_args)
  built = source.patch_embed.img_size[0] if hasattr(source, 'patch_embed') else size  # DINOv2's: 518
  if any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in source.modules()):
    # statistics measured on images of the native size (random ones collapse deep nets' outputs)
    calibration = np.random.default_rng(1).integers(0, 256, (32, size, size, 3)).astype(np.float32)
    source = test_pretrained.measure_batch_norm(torch, source, (calibration / 255.0 - 0.45) / 0.225)
  else:  # a transformer: its layer scales (1e-5), tokens and biases away from their init
    source = test_pretrained.randomise_transformer(torch, source).eval()
  state = {key: value.numpy() for key, value in source.state_dict().items()}
  directory = os.path.join(directory, label.replace('/', '_').replace(' ', '_'))
  os.makedirs(directory)
  if label in CONFIGS:
    with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
      json.dump(CONFIGS[label], f)
  if library == 'npz':
    path = os.path.join(directory, f'{architecture}.npz')
    test_pretrained.augreg_npz(state, len(source.blocks), path)
  elif library == 'siglip_npz':
    path = os.path.join(directory, f'{architecture}.npz')
    test_pretrained.siglip_npz(state, len(source.blocks), path)
  else:
    from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
    path = os.path.join(directory, f'{library}_{architecture}.safetensors')
    save_file({key: np.ascontiguousarray(value) for key, value in state.items()}, path)

  rows = []
  for side in [size] + ([second] if second else []):
    config = defaults.get_config()
    config.init_from.checkpoint = path
    config.dataset.image_size = side
    config.cpu_devices = 1
    config.compilation_cache_dir = 'none'
    if architecture.startswith('tf_'):
      config.model.padding = 'same'  # a bare file of timm's TensorFlow port: the user names its padding
    pretrained.describe.cache_clear()
    pretrained.apply_defaults(config)  # resolved as the CLI resolves it
    placement, state_, _, record = finetune.published_model(config)
    assert config.model.name == model_name, (config.model.name, model_name)
    pixels = np.random.default_rng(0).integers(0, 256, (images, side, side, 3)).astype(np.uint8)
    started = time.perf_counter()
    ours = predict.predict_logits(placement, state_, pixels, 32)
    ours_s = time.perf_counter() - started
    mean = np.asarray(record['normalization']['mean'], np.float32)
    std = np.asarray(record['normalization']['std'], np.float32)
    reference_model = source
    if side != built and (hasattr(source, 'pos_embed') or architecture.startswith('swin')):  # timm's own
      # resampling of the position embeddings (ViT) or relative position tables (Swin) at another size
      checkpoint_filter_fn = importlib.import_module(type(source).__module__).checkpoint_filter_fn
      reference_model = timm.create_model(architecture, img_size=side, **model_args)
      reference_model.load_state_dict(checkpoint_filter_fn(dict(source.state_dict()), reference_model))
      reference_model.eval()
    started = time.perf_counter()
    theirs = np.concatenate([test_pretrained.torch_logits(torch, reference_model,
                                                          ((chunk / 255.0 - mean) / std).astype(np.float32))
                             for chunk in np.split(pixels, max(1, images // 32))])
    theirs_s = time.perf_counter() - started
    difference = float(np.abs(ours - theirs).max())
    # The float32 rounding floor: the source in float64 is the exact answer both float32 runs miss.
    exact = test_pretrained.torch_logits(torch, copy.deepcopy(reference_model).double(),
                                         (pixels / 255.0 - mean) / std)
    scale = float(np.abs(exact).max())
    rows.append({'case': label, 'model': model_name, 'image_size': side, 'images': images,
                 'max_abs_logit_diff': difference, 'relative': difference / float(np.abs(theirs).max()),
                 'top1_agreement': float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
                 'flaxtpu_vs_float64': float(np.abs(ours - exact).max()) / scale,
                 'source_vs_float64': float(np.abs(theirs - exact).max()) / scale,
                 'flaxtpu_s': ours_s, 'source_s': theirs_s})
    print(f'{label:28s} {side:4d}px  max|diff| {difference:.2e}  relative {rows[-1]["relative"]:.2e}  '
          f'top-1 agreement {rows[-1]["top1_agreement"]:.2%}  (against the source in float64: flaxtpu '
          f'{rows[-1]["flaxtpu_vs_float64"]:.2e}, the source in float32 {rows[-1]["source_vs_float64"]:.2e})',
          flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--images', type=int, default=256)
  parser.add_argument('--only', default='', help='run the cases whose label contains this')
  parser.add_argument('--out-dir', default=harness.RESULTS)
  args = parser.parse_args()
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=1')
  sys.modules.setdefault('torchvision._meta_registrations',
                         types.ModuleType('torchvision._meta_registrations'))
  rows = []
  with tempfile.TemporaryDirectory() as directory:
    for case in CASES:
      if args.only in case[0]:
        rows += compare(case, args.images, directory)
  path = harness.write_results(os.path.join(args.out_dir, 'pretrained_parity.json'), rows)
  worst = max(row['relative'] for row in rows)
  agreement = min(row['top1_agreement'] for row in rows)
  print(f'{len(rows)} comparisons: worst relative difference {worst:.2e}, lowest top-1 agreement '
        f'{agreement:.2%}; {path}')


if __name__ == '__main__':
  main()
