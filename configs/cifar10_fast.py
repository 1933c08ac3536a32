"""The fastest route to a high CIFAR-10 accuracy here: airbench94's recipe (Jordan 2024) in flaxtpu.

    python -m flaxtpu.main --config=configs/cifar10_fast.py --workdir=runs/cifar10_fast
    python -m flaxtpu.sweep experiments/cifar10_fast_ablation.py --workdir=runs/sweeps/fast  # the ablation

airbench94 (Jordan 2024) in full: its network (`fastnet_whiten`: a frozen 2x2
whitening stem fitted to the train images, widths 64/256/256, BatchNorm
without scale, partial identity initialisation, global max pool, logits / 9)
and its optimizer, hyperparameters converted to a mean loss: batch 1024, SGD
with Nesterov momentum 0.85 at 1.5, L2 weight decay 1.33e-3 on kernels, the
BatchNorm biases at 64x the learning rate, Lookahead every 5 steps, a linear
warmup over the first 23% to a linear decay to 7%; label smoothing 0.2;
2-pixel translations with reflected padding, flips alternating by epoch; the
whitening bias trained for 3 epochs; flip and translate test-time
augmentation; 9.9 epochs. On CPU, Eigen's convolutions on 4 devices (1.7x
the images/s of XLA's default kernels on 8). The ablation sweep takes each
part out in turn. README.md has the measured accuracy and times.
"""

from flaxtpu.settings import defaults


def get_config():
  config = defaults.get_config()
  config.dataset.name = 'cifar10'
  config.dataset.normalize = 'standardize'
  config.augment.crop_padding = 2
  config.augment.crop_pad_mode = 'reflect'
  config.augment.flip = True
  config.augment.alternate_flip = True
  config.model.name = 'fastnet_whiten'
  config.batch_size = 1024
  config.num_epochs = 9.9
  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 1.5
  config.optimizer.momentum = 0.85
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 1.33e-3
  # The BatchNorm biases learn 64x faster; their decay per step stays that of the kernels. (The
  # whitening bias, 1-D too, decays at 1/64 of that for its 3 epochs; airbench's matches the kernels.)
  config.optimizer.lr_multipliers = (r'BatchNorm_\d+/bias$=64',)
  config.optimizer.bias_weight_decay = 1.33e-3 / 64
  config.optimizer.freeze = ('^stem/kernel$',)  # the whitening stays what the data made it
  config.optimizer.freeze_after = ('^stem/bias$=3',)  # ... and its bias stops after 3 epochs
  config.optimizer.lookahead_every = 5
  config.optimizer.lookahead_decay = 0.95**5
  config.optimizer.lookahead_decay_power = 3.0
  config.schedule.name = 'linear'
  config.schedule.warmup_epochs = 2.3  # 23% of the run, as airbench (which starts it at 0.2x, not 0)
  config.schedule.final_lr_fraction = 0.07
  config.label_smoothing = 0.2
  config.eval.flip_tta = True
  config.eval.translate_tta = 1
  # At the end only: each evaluation (6 views of 10,000 images) costs ~1.5 min here.
  config.eval_every_steps = 1_000_000
  config.checkpoint_every_steps = 48  # every epoch: --mode=eval scores any of them afterwards
  config.checkpoint.keep = 11
  config.log_every_steps = 10
  config.cpu_devices = 4  # with Eigen's convolutions 4 devices trained fastest here (158 img/s, 8: 125)
  config.cpu_convolutions = 'eigen'  # 1.36x YNNPACK's on this network's 256-channel layers
  return config
