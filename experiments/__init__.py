"""Sweep definitions: `python -m flaxtpu.sweep experiments/NAME.py --workdir=runs/sweeps/NAME`.

Each file here is also a plain config file (`get_config()`), so any single run
of a sweep can be reproduced with `python -m flaxtpu.main --config=experiments/NAME.py
--config.KEY=VALUE ...`. `get_sweep()` lists the runs as override dicts built
with `flaxtpu.sweep.sweep/product/zip_/chain`.
"""

import os

# The project's CIFAR-10 image folder (TFDS cannot download here), found from
# this file rather than the working directory so sweeps start from anywhere.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CIFAR10_FOLDER = os.path.normpath(os.path.join(REPO_ROOT, '..', 'shared', 'datasets', 'cifar10'))
