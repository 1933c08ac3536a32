"""A 4-trial learning-rate sweep of the ResNet-20 recipe, short, to time each trial's start (issue 69).

    python -m flaxtpu.sweep experiments/resnet20_lr_first_step.py --workdir=runs/sweeps/first_step \
        --config.dataset.folder=/path/to/cifar10

Every trial differs from the others in the learning rate only, which the train
step takes as an input (flaxtpu/optimizers/step_inputs.py): the first trial
compiles the step, the others load it from XLA's persistent cache
(`compiled train step in ... (from persistent cache)` in their logs;
`memory_plan.compiled_from` and `time_to_first_step_s` in their results.json).
200 steps each: the start is what is measured, not the accuracy.
"""

from configs import cifar10_resnet
from flaxtpu import sweep


def get_config():
  config = cifar10_resnet.get_config()
  config.num_train_steps = 200
  config.eval_every_steps = 200
  return config


def get_sweep():
  return sweep.sweep('optimizer.learning_rate', [0.05, 0.1, 0.2, 0.4])
