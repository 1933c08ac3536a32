"""ResNet-50 on ImageNet, the standard recipe (Goyal et al. 2017; the Flax ImageNet example).

    python -m flaxtpu.main --config=configs/imagenet_resnet50.py --workdir=runs/imagenet_r50

Global batch 1024, SGD + Nesterov at 0.1 x batch / 256, 5 warmup epochs then
cosine, label smoothing 0.1, L2 weight decay 1e-4 on kernels (the Flax
example's 1e-4 x 0.5 ||w||^2), 90 epochs, bfloat16 compute, random-resized
crops + flips at 224 and resize-256 + centre-224 evaluation. Streams
`imagenet2012` from TFDS ArrayRecord files (see the README for preparing
them). On a TPU v3-8 or 8 GPUs this is ~1250 steps per epoch.
"""

from flaxtpu.settings import defaults


def get_config():
  config = defaults.get_config()
  config.dataset.name = 'imagenet2012'
  config.dataset.train_split = 'train'
  config.dataset.eval_split = 'validation'
  config.dataset.image_size = 224
  config.dataset.crop_fraction = 0.875  # resize to 256, centre 224
  config.dataset.normalize = 'standardize'
  config.augment.crop_area = (0.08, 1.0)
  config.augment.crop_aspect = (3 / 4, 4 / 3)
  config.augment.flip = True
  config.model.name = 'resnet50'
  config.dtype = 'bfloat16'
  config.batch_size = 1024
  config.eval_batch_size = 1024
  config.num_epochs = 90.0
  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 0.1 * config.batch_size / 256
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 1e-4
  config.schedule.name = 'cosine'
  config.schedule.warmup_epochs = 5.0
  config.label_smoothing = 0.1
  config.log_every_steps = 100
  return config
