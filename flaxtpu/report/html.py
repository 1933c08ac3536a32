"""report.html: one self-contained page of an evaluation (or of a sweep: `flaxtpu.sweep.report`).

Everything is inside the file: pictures as base64 `data:` URIs, the style inline, no script, no network,
so the page can be mailed, attached to an issue or opened from a bucket copy. `page` assembles sections
(each an `<section id=...>`, so tests and links find them); `write_page` is an evaluation's page:
config summary, curves (metrics.jsonl), per-class table, confusion matrix, mistakes (with their
explanations when the picture carries them), reliability before and after calibration, prediction-set
sizes, and the data audit's findings (audit.json) when there is one. A section without its data says
what makes it. No JAX.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flaxtpu.io import files
from flaxtpu.settings.errors import UserError

MAX_TABLE_ROWS = 200  # per-class rows shown (the CSV holds them all)
MAX_AUDIT_ITEMS = 20  # findings listed per kind (audit.json holds them all)
# The keys of config.json that the summary shows, when set.
CONFIG_KEYS = ('task', 'model.name', 'dataset.name', 'dataset.folder', 'dataset.train_split',
               'dataset.eval_split', 'dataset.image_size', 'batch_size', 'num_epochs', 'num_train_steps',
               'optimizer.name', 'optimizer.learning_rate', 'schedule.name', 'dtype', 'seed')
SECTIONS = ('summary', 'config', 'curves', 'per-class', 'confusion', 'mistakes', 'reliability', 'sets',
            'audit')

_STYLE = '''
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0; }
th, td { border: 1px solid #ccc; padding: .2em .5em; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; } .note { color: #777; font-style: italic; }
nav a { margin-right: .8em; }
'''


def escape(value: Any) -> str:
  return html.escape(str(value), quote=True)


def number(value: Any) -> str:
  """A cell: floats to 4 significant digits, NaN/None empty."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return ''
  if isinstance(value, (float, np.floating)):
    return f'{float(value):.4g}'
  return escape(value)


def image(path: str, alt: str) -> str:
  """An <img> of a PNG file, inlined; a note when the file is missing."""
  if not files.isfile(path):
    return note(f'{os.path.basename(path)} was not written')
  data = base64.b64encode(files.open_bytes(path)).decode('ascii')
  return f'<img src="data:image/png;base64,{data}" alt="{escape(alt)}">'


def note(text: str) -> str:
  return f'<p class="note">{escape(text)}</p>'


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  head = ''.join(f'<th>{escape(column)}</th>' for column in columns)
  body = ''.join('<tr>' + ''.join(f'<td>{number(cell)}</td>' for cell in row) + '</tr>' for row in rows)
  return f'<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def page(title: str, sections: Sequence[tuple[str, str, str]]) -> str:
  """The whole document: a title, a table of contents, then each (id, heading, body HTML) section."""
  contents = ''.join(f'<a href="#{escape(ident)}">{escape(heading)}</a>' for ident, heading, _ in sections)
  body = ''.join(f'<section id="{escape(ident)}"><h2>{escape(heading)}</h2>{inner}</section>'
                 for ident, heading, inner in sections)
  return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
          f'<style>{_STYLE}</style></head><body><h1>{escape(title)}</h1><nav>{contents}</nav>{body}'
          '</body></html>\n')


def write(path: str, text: str) -> None:
  """`text` at `path`, atomically."""

  def put(temporary: str) -> None:
    with open(temporary, 'w', encoding='utf-8') as f:
      f.write(text)

  files.atomic_write(path, put)


def _config_section(directory: str) -> str:
  saved = files.read_json(os.path.join(directory, 'config.json'))
  if saved is None:
    return note(f'no config.json in {directory}')
  rows = []
  for key in CONFIG_KEYS:
    value: Any = saved
    for part in key.split('.'):
      value = value.get(part) if isinstance(value, dict) else None
    if value not in (None, '', (), []):
      rows.append((key, json.dumps(value) if isinstance(value, (list, dict)) else value))
  return table(('key', 'value'), rows) + note('every key: config.json')


def _curves_section(directory: str) -> str:
  from flaxtpu.report import plots  # pylint: disable=g-import-not-at-top  (matplotlib only when drawn)
  handle, temporary = tempfile.mkstemp(suffix='.png')
  os.close(handle)
  try:
    plots.write_curves(directory, temporary)
    return image(temporary, 'training curves')
  except UserError as e:
    return note(f'no curves: {e}')
  finally:
    os.remove(temporary)


def _per_class_section(report: Mapping[str, Any]) -> str:
  names = report['class_names']
  if 'average_precision' in report:  # multilabel
    columns = ('class', 'support', 'average precision', 'threshold', 'precision', 'recall', 'F1')
    keys = ('support', 'average_precision', 'class_thresholds', 'precision', 'recall', 'f1_per_class')
  else:
    columns = ('class', 'support', 'correct', 'precision', 'recall') + (
        ('mean set size',) if 'class_set_size' in report else ())
    keys = ('support', 'correct', 'precision', 'recall') + (
        ('class_set_size',) if 'class_set_size' in report else ())
  rows = [[name] + [report[key][c] for key in keys] for c, name in enumerate(names)][:MAX_TABLE_ROWS]
  more = note(f'the first {MAX_TABLE_ROWS} of {len(names)} classes') if len(names) > MAX_TABLE_ROWS else ''
  return table(columns, rows) + more


