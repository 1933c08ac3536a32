"""MNIST-like data (mnist, fashion_mnist, kmnist, or a grayscale image folder): FastNet-S, Adam one-cycle.

    python -m flaxtpu.main --config=configs/mnist.py --workdir=runs/mnist
    python -m flaxtpu.main --config=configs/mnist.py --config.dataset.name=fashion_mnist --workdir=runs/fmnist
"""

from flaxtpu.settings import defaults


def get_config():
  config = defaults.get_config()
  config.dataset.name = 'mnist'
  config.model.name = 'fastnet_s'
  config.optimizer.name = 'adam'
  config.optimizer.learning_rate = 3e-3
  config.schedule.name = 'onecycle'
  config.label_smoothing = 0.1
  config.augment.crop_padding = 2  # digits shift by a pixel or two; flips would change them
  config.batch_size = 128
  config.num_epochs = 3.0
  return config
