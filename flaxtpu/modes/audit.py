"""--mode=audit: a dataset's duplicates, leaks across splits, unreadable files and suspected wrong labels
-> WORKDIR/audit.json, audit.png and a summary in the log.

The findings are computed by `flaxtpu.data.audit` from hashes, streamed file by file, and from out-of-fold
probabilities (`flaxtpu.modes.audit_folds`: runs of the recipe, each as long as the run, on K - 1 folds,
or `audit_features`: a linear probe per fold on frozen embeddings); fold models near chance list no
suspects, and say so. It reads datasets of image files with one class each: image folders and label files
(local or in a bucket); other kinds (TFDS, Parquet, tar shards, arrays) are refused in one line.
"""

from __future__ import annotations

import logging
import os

import jax
import ml_collections
import numpy as np

from flaxtpu.data import audit, preprocess, sources
from flaxtpu.data.sources.folder import FileRecords
from flaxtpu.io import files
from flaxtpu.modes import audit_features, audit_folds
from flaxtpu.settings.errors import UserError

AUDIT_FILE, PLOT_FILE = 'audit.json', 'audit.png'
AUDITED_KINDS = ('folder', 'labels')  # sources of image files (FileRecords), local or in a bucket
SCHEMA = ('exact_duplicates', 'near_duplicates', 'leaks', 'unreadable', 'suspected_mislabels',
          'mislabel_search', 'class_counts')


