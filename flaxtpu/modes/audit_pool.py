"""The images the audit's mislabel search scores (`Pool`), read as the recipe reads its train split, for the
fold runs (`audit_folds`) and the feature probes (`audit_features`) alike."""

from __future__ import annotations

import dataclasses
import os

import ml_collections
import numpy as np

from flaxtpu.data import cache, pipeline
from flaxtpu.data.dataset import Dataset, Examples, image_shape
from flaxtpu.data.sources import base
from flaxtpu.data.sources.folder import FileRecords
from flaxtpu.data.spec import DatasetSpec


@dataclasses.dataclass(frozen=True)
class Pool:
  """The images the mislabel search may score: readable, one class each."""
  paths: list
  labels: np.ndarray  # int [N]
  sha: list  # bytes (32) per image: its content
  groups: np.ndarray  # int [N]: exact and near copies share a group


def pool_dataset(config: ml_collections.ConfigDict, paths: list, labels: np.ndarray, class_names,
                  channels: int) -> tuple[Dataset, Examples]:
  """The pool's images read as the recipe reads its train split (cached or streamed), and a Dataset of
  the recipe's data settings to make each fold's of."""
  spec = DatasetSpec.of(config)
  split = base.Split('audit', FileRecords('', np.asarray([os.fsencode(p) for p in paths])),
                     np.asarray(labels, np.int32))
  transform = pipeline.image_transform(spec, channels)
  native = base.sample_sizes(split)
  use = cache.use_cache(spec.cache, len(split), image_shape(native, transform, channels), transform)
  if not use and not transform.size:  # streamed at native size: every header, as the pipeline reads them
    split, native = base.scan(split, spec.workers, skip_corrupt=False)
  shape = image_shape(native, transform, channels)
  examples = cache.examples(split, cache=use, transform=transform, num_workers=spec.workers,
                            skip_corrupt=False, threads=spec.threads,
                            store=spec.settings.get('decoded_cache_dir', ''))
  template = Dataset(train=examples, eval=examples, class_names=tuple(class_names), image_shape=shape,
                     mean=np.zeros(channels, np.float32), std=np.ones(channels, np.float32),
                     transform=transform,
                     workers=spec.workers, prefetch=spec.prefetch, worker_threads=spec.threads,
                     sampling=spec.sampling, repeats=spec.repeats)
  return template, examples


def softmax(logits: np.ndarray) -> np.ndarray:
  shifted = np.asarray(logits, np.float64) - np.max(logits, axis=1, keepdims=True)
  exponentials = np.exp(shifted)
  return (exponentials / exponentials.sum(axis=1, keepdims=True)).astype(np.float32)
