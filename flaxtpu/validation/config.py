"""Validate a config before any work starts: every section's checks, once, in defaults.py's order.

Every check raises `ConfigError` with one line: the key, the bad value, and
what is allowed. The checks sit with their concern: `data_checks` (what a run
reads), `training_checks` (what is trained and how), `run_checks` (devices, the
loop, checkpoints, evaluation, outputs), each package's own (augmentation,
optimizers, data, report, io, export), and `values` (the one-line checks they
share). This module and those must not import JAX (the CLI validates before
JAX starts, so that a typo never costs a compile).
"""

from __future__ import annotations

import difflib
from typing import Sequence

import ml_collections

from flaxtpu.augmentation import (  # no JAX at import
  aug_checks,
  image_sizes,
)
from flaxtpu.data import audit  # no JAX at import
from flaxtpu.io import tracking  # no JAX at import
from flaxtpu.optimizers import (  # no JAX at import
  optim_checks,
  swa,
)
from flaxtpu.report import calibration  # no JAX at import
from flaxtpu.settings.errors import ConfigError
from flaxtpu.validation import data_checks, run_checks, training_checks
from flaxtpu.validation.data_checks import check_against_data
from flaxtpu.validation.export_options import check_export
from flaxtpu.validation.run_checks import CPU_CONVOLUTION_FLAGS, YNN_FUSION_FLAG
from flaxtpu.validation.training_checks import OPTIMIZERS, REMAT_POLICIES

# What other modules import from here (the constants and check_against_data live with their checks).
__all__ = ['CPU_CONVOLUTION_FLAGS', 'ConfigError', 'DATALESS_MODES', 'OPTIMIZERS', 'REMAT_POLICIES',
           'SECTION_CHECKS', 'YNN_FUSION_FLAG', 'check_against_data', 'config_keys', 'did_you_mean',
           'validate']

# Modes that read no dataset (predict reads predict.input): their dataset source is not checked, so a
# recipe's training folder (or none) is not asked for.
DATALESS_MODES = ('predict',)


def validate(config: ml_collections.ConfigDict, mode: str = 'train') -> None:
  """Raises ConfigError naming the first key whose value cannot work for `mode`.

  One check per section of `defaults.py`, in its order; what needs the data
  (image shape, classes) is `check_against_data`.
  """
  for check in SECTION_CHECKS:
    if not (check is data_checks.check_dataset_source and mode in DATALESS_MODES):
      check(config)


# The sections of defaults.py, in its order.
SECTION_CHECKS = (data_checks.check_dataset_source, data_checks.check_dataset, data_checks.check_input,
                  data_checks.check_augment, training_checks.check_model, training_checks.check_training,
                  training_checks.check_optimizer, training_checks.check_schedule, training_checks.check_ema,
                  training_checks.check_init_from, training_checks.check_distill,
                  run_checks.check_parallelism, run_checks.check_loop, run_checks.check_checkpoint,
                  run_checks.check_early_stopping, run_checks.check_eval, run_checks.check_predict,
                  optim_checks.check, check_export, audit.check_config, calibration.check_config,
                  tracking.check_config, aug_checks.check, image_sizes.check, swa.check,
                  run_checks.check_compilation_cache)


def config_keys(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  """Every leaf key of a config as a dotted path."""
  keys = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      keys += config_keys(value, f'{prefix}{key}.')
    else:
      keys.append(f'{prefix}{key}')
  return keys


def did_you_mean(key: str, known_keys: Sequence[str]) -> str:
  """' (did you mean 'x'?)' for the closest known key; `lr` matches `learning_rate`."""
  parent, _, leaf = key.rpartition('.')
  abbreviated = [known for known in known_keys if known.rpartition('.')[0] == parent
                 and ''.join(word[0] for word in known.rpartition('.')[2].split('_')) == leaf]
  close = abbreviated or difflib.get_close_matches(key, known_keys, n=1)
  return f' (did you mean {close[0]!r}?)' if close else ''
