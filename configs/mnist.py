"""MNIST-like data (mnist, fashion_mnist, kmnist, or a grayscale image folder): the small CNN, Adam, 3 epochs.

    python -m flaxtpu.main --config=configs/mnist.py --workdir=runs/mnist
    python -m flaxtpu.main --config=configs/mnist.py --config.dataset.name=fashion_mnist --workdir=runs/fmnist
"""

from flaxtpu import defaults


def get_config():
  config = defaults.get_config()
  config.dataset.name = 'mnist'
  config.model.name = 'cnn'
  config.optimizer.name = 'adam'
  config.optimizer.learning_rate = 1e-3
  config.batch_size = 128
  config.num_epochs = 3.0
  return config
