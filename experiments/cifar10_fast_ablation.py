"""What each part of configs/cifar10_fast.py adds: the recipe, then the recipe without one part, at equal steps.

    python -m flaxtpu.sweep experiments/cifar10_fast_ablation.py --workdir=runs/sweeps/fast_ablation \
        [--config.dataset.folder=/path/to/cifar10] [--config.num_epochs=7]

Every run trains the same number of steps, so training takes the same time
within a few percent (the learned 3x3 stem of `fastnet` costs ~20% more per
image than the 2x2 whitening stem). The TTA runs need no training of their
own: `--mode=eval --config.eval.flip_tta=false` (or `translate_tta=1`)
re-scores the recipe's checkpoint; they are listed for a sweep that wants
them side by side. The
base length is cut to 2 epochs so the whole ablation fits a CPU evening; pass
--config.num_epochs=7 for the recipe's own length (and scale the whitening
bias' freeze_after, 0.6 epochs here, to 30% of it: 2.1 at 7 epochs).
"""

from configs import cifar10_fast


def get_config():
  config = cifar10_fast.get_config()
  config.num_epochs = 2.0
  config.schedule.warmup_epochs = 0.4
  config.eval_every_steps = 1_000_000  # at the end only
  return config


# Every part of airbench94 that the recipe leaves out, together. The whitening bias' 0.6 epochs are 30% of the
# ablation's 2; at another --config.num_epochs, override optimizer.freeze_after to 30% of it.
AIRBENCH_PARTS = {
    'optimizer.lr_multipliers': (r'BatchNorm_\d+/bias$=64',), 'optimizer.bias_weight_decay': 1.33e-3 / 64,
    'optimizer.lookahead_every': 5, 'optimizer.lookahead_decay': 0.95**5, 'optimizer.lookahead_decay_power': 3.0,
    'eval.translate_tta': 1, 'augment.crop_pad_mode': 'reflect', 'augment.alternate_flip': True,
    'optimizer.freeze_after': ('^stem/bias$=0.6',),
}


def get_sweep():
  # airbench's network without its stem and initialisation: a learned 3x3 stem with BatchNorm, BN scales.
  learned_stem = {'model.name': 'fastnet', 'optimizer.freeze': ()}
  return [
      {},  # the recipe
      learned_stem,
      {'eval.flip_tta': False},
      {'label_smoothing': 0.0},
      {'augment.flip': False},
      {'augment.crop_padding': 0},
      # airbench's parts that the recipe leaves out: its BatchNorm-bias learning rate (with its decay, which
      # keeps the biases' decay per step that of the kernels), Lookahead, multi-crop TTA.
      {'optimizer.lr_multipliers': (r'BatchNorm_\d+/bias$=64',), 'optimizer.bias_weight_decay': 1.33e-3 / 64},
      {'optimizer.lookahead_every': 5, 'optimizer.lookahead_decay': 0.95**5,
       'optimizer.lookahead_decay_power': 3.0},
      {'eval.translate_tta': 1},
      # airbench's data and freezing details: reflected crop padding, alternating flips, the whitening bias
      # trained for the first 30% of the run only (3 of its 9.9 epochs).
      {'augment.crop_pad_mode': 'reflect'},
      {'augment.alternate_flip': True},
      {'optimizer.freeze_after': ('^stem/bias$=0.6',)},
      AIRBENCH_PARTS,
      {'ema.decay': 0.99},  # parts airbench does not use, for comparison
      {'augment.cutmix_alpha': 1.0},
  ]
