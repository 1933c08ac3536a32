"""The config a run trained with, read back from WORKDIR/config.json (or a checkpoint record's
`config`) on top of today's defaults: `from_saved`.

`--mode=eval/predict/export` without `--config` load this file as
`--config=flaxtpu/validation/workdir_config.py:WORKDIR`, so `--config.KEY=VALUE`
overrides (another eval split, a predict input) apply on top of the
training config exactly as they would on a recipe.
"""

import os

import ml_collections

from flaxtpu import models
from flaxtpu.io import files
from flaxtpu.settings import defaults
from flaxtpu.validation import config as config_lib

CONFIG_FILE = 'config.json'


def get_config(workdir: str) -> ml_collections.ConfigDict:
  saved = files.read_json(os.path.join(workdir, CONFIG_FILE))
  if saved is None:
    raise ValueError(f'{os.path.join(workdir, CONFIG_FILE)} is missing or unreadable')
  return from_saved(saved)


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The locked config of a run from its saved `config.json`, on top of today's defaults.

  Keys this version no longer knows are skipped (logged by the caller's
  reader); JSON lists become the tuples the defaults hold.
  """
  config = defaults.get_config()
  known = set(config_lib.config_keys(config))

  def assign(node: dict, prefix: str) -> None:
    for key, value in node.items():
      path = f'{prefix}{key}'
      if isinstance(value, dict) and path not in known:
        assign(value, f'{path}.')
      elif path in known:
        parent_path, _, leaf = path.rpartition('.')
        parent = config
        for part in parent_path.split('.') if parent_path else []:
          parent = parent[part]
        parent[leaf] = tuple(value) if isinstance(parent[leaf], tuple) else value

  assign(saved, '')
  config.model.update(legacy_options(saved))
  return config


def legacy_options(saved: dict) -> dict:
  """{option: value} of the model options a run saved before they existed computed with: its model reads
  them, its saved config lacks them, and what it computed is the option's legacy value."""
  name = saved.get('model', {}).get('name')
  if name not in models.NAMES:
    return {}
  options = models.get_spec(name).options
  return {key: legacy for key, legacy in models.LEGACY_OPTIONS.items()
          if key in options and key not in saved['model']}
