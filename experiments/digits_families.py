"""Every model family from scratch on the embedded digits: one small variant each, CPU-sized.

    python -m flaxtpu.sweep experiments/digits_families.py --workdir=runs/sweeps/digits_families
    python -m flaxtpu.sweep experiments/digits_families.py --workdir=runs/sweeps/digits_families --report

No download: `configs/digits.py` (1,438 train / 359 test 8x8 digits, here
upscaled to 32 px), batch 32, cosine. The convolutional nets keep the digits
recipe (Adam 3e-3, 5 epochs = 220 steps). The transformers (and ConvNeXt,
trained as its paper trains it) get what they need on data this small:
AdamW 1e-3 with weight decay 0.05, a 2-epoch warmup, more epochs, and patches
small enough that a 32 px digit is 64 tokens (patch 4; Swin patch 2 at 16
px). A ViT pooled by SigLIP's attention-pool head (`vit_ti`, `pool=map`)
stands in for the CLIP/SigLIP towers, whose smallest variants (86M
parameters) are too slow to train from scratch on 2 cores. Results are in
docs/results.md (issue 38).
"""

from configs import digits
from flaxtpu import sweep

_TRANSFORMER = {
    'optimizer.name': 'adamw',
    'optimizer.learning_rate': 1e-3,
    'optimizer.weight_decay': 0.05,
    'schedule.warmup_epochs': 2.0,
}


def get_config():
  config = digits.get_config()
  config.dataset.image_size = 32
  config.num_epochs = 5.0
  return config


def get_sweep():
  convolutional = sweep.sweep('model.name', ['efficientnet_b0', 'resnet18d'])
  transformers = [
      {'model.name': 'convnext_t', **_TRANSFORMER},
      {'model.name': 'swin_t', 'model.patch_size': 2, 'dataset.image_size': 16, 'num_epochs': 10.0,
       **_TRANSFORMER},
      {'model.name': 'deit_ti_distilled', 'model.pool': 'tok', 'model.patch_size': 4, 'num_epochs': 20.0,
       **_TRANSFORMER},
      {'model.name': 'dinov2_s_reg', 'model.pool': 'tok', 'model.patch_size': 4, 'num_epochs': 10.0,
       **_TRANSFORMER},
      {'model.name': 'vit_ti', 'model.pool': 'map', 'model.patch_size': 4, 'num_epochs': 20.0,
       **_TRANSFORMER},
  ]
  # Measured in earlier sessions (docs/results.md), so last here.
  small = sweep.sweep('model.name', ['mobilenetv3_s', 'regnetx_002'])
  return sweep.chain(convolutional, transformers, small)
