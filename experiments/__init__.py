"""Sweep definitions: `python -m flaxtpu.sweep experiments/NAME.py --workdir=runs/sweeps/NAME`.

Each file here is also a plain config file (`get_config()`), so any single run
of a sweep can be reproduced with `python -m flaxtpu.main --config=experiments/NAME.py
--config.KEY=VALUE ...`. `get_sweep()` lists the runs as override dicts built
with `flaxtpu.sweep.sweep/product/zip_/chain`.

They train on TFDS's CIFAR-10 like the recipes they build on. Offline, give
every run an image folder from the command line:
`--config.dataset.folder=/path/to/cifar10` (checked before any run starts).
"""
