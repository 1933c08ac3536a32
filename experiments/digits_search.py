"""An Optuna study on the embedded digits (no download): learning rate, optimizer and schedule.

    python -m flaxtpu.sweep experiments/digits_search.py --workdir=runs/studies/digits --trials=16 \
        --pruner=halving
    python -m flaxtpu.sweep experiments/digits_search.py --workdir=runs/studies/digits --trials=16 \
        --pruner=halving --dry-run
    python -m flaxtpu.sweep experiments/digits_search.py --workdir=runs/studies/digits --report

Each trial trains 3 epochs (132 steps) and evaluates every 15 steps and at
its end, which gives the pruner 9 reports per trial.
`get_search` is define-by-run: momentum is only drawn for SGD.
"""

from configs import digits


def get_config():
  config = digits.get_config()
  config.num_epochs = 3.0
  config.eval_every_steps = 15
  config.log_every_steps = 15
  return config


def get_search(trial):
  overrides = {
      'optimizer.learning_rate': trial.suggest_float('optimizer.learning_rate', 1e-4, 1.0, log=True),
      'optimizer.name': trial.suggest_categorical('optimizer.name', ['adam', 'sgd']),
      'schedule.name': trial.suggest_categorical('schedule.name', ['cosine', 'constant']),
  }
  if overrides['optimizer.name'] == 'sgd':
    overrides['optimizer.momentum'] = trial.suggest_float('optimizer.momentum', 0.0, 0.95)
  return overrides
