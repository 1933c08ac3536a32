"""Every optimizer on the ResNet-20 recipe for 1 epoch, each at a rate from its own literature.

    python -m flaxtpu.sweep experiments/cifar10_optimizers.py --workdir=runs/sweeps/cifar10_optimizers
    python -m flaxtpu.sweep experiments/cifar10_optimizers.py --workdir=runs/sweeps/cifar10_optimizers \
        --config.dataset.folder=/path/to/cifar10   # offline: an image folder

`experiments/cifar10_lr.py`'s 1-epoch cut of `configs/cifar10_resnet.py`
(0.2 epochs of warmup, cosine), with only the optimizer and its rate and
weight decay changed. The rates are not tuned here: SGD's is that sweep's
best; the others are the usual starting points for a batch of 128 (AdamW
2e-3, LAMB 1e-2, Lion 3x-10x below AdamW with 10x its decay as its paper
advises, Adafactor 1e-2 with its relative step size, RMSprop 1e-3, LARS 1
with its trust ratio 0.001, plain SGD 10x momentum SGD's, the same step size
without momentum's 1 / (1 - 0.9) amplification). Weight decay: L2 5e-4 for the
SGD family, RMSprop and LARS (PyTorch's convention); decoupled for AdamW,
LAMB and Lion (times the rate); Adafactor's own (per update). Results in
experiments/README.md.
"""

from experiments import cifar10_lr


def get_config():
  return cifar10_lr.get_config()


def _run(name: str, learning_rate: float, weight_decay: float, **options) -> dict:
  run = {'optimizer.name': name, 'optimizer.learning_rate': learning_rate,
         'optimizer.weight_decay': weight_decay}
  if name != 'sgd':  # the recipe's Nesterov momentum is an SGD key: the others refuse it
    run['optimizer.nesterov'] = False
  run.update({f'optimizer.{key}': value for key, value in options.items()})
  return run


def get_sweep():
  return [
      _run('sgd', 0.8, 5e-4),  # the recipe: Nesterov momentum 0.9
      _run('sgd', 8.0, 5e-4, momentum=0.0, nesterov=False),
      _run('adamw', 2e-3, 0.05),
      _run('lamb', 1e-2, 0.05),
      _run('lion', 3e-4, 0.5),
      _run('adafactor', 1e-2, 1e-4),
      _run('rmsprop', 1e-3, 5e-4),
      _run('lars', 1.0, 5e-4),
  ]
