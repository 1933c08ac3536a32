"""The fastest route to a high CIFAR-10 accuracy here: airbench's recipe shape (Jordan 2024) in flaxtpu.

    python -m flaxtpu.main --config=configs/cifar10_fast.py --workdir=runs/cifar10_fast
    python -m flaxtpu.sweep experiments/cifar10_fast_ablation.py --workdir=runs/sweeps/fast  # what each part adds

FastNet (widths 64/256/256, global max pool, logits / 9), large batches, SGD
with Nesterov momentum on a one-cycle schedule, label smoothing 0.2, 2-pixel
translations and flips, an EMA of the weights, and flip test-time
augmentation. airbench94 reaches 94% in ~10 epochs on an A100 with a frozen
whitening stem, BatchNorm-bias learning-rate scaling and Lookahead, which
flaxtpu leaves out (see experiments/README.md for what was measured here).
"""

from flaxtpu import defaults


def get_config():
  config = defaults.get_config()
  config.dataset.name = 'cifar10'
  config.dataset.normalize = 'standardize'
  config.augment.crop_padding = 2
  config.augment.flip = True
  config.model.name = 'fastnet'
  config.batch_size = 512
  config.num_epochs = 10.0
  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 0.4
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 5e-4
  config.schedule.name = 'onecycle'
  config.schedule.warmup_epochs = 2.0
  config.label_smoothing = 0.2
  config.ema.decay = 0.99
  config.checkpoint.best_metric = 'eval_accuracy_ema'
  config.eval.flip_tta = True
  config.eval.ema = True  # the end-of-run report scores the EMA weights
  config.log_every_steps = 20
  return config
