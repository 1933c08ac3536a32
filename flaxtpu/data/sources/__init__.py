"""The source kinds, one file each, and the registry that picks one for a dataset spec.

Each kind (a `base.Source` subclass) owns the config.dataset key that
selects it, the checks on its keys (`check`, run by config validation) and
the keys it adds (`keys`). `get` asks the kinds in order: every kind with a
key of its own in registration order (label file, tar shards, parquet, then
any registered later), then the fallbacks (folder, embedded, TFDS). A new
kind is a module with a `Source` subclass and one `register(Kind)` line.
"""

from __future__ import annotations

from flaxtpu.data.sources.base import DataError as DataError
from flaxtpu.data.sources.base import Source
from flaxtpu.data.sources.base import Split as Split
from flaxtpu.settings.errors import ConfigError, join_or

KINDS: list[type[Source]] = []  # in registration order; `ordered` puts the fallbacks last


def register(kind: type[Source]) -> type[Source]:
  """Adds a kind (usable as a class decorator); registering a name again replaces that kind."""
  _load_builtins()
  KINDS[:] = [known for known in KINDS if known.kind != kind.kind] + [kind]
  return kind


def ordered() -> list[type[Source]]:
  """The kinds in the order `get` asks them."""
  _load_builtins()
  return [kind for kind in KINDS if not kind.fallback] + [kind for kind in KINDS if kind.fallback]


def kind_of(dataset) -> type[Source]:
  """The kind config.dataset (or a spec's settings) names: the first that `selects` it."""
  return next(kind for kind in ordered() if kind.selects(dataset))


def get(dataset, task: str = 'multiclass') -> Source:
  """The source `dataset` names: a `DatasetSpec` (its settings and task), or config.dataset with
  `task` (config.task), which decides the labels: class indices, or multi-hot rows."""
  settings, task = getattr(dataset, 'settings', dataset), getattr(dataset, 'task', task)
  return kind_of(settings).create(settings, task)


def keyed() -> list[type[Source]]:
  """The kinds selected by a key of their own (not the folder/name fallbacks)."""
  return [kind for kind in ordered() if not kind.fallback and kind.key]


def named_keys_text() -> str:
  """'labels, shards or parquet': the keys besides folder and name that name a dataset."""
  return join_or([kind.key for kind in keyed()])


def multilabel_keys_text() -> str:
  """How a message names the keys of the kinds that read tags."""
  keys = [kind.key for kind in keyed() if kind.multilabel]
  return join_or([f'{keys[0]} (a CSV or JSON Lines file)' if keys[0] == 'labels' else keys[0]] + keys[1:])


def listing_titles_text() -> str:
  """'an image folder, label file, shards or parquet': the kinds that list labels without images."""
  titles = [kind.title for kind in ordered() if kind.fallback and kind.lists_labels] + [
      kind.title for kind in keyed() if kind.lists_labels]
  return 'an ' + join_or(titles)


def named(dataset) -> list[str]:
  """The keys of keyed kinds that `dataset` sets."""
  return [kind.key for kind in keyed() if dataset.get(kind.key)]


def multilabel_named(dataset) -> bool:
  """Whether `dataset` names a kind whose labels can carry any number of tags."""
  return any(dataset.get(kind.key) for kind in keyed() if kind.multilabel)


def check_selection(dataset) -> None:
  """Config validation: at most one keyed kind named."""
  names = named(dataset)
  if len(names) > 1:
    raise ConfigError(f'config.dataset.{names[0]} and config.dataset.{names[1]} are both set; '
                      'a run reads one dataset: keep one of them')


def check(config) -> None:
  """Config validation: each kind's checks of its own keys."""
  for kind in ordered():
    kind.check(config)


def declare_keys(config) -> None:
  """Adds the config.dataset keys that registered kinds declare (`Source.keys`) where missing."""
  with config.unlocked():
    for kind in ordered():
      for key, default in kind.keys.items():
        if key not in config.dataset:
          config.dataset[key] = default


def _load_builtins() -> None:
  """Registers the built-in kinds, in `get`'s order, the first time the registry is used (their
  modules import the samplers, which import this package: loading them here keeps that one-way)."""
  if _loaded:
    return
  _loaded.append(True)
  # pylint: disable=g-import-not-at-top
  from flaxtpu.data.sources import embedded, folder, label_file, parquet, shards, tfds
  KINDS[:0] = [label_file.LabelFileSource, shards.ShardSource, parquet.ParquetSource, folder.FolderSource,
               embedded.EmbeddedSource, tfds.TfdsSource]


_loaded: list = []
