"""The one-line value checks every section's checks share: a value one of a few, positive, in an
interval, an eval metric's name, and the keys a chosen optimizer or schedule does not read left at their
defaults. Each raises `ConfigError` naming the key, the bad value and what is allowed. No JAX."""

from __future__ import annotations

import ml_collections

from flaxtpu.settings.errors import ConfigError


def one_of(key: str, value, allowed) -> None:
  if value not in allowed:
    shown = ', '.join(repr(a) for a in allowed)
    raise ConfigError(f'config.{key}={value!r} is not valid; choose one of: {shown}')


def positive(key: str, value, allow: tuple = ()) -> None:
  if value not in allow and not value > 0:
    extra = ' (or ' + ', '.join(map(str, allow)) + ')' if allow else ''
    raise ConfigError(f'config.{key}={value!r} must be > 0{extra}')


def within(group: str, node, keys: tuple, interval: str) -> None:
  """Each of config.`group`'s `keys` in `interval`: '>= 0', '[0, 1)' or '[0, 1]'."""
  inside = {'>= 0': lambda value: value >= 0, '[0, 1)': lambda value: 0.0 <= value < 1.0,
            '[0, 1]': lambda value: 0.0 <= value <= 1.0}[interval]
  for key in keys:
    if not inside(node[key]):
      raise ConfigError(f'config.{group}.{key}={node[key]!r} must '
                        + (f'be {interval}' if interval.startswith('>') else f'be in {interval}'))


def eval_metric(key: str, metric: str) -> None:
  """`metric` names a metric the evaluation logs (eval_...)."""
  if not (isinstance(metric, str) and metric.startswith('eval_')):
    raise ConfigError(f'config.{key}={metric!r} is not an eval metric; name one that the evaluation logs, '
                      'e.g. eval_loss, eval_accuracy or eval_map')


def keeps_defaults(section: str, values: ml_collections.ConfigDict,
                   readers: dict[str, tuple[str, ...]]) -> None:
  """The keys of `readers` that `values.name` (the chosen optimizer or schedule) does not read must
  keep their defaults, as model options do."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  name, default = values.name, defaults.get_config()[section]
  for key in dict.fromkeys(key for keys in readers.values() for key in keys):
    if key not in readers[name] and values[key] != default[key]:
      takers = [taker for taker, keys in readers.items() if key in keys]
      raise ConfigError(f'config.{section}.{key}={values[key]!r} has no effect on {section}.name={name!r}; '
                        f'leave it at {default[key]!r} or pick one that reads it: {", ".join(takers)}')
