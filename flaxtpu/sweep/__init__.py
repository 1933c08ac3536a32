"""Define config sweeps, run them locally one process per run, tabulate and plot the results.

An experiment file (`experiments/*.py`) is itself a config file: `get_config()`
returns the base config and `get_sweep()` returns the runs as a list of
override dicts `{dotted.config.key: value}`, built with `sweep`, `product`,
`zip_` and `chain` from this module:

    def get_sweep():
      return sweep.product(
          sweep.sweep('optimizer.learning_rate', [0.05, 0.1, 0.2]),
          sweep.sweep('schedule.name', ['cosine', 'onecycle']))

Run it (each run is a normal `python -m flaxtpu.main` process in
`DIR/<run name>`; re-running skips finished runs and resumes the others):

    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/lr [--parallel=N]
    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/lr --dry-run
    python -m flaxtpu.sweep experiments/cifar10_lr.py --workdir=runs/sweeps/lr --report

An experiment may define `get_search(trial)` instead: `--trials=N` runs an
Optuna study over it (`study`; docs/search.md).

`runner` makes the runs and `processes` launches them, `report` writes the tables
and plots, `__main__` is the command line. The package only launches processes and reads files: it must
never import JAX (experiment files import it, and `flaxtpu.main` loads
experiment files before JAX starts).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Overrides = dict[str, Any]
Sweep = list[Overrides]


class SweepError(Exception):
  """A mistake in an experiment file or on the command line, reported as one `error:` line."""


def sweep(key: str, values: Iterable[Any]) -> Sweep:
  """One run per value of a single config key: `sweep('seed', [0, 1])` -> `[{'seed': 0}, {'seed': 1}]`."""
  if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
    raise SweepError(f'sweep({key!r}, ...) needs a list of values, got {values!r}')
  return [{key: value} for value in values]


def _merge(parts: Sequence[Mapping[str, Any]], combinator: str) -> Overrides:
  merged: Overrides = {}
  for part in parts:
    for key, value in part.items():
      # Two factors setting one key would silently make one of them a no-op.
      if key in merged:
        raise SweepError(f'{combinator}: config key {key!r} is set by more than one of its sweeps')
      merged[key] = value
  return merged


def product(*sweeps: Sequence[Mapping[str, Any]]) -> Sweep:
  """Every combination of the given sweeps; the first sweep varies slowest (like `itertools.product`)."""
  return [_merge(parts, 'product') for parts in itertools.product(*sweeps)]


def zip_(*sweeps: Sequence[Mapping[str, Any]]) -> Sweep:
  """The i-th runs of equally long sweeps merged into one run each (like `zip`, but lengths must match)."""
  lengths = [len(one_sweep) for one_sweep in sweeps]
  if len(set(lengths)) > 1:
    raise SweepError(f'zip_: sweeps have different lengths {lengths}')
  return [_merge(parts, 'zip_') for parts in zip(*sweeps)]


def chain(*sweeps: Sequence[Mapping[str, Any]]) -> Sweep:
  """The runs of each sweep one after the other."""
  return [dict(overrides) for one_sweep in sweeps for overrides in one_sweep]
