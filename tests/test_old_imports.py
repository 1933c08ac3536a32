"""Old import paths keep working: issue 53 moved flaxtpu's top-level modules into packages.

`flaxtpu/__init__.py` answers `flaxtpu.<old name>` with the moved module itself: no copy, no
second module object, so a monkeypatch through either name reaches the same code.
"""

import importlib
import os
import subprocess
import sys

import pytest

import flaxtpu
from flaxtpu.io import files
from flaxtpu.optimizers import optim
from flaxtpu.settings import defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = [('optim', 'optimizers'), ('config', 'validation'), ('defaults', 'settings'), ('files', 'io'),
          ('steps', 'step'), ('errors', 'settings'), ('export', 'exporters'), ('train', 'loop')]


@pytest.mark.parametrize('old, package', [pair for pair in SAMPLE if pair[0] in flaxtpu._MOVED])
def test_old_name_is_the_same_module(old, package):
  module = importlib.import_module(f'flaxtpu.{old}')
  assert module is importlib.import_module(f'flaxtpu.{package}.{old}')
  assert module.__name__ == module.__spec__.name == f'flaxtpu.{package}.{old}'
  assert getattr(flaxtpu, old) is module


def test_every_old_name_imports():
  for old, package in sorted(flaxtpu._MOVED.items()):
    assert importlib.import_module(f'flaxtpu.{old}') is sys.modules[f'flaxtpu.{package}.{old}'], old


def test_the_three_spellings():
  import flaxtpu.optim  # noqa: F401  (the old dotted form)
  from flaxtpu import defaults as old_defaults
  from flaxtpu.files import write_json
  from flaxtpu.optim import learning_rate_schedule

  assert flaxtpu.optim is optim and old_defaults is defaults
  assert write_json is files.write_json and learning_rate_schedule is optim.learning_rate_schedule


def test_a_patch_through_the_old_name_reaches_the_module(monkeypatch):
  monkeypatch.setattr('flaxtpu.defaults.get_config', lambda: 'patched')
  assert defaults.get_config() == 'patched'


def test_packages_kept_their_names():
  from flaxtpu import data, models
  from flaxtpu.data import samplers, sampling
  from flaxtpu.models import NAMES, create, registry

  assert models.NAMES == registry.NAMES == NAMES and models.create is create is registry.create
  assert sampling.ShuffleSampler is samplers.ShuffleSampler and data.__name__ == 'flaxtpu.data'


def test_unknown_names_still_fail():
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module('flaxtpu.no_such_module')
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module('flaxtpu.optim.no_such_module')


def test_old_names_import_no_jax():
  """The config side stays JAX-free under its old names (the CLI imports it before JAX starts)."""
  code = ('import sys; from flaxtpu import config, defaults, errors, files, lengths, memory, storage; '
          'import flaxtpu.signals; assert "jax" not in sys.modules, sorted(m for m in sys.modules '
          'if m.startswith("jax"))')
  done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr
