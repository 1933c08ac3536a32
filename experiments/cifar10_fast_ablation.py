"""What each part of configs/cifar10_fast.py adds: the recipe, then the recipe without one part, at equal epochs.

    python -m flaxtpu.sweep experiments/cifar10_fast_ablation.py --workdir=runs/sweeps/fast_ablation \
        [--config.dataset.folder=/path/to/cifar10] [--config.num_epochs=10]

Every run trains the same number of steps, so training takes the same time
within a few percent (EMA adds one multiply-add per weight per step); each
evaluation scores the raw and the EMA weights, each with flip TTA: 4 forward
passes where a plain run makes 1. The runs without EMA or TTA need no
training of their own: the recipe run logs its raw weights' accuracy next to
the EMA's, and `--mode=eval --config.eval.flip_tta=false` re-scores it
without TTA; they are listed for a sweep that wants them side by side. The
base length is cut to 2 epochs so the whole ablation fits a CPU evening; pass
--config.num_epochs=10 for the recipe's own length on an accelerator.
"""

from configs import cifar10_fast


def get_config():
  config = cifar10_fast.get_config()
  config.num_epochs = 2.0
  config.schedule.warmup_epochs = 0.4
  return config


def get_sweep():
  no_ema = {'ema.decay': 0.0, 'eval.ema': False, 'checkpoint.best_metric': 'eval_accuracy'}
  return [
      {},  # the recipe
      no_ema,
      {'eval.flip_tta': False},
      {'label_smoothing': 0.0},
      {'augment.flip': False},
      {'augment.crop_padding': 0},
      {'augment.cutmix_alpha': 1.0},  # one part airbench does not use, for comparison
  ]
