"""Fine-tune a published ImageNet model on your own photo folder: set `dataset.folder`.

    python -m flaxtpu.main --config=configs/finetune.py --workdir=runs/finetune \\
        --config.dataset.folder=/path/to/photos          # photos/train/<class>/*, photos/test/<class>/*

The backbone starts from `init_from.checkpoint` (timm's ResNet-50 A1 by
default; any `hf-hub:timm/...` ResNet, ViT or ConvNeXt, a timm/torchvision
.safetensors/.pth, a big_vision ViT .npz or another flaxtpu run's --workdir
works, and the model follows the weights). The weights bring their preprocessing: their mean/std, input size
(224) and crop fraction become this run's (`dataset.normalize=auto`,
`image_size=0`, `crop_fraction=0`); on a CPU, `--config.dataset.image_size=128`
(or 96) trains several times faster at some cost in accuracy. A ViT at
another size gets its position embeddings resampled.

The practices that work for small data: a new head for your classes at the
full rate and the pretrained backbone at a tenth of it (`lr_multipliers`),
a short warmup so the random head does not wreck the backbone, cosine decay,
SGD + Nesterov, label smoothing, random-resized crops that keep most of the
picture, flips.
"""

from flaxtpu.settings import defaults


def get_config():
  config = defaults.get_config()
  config.init_from.checkpoint = 'hf-hub:timm/resnet50.a1_in1k'
  config.dataset.name = ''  # no TFDS fallback: without a folder the config says what to set
  config.dataset.folder = ''  # set --config.dataset.folder=/path/to/photos
  config.augment.crop_area = (0.35, 1.0)
  config.augment.flip = True
  config.batch_size = 32
  config.num_epochs = 10.0
  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 0.01  # the head's; the backbone's is a tenth of it
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 1e-4
  # Everything but the classifier (Dense_0 in ResNets, head in ViT/ConvNeXt) learns 10x slower.
  config.optimizer.lr_multipliers = ('^(?!Dense_0/|head/)=0.1',)
  config.schedule.name = 'cosine'
  config.schedule.warmup_epochs = 0.5
  config.label_smoothing = 0.1
  config.log_every_steps = 20
  return config
