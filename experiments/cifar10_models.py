"""Which model for CIFAR-10: the Keras CNN vs CIFAR ResNets of two depths, same data, augmentation and budget.

    python -m flaxtpu.sweep experiments/cifar10_models.py --workdir=runs/sweeps/cifar10_models \
        [--config.dataset.folder=/path/to/cifar10]

Every model gets the ResNet recipe's data pipeline (standardized inputs, crop +
flip) and 1 epoch; the CNN keeps the optimizer it was designed with (Adam
1e-3, no weight decay) because SGD at 0.8 is not a fair setting for it. On 2
CPU cores a ResNet-20 run takes ~4 minutes, ResNet-32 about 1.6x that. On an
accelerator, add 'resnet18' (the ImageNet stem) to see what the CIFAR stem
buys; on 2 CPU cores its 11M parameters make it ~10x slower per image.
"""

from configs import cifar10_resnet
from flaxtpu import sweep


def get_config():
  config = cifar10_resnet.get_config()
  config.num_epochs = 1.0
  config.schedule.warmup_epochs = 0.2
  config.optimizer.learning_rate = 0.8  # the 1-epoch winner of cifar10_lr.py (the 30-epoch recipe's is 0.1)
  config.eval_every_steps = 130  # three points on each accuracy curve
  config.log_every_steps = 50
  return config


def get_sweep():
  keras_cnn = [{
      'model.name': 'cnn',
      'optimizer.name': 'adam',
      'optimizer.learning_rate': 1e-3,
      'optimizer.weight_decay': 0.0,
      'optimizer.nesterov': False,  # Adam has no Nesterov momentum: the recipe's True is refused
  }]
  resnets = sweep.sweep('model.name', ['resnet20', 'resnet32'])
  return sweep.chain(keras_cnn, resnets)
