"""Which model for CIFAR-10: the Keras CNN vs CIFAR ResNets vs ResNet-18, same data, augmentation and budget.

    python -m flaxtpu.sweep experiments/cifar10_models.py --workdir=runs/sweeps/cifar10_models

Every model gets the ResNet recipe's data pipeline (standardized inputs, crop +
flip) and 2 epochs; the CNN keeps the optimizer it was designed with (Adam
1e-3, no weight decay) because SGD 0.1 is not a fair setting for it.
ResNet-18 is the ImageNet network (7x7 stride-2 stem + max pool), which
shrinks 32x32 images to 1x1 by its last stage: it shows what the CIFAR stem
buys. On 2 CPU cores a ResNet-20 run takes ~8 minutes, ResNet-32 about 1.6x
that.
"""

from configs import cifar10_resnet
from experiments import CIFAR10_FOLDER
from flaxtpu import sweep


def get_config():
  config = cifar10_resnet.get_config()
  config.dataset.folder = CIFAR10_FOLDER
  config.num_epochs = 2.0
  config.schedule.warmup_epochs = 0.5
  return config


def get_sweep():
  keras_cnn = [{
      'model.name': 'cnn',
      'optimizer.name': 'adam',
      'optimizer.learning_rate': 1e-3,
      'optimizer.weight_decay': 0.0,
  }]
  resnets = sweep.sweep('model.name', ['resnet20', 'resnet32', 'resnet18'])
  return sweep.chain(keras_cnn, resnets)
