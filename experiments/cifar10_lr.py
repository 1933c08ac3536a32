"""Peak learning rate x schedule for the ResNet-20 recipe at a CPU-sized budget (9 runs of 1 epoch).

    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/cifar10_lr
    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/cifar10_lr \
        --config.dataset.folder=/path/to/cifar10   # offline: an image folder
    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/cifar10_lr --report

The recipe's 30-epoch budget is cut to 1 epoch (and its warmup to 0.2 epoch)
so the whole sweep fits a CPU: ResNet-20 trains at ~210 images/s on 2 CPU
cores, so a run takes ~4-7 minutes and the sweep about an hour (`--parallel`
does not help on so few cores). The winner goes back into
`configs/cifar10_resnet.py`; results are recorded in `experiments/README.md`.
"""

from configs import cifar10_resnet
from flaxtpu import sweep


def get_config():
  config = cifar10_resnet.get_config()
  config.num_epochs = 1.0
  config.schedule.warmup_epochs = 0.2
  return config


def get_sweep():
  return sweep.chain(
      sweep.product(
          sweep.sweep('optimizer.learning_rate', [0.05, 0.1, 0.2, 0.4]),
          sweep.sweep('schedule.name', ['cosine', 'onecycle']),
      ),
      # 0.4 still won: one step further, on the recipe's own schedule, to find the peak.
      sweep.product(sweep.sweep('optimizer.learning_rate', [0.8]), sweep.sweep('schedule.name', ['cosine'])),
  )
