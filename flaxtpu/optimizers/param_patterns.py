"""Parameter patterns in the config: tuples of regexes (optimizer.freeze, init_from.skip) and of
'regex=value' entries (optimizer.lr_multipliers, optimizer.freeze_after), parsed and checked.

No JAX: the config checks parse them before any work; the optimizer reads the parsed pairs.
"""

from __future__ import annotations

import math
import re

from flaxtpu.settings.errors import ConfigError


def check_patterns(key: str, patterns) -> None:
  """A tuple of regexes: each must compile."""
  if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
    raise ConfigError(f'config.{key}={patterns!r} must be a tuple of regex strings, e.g. '
                      f"--config.{key}=\"('^stage1', 'Dense_0')\"")
  for pattern in patterns:
    try:
      re.compile(pattern)
    except re.error as e:
      raise ConfigError(f'config.{key} pattern {pattern!r} is not a valid regex ({e})') from e


def parse_lr_multipliers(entries) -> list[tuple[str, float]]:
  """('^stage1=0.1', 'Dense_0=10') -> [('^stage1', 0.1), ('Dense_0', 10.0)]; bad entries are ConfigError."""
  return _parse_pattern_values('optimizer.lr_multipliers', entries, 'factor', "'^stage1=0.1'")


def parse_freeze_after(entries) -> list[tuple[str, float]]:
  """('^stem/bias$=3',) -> [('^stem/bias$', 3.0)]: those parameters stop changing after 3 epochs."""
  return _parse_pattern_values('optimizer.freeze_after', entries, 'epochs', "'^stem/bias$=3'")


def _parse_pattern_values(key: str, entries, value_name: str, example: str) -> list[tuple[str, float]]:
  """A tuple of 'regex=value' strings (value >= 0) -> [(regex, value)]; bad entries are ConfigError.

  A tuple of strings, not a dict: the config is locked and `--config.KEY=...`
  can only override a key that exists. The value follows the last '=', so a
  regex may contain '='.
  """
  if isinstance(entries, str):
    entries = (entries,)
  parsed = []
  for entry in entries:
    pattern, _, text = str(entry).rpartition('=')
    try:
      value = float(text)
    except ValueError:
      value = -1.0
    if not pattern or not value >= 0 or math.isinf(value):
      raise ConfigError(f'config.{key} entry {entry!r} must be \'regex={value_name}\' with '
                        f'{value_name} >= 0, e.g. --config.{key}="({example},)"')
    parsed.append((pattern, value))
  check_patterns(key, [pattern for pattern, _ in parsed])
  return parsed
