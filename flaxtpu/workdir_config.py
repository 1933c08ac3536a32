"""The config a run trained with, read back from WORKDIR/config.json.

`--mode=eval/predict/export` without `--config` load this file as
`--config=flaxtpu/workdir_config.py:WORKDIR`, so `--config.KEY=VALUE`
overrides (another eval split, a predict input) apply on top of the
training config exactly as they would on a recipe.
"""

import os

from flaxtpu import config, files

CONFIG_FILE = 'config.json'


def get_config(workdir: str):
  saved = files.read_json(os.path.join(workdir, CONFIG_FILE))
  if saved is None:
    raise ValueError(f'{os.path.join(workdir, CONFIG_FILE)} is missing or unreadable')
  return config.from_saved(saved)
