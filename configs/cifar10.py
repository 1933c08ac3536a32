"""The Keras/TPU recipe, exactly: small CNN, Adam 1e-3, batch 128, [0, 1] inputs, no augmentation, 5 epochs.

    python -m flaxtpu.main --config=configs/cifar10.py --workdir=runs/cifar10
"""

from flaxtpu.settings import defaults


def get_config():
  config = defaults.get_config()
  config.dataset.name = 'cifar10'
  config.model.name = 'cnn'
  config.optimizer.name = 'adam'
  config.optimizer.learning_rate = 1e-3
  config.batch_size = 128
  config.num_epochs = 5.0
  config.log_every_steps = 100
  config.checkpoint.min_interval_secs = 60.0  # an epoch is ~0.6 s on a TPU v5e: not a checkpoint after each
  config.cpu_convolutions = 'eigen'  # 1.23x the images/s of XLA's default (YNNPACK) CPU kernels for this CNN
  return config
