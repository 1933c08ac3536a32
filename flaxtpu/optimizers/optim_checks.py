"""Validation of the keys issue 41 added: optax.contrib optimizers, SAM, float16, `time_budget` and
`lr_find` (one line each, no JAX); `config.validate` runs `check` with its sections."""

from __future__ import annotations

import re

import ml_collections

from flaxtpu.settings.errors import ConfigError

SCHEDULE_FREE = ('schedule_free_adamw', 'schedule_free_sgd')
_DURATION = re.compile(r'^\s*(\d+(?:\.\d+)?)\s*([smh])\s*$')
_UNIT = {'s': 1.0, 'm': 60.0, 'h': 3600.0}


def parse_duration(text: str) -> float:
  """'90s' | '30m' | '2h' (decimals allowed) -> seconds; ConfigError naming time_budget otherwise."""
  match = _DURATION.match(str(text))
  if not match or float(match.group(1)) <= 0:
    raise ConfigError(f'config.time_budget={text!r} is not a duration; write a positive number with s, m or '
                      "h, e.g. --config.time_budget=90s, 30m or 2h ('' = off)")
  return float(match.group(1)) * _UNIT[match.group(2)]


def check(config: ml_collections.ConfigDict) -> None:
  optimizer = config.optimizer
  if optimizer.sam_rho < 0:
    raise ConfigError(f'config.optimizer.sam_rho={optimizer.sam_rho!r} must be >= 0 (0 = off; 0.05 is '
                      'SAM\'s)')
  if optimizer.sam_adaptive and not optimizer.sam_rho:
    raise ConfigError('config.optimizer.sam_adaptive=True needs SAM on: set --config.optimizer.sam_rho '
                      '(ASAM uses ~0.5-2) or drop sam_adaptive')
  if optimizer.muon_adam_lr < 0:
    raise ConfigError(f'config.optimizer.muon_adam_lr={optimizer.muon_adam_lr!r} must be >= 0 (0 = the '
                      'learning rate)')
  if optimizer.name in SCHEDULE_FREE:
    _check_schedule_free(config)
  if config.dtype == 'float16' and config.distill.teacher:
    raise ConfigError('config.dtype=float16 does not distil (its loss-scaled metrics have no distill_kl); '
                      'use dtype=bfloat16 or float32 with distill.teacher')
  if config.time_budget:
    parse_duration(config.time_budget)
    if config.num_train_steps > 0:
      raise ConfigError(f'config.time_budget={config.time_budget!r} sets the number of steps; drop '
                        f'--config.num_train_steps={config.num_train_steps} (or the budget)')
  lr_find = config.lr_find
  if not 0 < lr_find.min_lr < lr_find.max_lr:
    raise ConfigError(f'config.lr_find.min_lr={lr_find.min_lr!r} and max_lr={lr_find.max_lr!r} must satisfy '
                      '0 < min_lr < max_lr (e.g. 1e-6 and 10)')
  if lr_find.steps < 10:
    raise ConfigError(f'config.lr_find.steps={lr_find.steps!r} must be >= 10 (100 is usual)')
  if not 0 <= lr_find.smoothing < 1:
    raise ConfigError(f'config.lr_find.smoothing={lr_find.smoothing!r} must be in [0, 1) (0.98 is usual)')
  if not lr_find.diverge_factor > 1:
    raise ConfigError(f'config.lr_find.diverge_factor={lr_find.diverge_factor!r} must be > 1 (4 is usual)')


def _check_schedule_free(config: ml_collections.ConfigDict) -> None:
  """Schedule-free replaces the decay schedule (warmup only) and keeps x in the parameters: no wrapper
  that masks or moves them behind its back."""
  optimizer, name = config.optimizer, config.optimizer.name
  if config.schedule.name != 'constant':
    raise ConfigError(f'config.optimizer.name={name} replaces the decay schedule: use '
                      f'--config.schedule.name=constant (warmup_epochs still applies), not '
                      f'{config.schedule.name!r}')
  if not optimizer.b1 > 0:
    raise ConfigError(f'config.optimizer.b1={optimizer.b1!r} must be > 0 for {name} (0.9 is the paper\'s)')
  for key in ('freeze', 'lr_multipliers', 'freeze_after', 'layer_decay', 'lookahead_every'):
    if optimizer[key]:
      raise ConfigError(f'config.optimizer.{key} is not supported with {name} (its averaged weights would '
                        f'mix frozen or rescaled ones); drop it or pick another optimizer')