def run_audit(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """--mode=audit: audit.json (the findings of `SCHEMA`), audit.png; returns the full report."""
  if config.task == 'multilabel':
    raise UserError('--mode=audit reads single-label datasets; a multilabel run\'s tags are not audited '
                    '(drop --config.task=multilabel)')
  kind = sources.kind_of(config.dataset)
  if kind.kind not in AUDITED_KINDS:
    raise UserError(f'--mode=audit reads image files with one class each (dataset.folder or dataset.labels), '
                    f'not a {kind.title or kind.kind}; export the images to a folder first')
  source = sources.get(config.dataset, config.task)
  files.makedirs(workdir)
  train_spec, eval_spec = config.dataset.train_split, config.dataset.eval_split
  train, evaluation, class_names = source.splits(train_spec if train_spec != eval_spec else None, eval_spec,
                                                 _trained_class_names(config, workdir))
  listed = [split for split in (train, evaluation) if split is not None]
  assert all(isinstance(split.records, FileRecords) and split.labels.ndim == 1 for split in listed)
  names = [spec for spec, split in ((train_spec, train), (eval_spec, evaluation)) if split is not None]
  scanned = audit.scan([(name, [split.describe(i) for i in range(len(split))], split.labels)
                        for name, split in zip(names, listed)], config.audit.workers)
  report = audit.duplicates(scanned, config.audit.near_distance, eval_spec)
  report['unreadable'] = sorted(path for path, _ in scanned.unreadable)
  for path, reason in scanned.unreadable:
    logging.warning('%s %s', path, reason)
  report['suspected_mislabels'], report['mislabel_search'] = _mislabels(config, workdir, scanned, class_names,
                                                                        source.channels)
  report['class_counts'] = audit.class_counts(scanned, class_names)
  output = {key: report[key] for key in SCHEMA}
  if jax.process_index() == 0:
    with files.writing(os.path.join(workdir, AUDIT_FILE), 'free disk space or choose a writable --workdir'):
      files.write_json(os.path.join(workdir, AUDIT_FILE), output)
      plot_audit(os.path.join(workdir, PLOT_FILE), output)
  full = {**output, 'images': len(scanned.paths) + len(scanned.unreadable), 'splits': names,
          'near_distance': config.audit.near_distance}
  logging.info('%s\n  -> %s, %s', audit.summary(full), os.path.join(workdir, AUDIT_FILE),
               os.path.join(workdir, PLOT_FILE))
  return full


def _trained_class_names(config: ml_collections.ConfigDict, workdir: str):
  """The classes of the run trained in `workdir` (its labels' order), or None without one."""
  if not files.isdir(os.path.join(workdir, 'checkpoints')):
    return None
  from flaxtpu.weights import checkpoint  # pylint: disable=g-import-not-at-top
  checkpoints = checkpoint.Checkpoints(workdir, config, read_only=True)
  try:
    latest = checkpoints.latest_step()
    return None if latest is None else checkpoints.read_record(latest).get('class_names')
  except checkpoint.UnreadableCheckpoint:
    return None
  finally:
    checkpoints.close()


def _mislabels(config: ml_collections.ConfigDict, workdir: str, scanned: audit.Scan, class_names,
               channels: int) -> tuple[list[dict], dict]:
  """Confident learning over out-of-fold probabilities (`audit_folds`): the suspects, most suspect
  first, and how they were looked for (audit.json's mislabel_search), with each fold model's held-out
  accuracy beside chance and the run's own; none listed when the fold models are near chance or would
  flag most of the images (`audit.verdict`)."""
  settings = config.audit
  run = audit_folds.trained_run(config, workdir) if settings.folds else None
  if run is not None:  # its recipe, as --mode=eval restores it, not a config file without its overrides
    if run.differences:
      shown = '; '.join(run.differences[:8]) + (f'; and {len(run.differences) - 8} more'
                                                  if len(run.differences) > 8 else '')
      logging.info('audit: the fold runs train the recipe of the run in %s (%s), not the given config\'s: %s',
                   workdir, run.source, shown)
    config = run.config
  if settings.folds and config.init_from.checkpoint:  # fold runs and the backbone read data as training does
    from flaxtpu.validation import resolution  # pylint: disable=g-import-not-at-top
    config = config.copy_and_resolve_references()
    resolution.apply_source_defaults(config)
  backbone = None
  if settings.folds and len(scanned.paths) > settings.fold_limit and settings.large != 'sample':
    backbone = audit_features.backbone_of(config, workdir)
    if settings.large == 'features' and backbone is None:
      raise UserError('config.audit.large=features needs frozen embeddings: set config.init_from.checkpoint '
                      'or audit the workdir of a trained run (or use audit.large=auto or sample)')
  method, why = audit.choose_method(len(scanned.paths), settings.folds, settings.fold_limit, settings.large,
                                    backbone.name if backbone else '')
  search = {'method': method, 'why': why, 'rule': settings.rule}
  logging.info('audit: mislabel search by %s: %s', method, why)
  if method == 'none' or not scanned.paths:
    return [], search
  search['recipe'] = (f'the run in {workdir} ({run.source})' if run is not None
                      else 'the given config (no trained run in the workdir)')
  run_steps = _run_steps(config, run, scanned) if method == 'folds' else 0
  groups = audit.copy_groups(scanned, settings.near_distance)[2]
  pool = audit_folds.Pool(paths=scanned.paths, labels=np.asarray(scanned.labels), sha=scanned.sha,
                          groups=groups)
  found = audit_folds.out_of_fold(config, workdir, pool, class_names, channels, method, backbone, run_steps)
  search.update(found.about)
  labels = pool.labels[found.scored]
  issues = audit.find_label_issues(labels, found.probabilities, settings.rule)
  accuracies = audit.fold_accuracies(labels, found.probabilities, found.folds)
  chance = audit.chance(labels, len(class_names))
  search.update({'fold_accuracies': accuracies, 'held_out_accuracy': round(float(np.mean(accuracies)), 4),
                 **chance, 'classes': len(class_names),
                 'run_eval_accuracy': (round(run.eval_accuracy, 4) if run is not None
                                       and run.eval_accuracy is not None else None)})
  if method == 'features':
    advice = ('use a backbone that knows such images (config.init_from.checkpoint) or audit.large=sample '
              '(fold runs of the recipe)')
  else:
    advice = (f'train the fold models longer: raise audit.steps_fraction (now {settings.steps_fraction:g}; '
              f'{search.get("steps")} steps each), audit.min_epochs (now {settings.min_epochs:g}) or the '
              'recipe\'s num_epochs / num_train_steps')
  outcome, note = audit.verdict(accuracies, chance['chance'], len(issues.ranked), len(labels), advice)
  search['verdict'] = outcome
  search['thresholds'] = {name: round(float(t), 6) for name, t in zip(class_names, issues.thresholds)}
  if outcome != 'listed':
    search['note'] = note
    search['withheld'] = int(len(issues.ranked))
    logging.warning('audit: %s', note)
    return [], search
  suspects = []
  for i in issues.ranked:
    likely = int(issues.likely[i])
    suspects.append({'path': pool.paths[found.scored[i]], 'label': class_names[labels[i]],
                     'predicted': class_names[likely], 'score': round(float(1 - issues.quality[i]), 6),
                     'label_probability': round(float(found.probabilities[i, labels[i]]), 6),
                     'predicted_probability': round(float(found.probabilities[i, likely]), 6)})
  return suspects, search


def _run_steps(config: ml_collections.ConfigDict, run, scanned: audit.Scan) -> int:
  """The run's own length in steps: the steps a trained run took, and at least what its recipe takes on
  its train split (num_train_steps, else num_epochs over the images it trained on: its checkpoint
  record's count, else the audited train split's)."""
  from flaxtpu.settings.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings.lengths import run_length  # pylint: disable=g-import-not-at-top
  train_split = config.dataset.train_split
  examples = (run.train_examples if run is not None and run.train_examples
              else sum(split == train_split for split in scanned.splits) or len(scanned.paths))
  try:
    planned = run_length(config, examples).total_steps
  except ConfigError:  # a batch larger than the split: the fold runs say so themselves
    planned = 0
  return max(planned, run.steps if run is not None and run.steps else 0)


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
