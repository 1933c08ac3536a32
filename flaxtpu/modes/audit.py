"""--mode=audit: a dataset's duplicates, leaks across splits, unreadable files and (with a trained run in
the workdir) suspected wrong labels -> WORKDIR/audit.json, audit.png and a summary in the log.

The findings are computed by `flaxtpu.audit` from hashes and a trained model's probabilities, streamed
file by file. It reads datasets of image files with one class each: image folders and label files
(local or in a bucket); other kinds (TFDS, Parquet, tar shards, arrays) are refused in one line.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os

import jax
import ml_collections
import numpy as np

from flaxtpu import audit, files
from flaxtpu.data import pipeline, predict_inputs, preprocess, sources
from flaxtpu.data.sources.folder import FileRecords
from flaxtpu.errors import UserError
from flaxtpu.lengths import resolved_eval_batch_size

AUDIT_FILE, PLOT_FILE = 'audit.json', 'audit.png'
TOP_CLASSES = 5  # the most probable classes kept per image for confident learning
AUDITED_KINDS = ('folder', 'labels')  # sources of image files (FileRecords), local or in a bucket
SCHEMA = ('exact_duplicates', 'near_duplicates', 'leaks', 'unreadable', 'suspected_mislabels', 'class_counts')


def run_audit(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """--mode=audit: audit.json (the six findings of `SCHEMA`), audit.png; returns the full report."""
  if config.task == 'multilabel':
    raise UserError('--mode=audit reads single-label datasets; a multilabel run\'s tags are not audited '
                    '(drop --config.task=multilabel)')
  kind = sources.kind_of(config.dataset)
  if kind.kind not in AUDITED_KINDS:
    raise UserError(f'--mode=audit reads image files with one class each (dataset.folder or dataset.labels), '
                    f'not a {kind.title or kind.kind}; export the images to a folder first')
  source = sources.get(config.dataset, config.task)
  files.makedirs(workdir)
  restored = None
  if files.isdir(os.path.join(workdir, 'checkpoints')):
    from flaxtpu.modes.restore import restore  # pylint: disable=g-import-not-at-top
    restored = restore(config, workdir, replaces=[os.path.join(workdir, AUDIT_FILE)])
  class_names = restored[3].get('class_names') if restored else None
  train_spec, eval_spec = config.dataset.train_split, config.dataset.eval_split
  train, evaluation, class_names = source.splits(train_spec if train_spec != eval_spec else None, eval_spec,
                                                 class_names)
  listed = [split for split in (train, evaluation) if split is not None]
  assert all(isinstance(split.records, FileRecords) and split.labels.ndim == 1 for split in listed)
  names = [spec for spec, split in ((train_spec, train), (eval_spec, evaluation)) if split is not None]
  scanned = audit.scan([(name, [split.describe(i) for i in range(len(split))], split.labels)
                        for name, split in zip(names, listed)], config.audit.workers)
  report = audit.duplicates(scanned, config.audit.near_distance, eval_spec)
  report['unreadable'] = sorted(path for path, _ in scanned.unreadable)
  for path, reason in scanned.unreadable:
    logging.warning('%s %s', path, reason)
  if restored:
    report['suspected_mislabels'] = _mislabels(config, restored, scanned, class_names)
    note = f'confident learning with checkpoint step {restored[2]}'
  else:
    report['suspected_mislabels'] = []
    note = f'no trained run in --workdir={workdir} (no checkpoints/) to predict with: not looked for'
  report['class_counts'] = audit.class_counts(scanned, class_names)
  output = {key: report[key] for key in SCHEMA}
  if jax.process_index() == 0:
    with files.writing(os.path.join(workdir, AUDIT_FILE), 'free disk space or choose a writable --workdir'):
      files.write_json(os.path.join(workdir, AUDIT_FILE), output)
      plot_audit(os.path.join(workdir, PLOT_FILE), output)
  full = {**output, 'images': len(scanned.paths) + len(scanned.unreadable), 'splits': names,
          'near_distance': config.audit.near_distance, 'mislabels_note': note}
  logging.info('%s\n  -> %s, %s', audit.summary(full), os.path.join(workdir, AUDIT_FILE),
               os.path.join(workdir, PLOT_FILE))
  return full


def _mislabels(config: ml_collections.ConfigDict, restored, scanned: audit.Scan,
               class_names) -> list[dict]:
  """Confident learning over every readable image, its probabilities streamed batch by batch."""
  from flaxtpu.modes.predict import predict_logits  # pylint: disable=g-import-not-at-top
  placement, state, _, record = restored
  image_shape = tuple(record['image_shape'])
  transform = pipeline.image_transform(config, channels=image_shape[-1])
  batch_size = resolved_eval_batch_size(config)
  labels = np.asarray(scanned.labels)
  keep = min(TOP_CLASSES, len(class_names))
  own, top_classes, top_probabilities = [], [], []
  prepare = functools.partial(predict_inputs.prepare, image_shape=image_shape, transform=transform)
  with concurrent.futures.ThreadPoolExecutor(max_workers=config.audit.workers) as pool:
    for start in range(0, len(scanned.paths), batch_size):
      images = np.stack(list(pool.map(prepare, scanned.paths[start:start + batch_size])))
      probabilities = np.asarray(jax.nn.softmax(predict_logits(placement, state, images, batch_size), -1))
      chunk_labels = labels[start:start + batch_size]
      own.append(probabilities[np.arange(len(images)), chunk_labels])
      order = np.argsort(-probabilities, axis=1, kind='stable')[:, :keep]
      top_classes.append(order)
      top_probabilities.append(np.take_along_axis(probabilities, order, axis=1))
  if not own:
    return []
  found = audit.suspected_mislabels(labels, np.concatenate(own), np.concatenate(top_classes),
                                    np.concatenate(top_probabilities), len(class_names))
  return [{'path': scanned.paths[i], 'label': class_names[labels[i]], 'predicted': class_names[likely],
           'score': round(score, 6)} for i, likely, score in found]


def plot_audit(path: str, report: dict, examples: int = 5) -> None:
  """audit.png: images per class and split (bars), and a row of examples of each kind of finding."""
  from flaxtpu.report import plots  # pylint: disable=g-import-not-at-top
  pyplot = plots._pyplot()  # pylint: disable=protected-access
  rows = [(kind, items) for kind, items in (
      ('exact duplicates', [group[:2] for group in report['exact_duplicates']]),
      ('near duplicates', [group[:2] for group in report['near_duplicates']]),
      ('leaks (train | eval)', report['leaks']),
      ('suspected mislabels', [[m['path']] for m in report['suspected_mislabels']])) if items]
  figure = pyplot.figure(figsize=(12, 3 + 2 * len(rows)))
  grid = figure.add_gridspec(1 + len(rows), examples, height_ratios=[1.5] + [1] * len(rows))
  bars = figure.add_subplot(grid[0, :])
  counts = report['class_counts']
  names = list(next(iter(counts.values()), {}))
  width = 0.8 / max(1, len(counts))
  for offset, (split, per_class) in enumerate(counts.items()):
    bars.bar(np.arange(len(names)) + offset * width, [per_class[n] for n in names], width, label=split)
  bars.set_xticks(np.arange(len(names)) + 0.4 - width / 2, [plots._short(n, 12) for n in names],  # pylint: disable=protected-access
                  rotation=90 if len(names) > 12 else 0, fontsize=7)
  bars.set_ylabel('images')
  bars.legend(fontsize=8)
  bars.set_title(f'images per class; {len(report["unreadable"])} unreadable', fontsize=9)
  for row, (kind, items) in enumerate(rows, 1):
    for column, item in enumerate(items[:examples]):
      axis = figure.add_subplot(grid[row, column])
      axis.axis('off')
      try:
        thumbnail = lambda p: np.asarray(preprocess.decode(preprocess.open_image(p), 3).resize((64, 64)))
        axis.imshow(np.concatenate([thumbnail(p) for p in item], axis=1))
      except Exception:  # pylint: disable=broad-except
        continue
      title = ' | '.join(plots._short(os.path.basename(p), 14) for p in item)  # pylint: disable=protected-access
      if kind == 'suspected mislabels':
        mislabel = report['suspected_mislabels'][column]
        title = f'{mislabel["label"]} -> {mislabel["predicted"]} ({mislabel["score"]:.2f})'
      axis.set_title(f'{kind}\n{title}' if column == 0 else title, fontsize=7)
  figure.tight_layout()
  plots._save_figure(figure, path)  # pylint: disable=protected-access