def _audit_section(directory: str) -> str:
  """audit.json's findings (the data audit, --mode=audit): counts per kind and the first of each."""
  path = os.path.join(directory, 'audit.json')
  audit = files.read_json(path)
  if audit is None:
    return note('no audit.json: run --mode=audit to check the data for duplicates, leaks, unreadable files '
                'and suspected wrong labels')
  kinds = ('exact_duplicates', 'near_duplicates', 'leaks', 'unreadable', 'suspected_mislabels')
  parts = [table(('finding', 'count'), [(kind.replace('_', ' '), len(audit.get(kind) or []))
                                        for kind in kinds])]
  for kind in kinds:
    found = audit.get(kind) or []
    if not found:
      continue
    shown = found[:MAX_AUDIT_ITEMS]
    if kind == 'suspected_mislabels':
      body = table(('path', 'label', 'predicted', 'score'),
                   [(item.get('path'), item.get('label'), item.get('predicted'), item.get('score'))
                    for item in shown if isinstance(item, dict)])
    else:
      body = '<ul>' + ''.join(f'<li>{escape(" | ".join(map(str, item)) if isinstance(item, list) else item)}'
                              '</li>' for item in shown) + '</ul>'
    parts.append(f'<h3>{escape(kind.replace("_", " "))} ({len(found)})</h3>{body}')
  if isinstance(audit.get('class_counts'), dict):
    counts = sorted(audit['class_counts'].items())
    parts.append('<h3>class counts</h3>' + table(('class', 'examples'), counts))
  pictures = sorted(name for name in files.listdir(directory) if name.startswith('audit') and
                    name.endswith('.png'))
  parts += [image(os.path.join(directory, name), name) for name in pictures]
  return ''.join(parts)


def write_page(path: str, directory: str, suffix: str, report: Mapping[str, Any],
               summary: Mapping[str, Any]) -> None:
  """An evaluation's report{suffix}.html at `path`, from its `report` (`report.metrics`), the summary
  for eval.json (its report_files) and the files around it in `directory` (its pictures, config.json,
  metrics.jsonl, audit.json). A picture of `plots.PICTURES` without a section here gets one of its own."""
  picture = lambda name, alt: image(os.path.join(directory, f'{name}{suffix}.png'), alt)
  multilabel = 'average_precision' in report
  numbers = [('examples', report['num_examples'])]
  numbers += ([('mAP', report['map']), ('micro-F1', report['f1'])] if multilabel else
              [('accuracy', report['top1_accuracy']), ('balanced accuracy', report['balanced_accuracy'])])
  numbers.append(('ECE', report['ece']))
  for key, label in (('eval_ece_uncalibrated', 'ECE before calibration'), ('temperature', 'temperature'),
                     ('eval_set_coverage', 'prediction-set coverage'), ('eval_set_size', 'mean set size')):
    if key in summary:
      numbers.append((label, summary[key]))
  calibrated = 'ece_uncalibrated' in report
  reliability = picture('reliability', 'reliability diagram') + (
      '' if calibrated else note('uncalibrated: --mode=calibrate fits a temperature, then this picture shows '
                                 'the reliability before and after it'))
  sets = (picture('set_sizes', 'prediction-set sizes') + note(
      f'sets aim to hold the true class {report["set_target"]:.0%} of the time; harder images get larger '
      'ones') if 'set_sizes' in report else note('no prediction sets: --mode=calibrate fits them'
                                                 + (' (multiclass runs only)' if multilabel else '')))
  sections = [
      ('summary', 'Summary', table(('metric', 'value'), numbers)),
      ('config', 'Config', _config_section(directory)),
      ('curves', 'Curves', _curves_section(directory)),
      ('per-class', 'Per class', _per_class_section(report)),
      ('confusion', 'Confusion matrix', picture('confusion', 'confusion matrix')),
      ('mistakes', 'Mistakes', picture('mistakes', 'most confident mistakes')
       if files.isfile(os.path.join(directory, f'mistakes{suffix}.png')) else note('no images were kept')),
      ('reliability', 'Reliability', reliability),
      ('sets', 'Prediction sets', sets),
      ('audit', 'Data audit', _audit_section(directory)),
  ]
  shown = {f'{name}{suffix}.png' for name in ('confusion', 'mistakes', 'reliability', 'set_sizes')}
  sections += [(name, name, image(os.path.join(directory, name), name)) for name in summary['report_files']
               if name.endswith('.png') and name not in shown]
  name = os.path.basename(files.absolute(directory).rstrip('/'))
  view = suffix.strip('-_')  # what sets this evaluation apart from the run's own (another split, step...)
  write(path, page(f'{name}: evaluation' + (f' ({view})' if view else ''), sections))
