"""experiments/results/ keeps tables and plots only: a sweep's runs (whole workdirs, named by their
overrides: `=`, `,`, `__`) are written under the sweep's --workdir, never here."""

import pathlib

from conftest import ROOT

RESULTS = pathlib.Path(ROOT) / 'experiments' / 'results'
TABLES_AND_PLOTS = {'.md', '.csv', '.json', '.png', '.svg'}
RUN_FILES = {'config.json', 'metrics.jsonl', 'per_class.csv', 'checkpoints', 'events.out.tfevents'}


def test_results_hold_tables_and_plots_only():
  assert RESULTS.is_dir()
  found = [path for path in RESULTS.rglob('*') if '__pycache__' not in path.parts]
  assert any(path.name == 'results.md' for path in found)  # the walk sees the tables
  for path in found:
    relative = path.relative_to(RESULTS)
    assert not any(mark in part for part in relative.parts for mark in ('=', ',', '__')), (
        f'experiments/results/{relative}: a run folder; runs go under the sweep\'s --workdir')
    assert not any(part in RUN_FILES or part.startswith('events.out') for part in relative.parts), (
        f'experiments/results/{relative}: a run\'s own file; keep its sweep\'s tables and plots only')
    if path.is_file():
      assert path.suffix in TABLES_AND_PLOTS, f'experiments/results/{relative}: not a table or a plot'
