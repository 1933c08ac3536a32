"""Read what a sweep's runs left behind and summarise it: DIR/results.md, DIR/results.csv, DIR/plots/*.png.

DIR may be a bucket (gs://): everything is read and written through flaxtpu.io.files (each file whole).
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from flaxtpu.io import files
from flaxtpu.report import html
from flaxtpu.report import plots as run_plots
from flaxtpu.sweep.runner import DONE, PENDING, RESULTS_FILE, RUNNING, Run, format_value, read_sweep_record

METRICS_FILE = 'metrics.jsonl'
MAX_RANKED_RUNS = 50  # runs in plots/final_eval_accuracy.png
PLOTS_DIR = 'plots'

REPORT_COLUMNS = ('eval_accuracy', 'best_eval_accuracy', 'eval_loss', 'train_loss', 'step',
                  'train_images_per_sec', 'wall_time_s')
# Shown after eval_accuracy when some run has them (EMA weights, more than 5 classes).
OPTIONAL_COLUMNS = ('eval_accuracy_ema', 'eval_top5_accuracy', 'eval_balanced_accuracy', 'eval_map',
                    'eval_f1')


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """The records of a run's metrics.jsonl (a torn last line from an interrupted run is skipped)."""
  return files.read_jsonl(os.path.join(run_dir, METRICS_FILE))


def metric_curve(records: Sequence[Mapping[str, Any]], metric: str) -> tuple[list[float], list[float]]:
  """(steps, values) of one metric from metrics.jsonl records, in step order."""
  points = sorted((record['step'], record[metric]) for record in records
                  if metric in record and 'step' in record and record[metric] is not None)
  return [step for step, _ in points], [value for _, value in points]


