"""The ResNet-20 recipe at cifar10_lr.py's 1-epoch budget, searched instead of enumerated.

    python -m flaxtpu.sweep experiments/cifar10_search.py --workdir=runs/studies/cifar10 --trials=16 \
        --pruner=halving --config.dataset.folder=/path/to/cifar10

The same budget as the grid in `cifar10_lr.py` (1 epoch, 0.2 epochs of
warmup), with an evaluation every 78 steps (5 per epoch of 390 steps) so the
pruner sees each trial's curve. Learning rate on a log scale around the
grid's winner (0.8, cosine), schedule, and weight decay.
"""

from configs import cifar10_resnet


def get_config():
  config = cifar10_resnet.get_config()
  config.num_epochs = 1.0
  config.schedule.warmup_epochs = 0.2
  config.eval_every_steps = 78
  return config


def get_search(trial):
  return {
      'optimizer.learning_rate': trial.suggest_float('optimizer.learning_rate', 0.05, 2.0, log=True),
      'schedule.name': trial.suggest_categorical('schedule.name', ['cosine', 'onecycle']),
      'optimizer.weight_decay': trial.suggest_float('optimizer.weight_decay', 1e-4, 2e-3, log=True),
  }
