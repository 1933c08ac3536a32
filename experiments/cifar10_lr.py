"""Peak learning rate x schedule for the ResNet-20 recipe at a CPU-sized budget (8 runs of 1 epoch).

    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/cifar10_lr
    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/cifar10_lr --report

The recipe's 30-epoch budget is cut to 2 epochs (and its warmup to half an
epoch) so the whole sweep fits a CPU: ResNet-20 trains at ~250 images/s on 2
CPU cores, so a run takes ~8 minutes and the sweep ~45 (`--parallel` does not
help on so few cores). The winner goes back into `configs/cifar10_resnet.py`.
"""

from configs import cifar10_resnet
from experiments import CIFAR10_FOLDER
from flaxtpu import sweep


def get_config():
  config = cifar10_resnet.get_config()
  config.dataset.folder = CIFAR10_FOLDER
  config.num_epochs = 1.0
  config.schedule.warmup_epochs = 0.2
  return config


def get_sweep():
  return sweep.product(
      sweep.sweep('optimizer.learning_rate', [0.05, 0.1, 0.2, 0.4]),
      sweep.sweep('schedule.name', ['cosine', 'onecycle']),
  )
