"""What each part of configs/cifar10_fast.py adds: the recipe, then the recipe minus one part, at equal steps.

    python -m flaxtpu.sweep experiments/cifar10_fast_ablation.py --workdir=runs/sweeps/fast_ablation \
        [--config.dataset.folder=/path/to/cifar10] [--config.num_epochs=9.9]

Every run trains the same number of steps, so training takes the same time
within a few percent (the learned 3x3 stem of `fastnet` costs ~20% more per
image than the 2x2 whitening stem). Test-time augmentation needs no training
of its own, so it is not a run here: re-score the recipe's checkpoint with

    python -m flaxtpu.main --mode=eval --workdir=runs/sweeps/fast_ablation/base \
        --config.eval.translate_tta=0 [--config.eval.flip_tta=false]

(the run's config, data folder included, comes from its workdir; eval.json keeps each result under
its own key, 'test:tta=flip' and 'test:tta=none', and results.json has the run's own).

The base length is cut to 2 epochs so the whole ablation
fits a CPU evening; pass --config.num_epochs=9.9 for the recipe's own length
(with --config.schedule.warmup_epochs=2.3 and the whitening bias'
--config.optimizer.freeze_after="('^stem/bias\\$=3',)").
"""

from configs import cifar10_fast


def get_config():
  config = cifar10_fast.get_config()
  config.num_epochs = 2.0
  config.schedule.warmup_epochs = 0.46  # 23% of the run, as the recipe
  config.optimizer.freeze_after = ('^stem/bias$=0.6',)  # 30% of the run, as the recipe's 3 of 9.9 epochs
  config.checkpoint_every_steps = -1
  config.checkpoint.keep = 2
  return config


# The recipe before it took airbench's remaining parts (session 6's cifar10_fast at 2 epochs): random flips,
# zero padding, one learning rate, no Lookahead, the whitening bias trained all run, flip TTA only.
WITHOUT_AIRBENCH_PARTS = {
    'optimizer.lr_multipliers': (), 'optimizer.bias_weight_decay': 0.0, 'optimizer.lookahead_every': 0,
    'eval.translate_tta': 0, 'augment.crop_pad_mode': 'zeros', 'augment.alternate_flip': False,
    'optimizer.freeze_after': (),
}


def get_sweep():
  # airbench's network without its stem and initialisation: a learned 3x3 stem with BatchNorm, BN scales.
  learned_stem = {'model.name': 'fastnet', 'optimizer.freeze': (), 'optimizer.freeze_after': ()}
  return [
      {},  # the recipe
      learned_stem,
      {'label_smoothing': 0.0},
      {'augment.flip': False, 'augment.alternate_flip': False},
      {'augment.alternate_flip': False},  # a coin per image instead of alternating epochs
      {'augment.crop_padding': 0},
      {'augment.crop_pad_mode': 'zeros'},
      # the BatchNorm biases at the kernels' learning rate and decay
      {'optimizer.lr_multipliers': (), 'optimizer.bias_weight_decay': 0.0},
      {'optimizer.lookahead_every': 0},
      {'optimizer.freeze_after': ()},  # the whitening bias trains all run
      WITHOUT_AIRBENCH_PARTS,
      {'optimizer.lookahead_every': 0, 'ema.decay': 0.99},  # parts airbench does not use, for comparison
      {'augment.cutmix_alpha': 1.0},
  ]