def collect_results(workdir: str, runs: Sequence[Run], config: ml_collections.ConfigDict | None = None,
                    statuses: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
  """One row per run (swept values, results.json numbers, best eval accuracy, status, error), best first.

  A key that some runs sweep and others leave alone shows the base `config`'s value for the latter.
  `statuses` (a study's trial states: complete, pruned, failed) replace what the sweep record says.
  """
  base_values = {key: config[key] for key in _swept_keys(runs)} if config is not None else {}
  record = read_sweep_record(workdir)
  recorded = {entry['name']: entry for entry in record.get('runs', [])}
  # A SLURM sweep's record holds what the queue said just before this report; the local runner's
  # 'running' without results means that sweep was stopped.
  live_statuses = record.get('launcher') == 'slurm'
  rows = []
  for order, run in enumerate(runs):
    run_dir = os.path.join(workdir, run.name)
    results = files.read_json(os.path.join(run_dir, RESULTS_FILE)) or {}
    _, eval_accuracies = metric_curve(read_metrics(run_dir), 'eval_accuracy')
    if 'eval_accuracy' in results:
      eval_accuracies.append(results['eval_accuracy'])
    if statuses is not None:
      status, error = statuses[run.name], run.error
    elif results:
      status, error = DONE, ''
    else:
      # Status of a run without results: what the last sweep saw, or what its directory shows.
      default_status = 'incomplete' if files.isdir(run_dir) else PENDING
      status = recorded.get(run.name, {}).get('status', default_status)
      if status == DONE or (status == RUNNING and not live_statuses):
        status = 'incomplete'
      error = recorded.get(run.name, {}).get('error', '')
    row = {'run': run.name, **base_values, **run.overrides}
    row.update({column: results.get(column) for column in REPORT_COLUMNS + OPTIONAL_COLUMNS})
    row['best_eval_accuracy'] = max(eval_accuracies) if eval_accuracies else None
    row.update(status=status, error=error, _order=order)
    rows.append(row)
  # Best final accuracy first; runs without one keep sweep order at the end.
  rows.sort(key=lambda row: (row['eval_accuracy'] is None, -(row['eval_accuracy'] or 0.0), row['_order']))
  for row in rows:
    del row['_order']
  return rows


def _swept_keys(runs: Sequence[Run]) -> list[str]:
  keys: list[str] = []
  for run in runs:
    keys += [key for key in run.overrides if key not in keys]
  return keys


ROUNDED_COLUMNS = ('eval_accuracy', 'best_eval_accuracy', 'eval_loss', 'train_loss') + OPTIONAL_COLUMNS


def _markdown_cell(column: str, value: Any) -> str:
  if value is None:
    return '-'
  if isinstance(value, float) and column in ROUNDED_COLUMNS:
    return f'{value:.4f}'
  if column in ('train_images_per_sec', 'wall_time_s') and isinstance(value, (int, float)):
    return f'{value:.0f}'
  return format_value(value).replace('|', '\\|')


HEADERS = {'eval_accuracy': 'eval acc', 'best_eval_accuracy': 'best eval acc', 'eval_loss': 'eval loss',
           'train_loss': 'train loss', 'step': 'steps', 'train_images_per_sec': 'images/s',
           'wall_time_s': 'wall s', 'status': 'status', 'eval_accuracy_ema': 'eval acc (EMA)',
           'eval_top5_accuracy': 'eval top-5', 'eval_balanced_accuracy': 'eval balanced acc.',
           'eval_map': 'eval mAP', 'eval_f1': 'eval F1'}


def table_columns_of(runs: Sequence[Run], rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """The columns results.md and report.html show: swept keys, metrics some run has, status."""
  optional = [column for column in OPTIONAL_COLUMNS if any(row.get(column) is not None for row in rows)]
  return _swept_keys(runs) + [REPORT_COLUMNS[0], *optional, *REPORT_COLUMNS[1:]] + ['status']


def write_page(workdir: str, runs: Sequence[Run], rows: Sequence[Mapping[str, Any]], title: str,
               plots: Sequence[str], notes: Sequence[str] = ()) -> None:
  """DIR/report.html: the results table and the plots on one self-contained page (`report.html`)."""
  columns = table_columns_of(runs, rows)
  errors = [(row['run'], row['error']) for row in rows if row['error']]
  cells = [[row['run']] + [row.get(c) for c in columns] for row in rows]
  sections = [('results', 'Results', html.table(['run'] + [HEADERS.get(c, c) for c in columns], cells)
               + ''.join(html.note(line) for line in notes)),
              ('plots', 'Plots', ''.join(html.image(path, os.path.basename(path)) for path in plots)
               or html.note('no run has logged metrics yet'))]
  if errors:
    sections.append(('errors', 'Errors', html.table(('run', 'error'), errors)))
  html.write(os.path.join(workdir, 'report.html'), html.page(title, sections))


def write_tables(workdir: str, runs: Sequence[Run], rows: Sequence[Mapping[str, Any]], title: str,
                 notes: Sequence[str] = ()) -> None:
  """DIR/results.csv (exact numbers) and DIR/results.md (rounded; failed runs' errors below the table,
  then `notes`' lines)."""
  keys = _swept_keys(runs)
  optional = [column for column in OPTIONAL_COLUMNS if any(row.get(column) is not None for row in rows)]
  metrics = [REPORT_COLUMNS[0], *optional, *REPORT_COLUMNS[1:]]
  columns = ['run'] + keys + metrics + ['status', 'error']
  def write_csv(path: str) -> None:
    with open(path, 'w', newline='') as f:
      writer = csv.writer(f)
      writer.writerow(columns)
      for row in rows:
        writer.writerow(['' if row.get(column) is None else
                         (repr(row[column]) if isinstance(row[column], float) else row[column])
                         for column in columns])

  files.atomic_write(os.path.join(workdir, 'results.csv'), write_csv)
  table_columns = table_columns_of(runs, rows)
  headers = HEADERS
  lines = [f'# {title}', '', '| ' + ' | '.join(headers.get(c, c) for c in table_columns) + ' |',
           '|' + '|'.join('---' for _ in table_columns) + '|']
  for row in rows:
    lines.append('| ' + ' | '.join(_markdown_cell(c, row.get(c)) for c in table_columns) + ' |')
  errors = [row for row in rows if row['error']]
  if errors:
    lines += ['', 'Errors:', '']
    lines += [f'- `{row["run"]}`: {row["error"]}' for row in errors]
  if notes:
    lines += ['', *notes]
  files.atomic_write(os.path.join(workdir, 'results.md'),
                     lambda path: _write_text(path, '\n'.join(lines) + '\n'))


def _write_text(path: str, text: str) -> None:
  with open(path, 'w') as f:
    f.write(text)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def ranked_runs(rows: Sequence[Mapping[str, Any]], width: int = 70) -> tuple[list[str], list[float]]:
  """(labels, final eval accuracies) of the finished runs, worst first (a plot's y axis grows upward).

  A run name longer than `width` keeps its start and its end (a long name ends in a hash that tells
  it apart from its neighbours).
  """
  finished = sorted((row for row in rows if row['eval_accuracy'] is not None),
                    key=lambda row: row['eval_accuracy'])
  labels = [row['run'] if len(row['run']) <= width else f"{row['run'][:width - 10]}…{row['run'][-9:]}"
            for row in finished]
  return labels, [row['eval_accuracy'] for row in finished]


@run_plots.plain_text
def write_plots(workdir: str, runs: Sequence[Run], rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """DIR/plots/*.png: eval accuracy and train loss curves, every run's final eval accuracy, and final eval
  accuracy against each swept key."""
  import matplotlib  # Imported here: the runner and the experiment files never need it.
  matplotlib.use('Agg')
  from matplotlib import pyplot

  plots_dir = os.path.join(workdir, PLOTS_DIR)
  files.makedirs(plots_dir)
  written = []

  def save(figure, axes, name: str, legend_entries: int) -> None:
    if 0 < legend_entries <= 12:
      axes.legend(fontsize=6)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = os.path.join(plots_dir, name)
    files.atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=80, format='png'))
    pyplot.close(figure)
    written.append(path)

  for metric, label in (('eval_accuracy', 'eval accuracy'), ('train_loss', 'train loss')):
    figure, axes = pyplot.subplots(figsize=(6, 4))
    plotted = 0
    for run in runs:
      steps, values = metric_curve(read_metrics(os.path.join(workdir, run.name)), metric)
      if steps:
        axes.plot(steps, values, marker='.' if len(steps) < 30 else None, label=run.name)
        plotted += 1
    if not plotted:
      pyplot.close(figure)
      continue
    axes.set(xlabel='step', ylabel=label, title=f'{label} per run')
    save(figure, axes, f'{metric}.png', plotted)

  labels, accuracies = ranked_runs(rows)
  if accuracies:
    # Every run's final accuracy on one axis, best at the top: readable at any number of runs (the
    # curves' legend is not past 12), and the picture of a sweep whose runs evaluate only at their end.
    title = f'final eval accuracy per run ({len(accuracies)} finished)'
    if len(accuracies) > MAX_RANKED_RUNS:  # a big sweep: its best runs (results.csv has them all)
      title = f'final eval accuracy of the best {MAX_RANKED_RUNS} runs (of {len(accuracies)} finished)'
      labels, accuracies = labels[-MAX_RANKED_RUNS:], accuracies[-MAX_RANKED_RUNS:]
    figure, axes = pyplot.subplots(figsize=(8, 1.2 + 0.25 * len(accuracies)))
    axes.plot(accuracies, range(len(accuracies)), 'o')
    for position, accuracy in enumerate(accuracies):
      axes.annotate(f'{accuracy:.4f}', (accuracy, position), xytext=(4, 0), textcoords='offset points',
                    va='center', fontsize=7)
    axes.set_yticks(range(len(accuracies)), labels, fontsize=7)
    axes.margins(x=0.15)
    axes.set(xlabel='final eval accuracy', title=title)
    save(figure, axes, 'final_eval_accuracy.png', 0)

  finished = [row for row in rows if row['eval_accuracy'] is not None]
  keys = _swept_keys(runs)
  for key in keys:
    values = [row.get(key) for row in finished]
    if len({format_value(value) for value in values}) < 2:
      continue
    numeric = all(_is_number(value) for value in values)
    if not numeric:
      # Categorical axis: values in order of first appearance.
      categories = list(dict.fromkeys(format_value(value) for value in values))
    # One line per combination of the other swept keys, so lr x schedule reads as one curve per schedule.
    other_keys = [other for other in keys if other != key
                  and len({format_value(row.get(other)) for row in finished}) > 1]
    groups: dict[str, list[tuple[float, float]]] = {}
    for row in finished:
      group = ','.join(f'{other}={format_value(row.get(other))}' for other in other_keys if other in row)
      x = row[key] if numeric else categories.index(format_value(row[key]))
      groups.setdefault(group, []).append((x, row['eval_accuracy']))
    figure, axes = pyplot.subplots(figsize=(6, 4))
    for group, points in groups.items():
      points.sort()
      axes.plot([x for x, _ in points], [y for _, y in points], marker='o', label=group or None)
    if numeric and min(values) > 0 and max(values) / min(values) >= 10:
      axes.set_xscale('log')
    if not numeric:
      axes.set_xticks(range(len(categories)), categories, rotation=20, fontsize=7)
    axes.set(xlabel=key, ylabel='final eval accuracy', title=f'final eval accuracy vs {key}')
    save(figure, axes, f'eval_accuracy_vs_{re.sub(r"[^A-Za-z0-9._-]", "_", key)}.png',
         len(groups) if any(groups) else 0)
  return written


def write_report(experiment_path: str, workdir: str, runs: Sequence[Run],
                 config: ml_collections.ConfigDict | None = None, statuses: Mapping[str, str] | None = None,
                 notes: Sequence[str] = (), title: str = '') -> list[dict[str, Any]]:
  """Write DIR/results.md, DIR/results.csv, DIR/plots/*.png and DIR/report.html (all on one page);
  returns the table rows, best first."""
  rows = collect_results(workdir, runs, config, statuses)
  files.makedirs(workdir)
  write_tables(workdir, runs, rows, title=title or f'{experiment_path} ({len(runs)} runs)', notes=notes)
  plots = write_plots(workdir, runs, rows)
  write_page(workdir, runs, rows, title or f'{experiment_path} ({len(runs)} runs)', plots, notes)
  return rows

