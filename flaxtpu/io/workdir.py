"""What a local workdir must not hold before a run starts in it: a file where the run keeps its
checkpoints, a folder where it writes one of its files, or a finished run whose checkpoints are gone
(training would start from step 0 over its results; reading it has no weights). Each is one line
naming it, before anything is written. No JAX."""

from __future__ import annotations

import os

from flaxtpu.settings.errors import CheckpointError, UserError

# The files a run of each mode writes at the top of its workdir, each replaced whole as the run goes.
RUN_FILES = {'train': ('config.json', 'metrics.jsonl', 'results.json', 'time_budget.json', 'per_class.csv',
                       'report.html', 'curves.png', 'confusion.png', 'mistakes.png', 'reliability.png'),
             'plan': ('plan.json',)}
READING_MODES = ('eval', 'predict', 'calibrate', 'export')  # the modes that restore the run's weights


def check_before_run(workdir: str, mode: str) -> None:
  """Raises UserError (CheckpointError for a reading mode) where local `workdir` holds what a run of
  `mode` cannot work with."""
  checkpoints = os.path.join(workdir, 'checkpoints')
  if mode in RUN_FILES:
    if os.path.lexists(checkpoints) and not os.path.isdir(checkpoints):
      raise UserError(f'{checkpoints} is a file, not the folder a run keeps its checkpoints in; move it '
                      'aside, or use another --workdir')
    for name in RUN_FILES[mode]:  # a folder there would fail the run at its first write
      if os.path.isdir(path := os.path.join(workdir, name)):
        raise UserError(f'{path} is a folder, not the file a run writes there; move it aside, or use '
                        'another --workdir')
  gone = checkpoints_gone(workdir) if mode == 'train' or mode in READING_MODES else ''
  if gone and mode == 'train':
    raise UserError(f'--workdir={workdir} holds a finished run (results.json) but {gone}: training here '
                    'would start again from step 0 over its results and metrics; use another --workdir, '
                    'or move its files aside to train afresh here')
  if gone:
    raise CheckpointError(f'--workdir={workdir} holds a finished run (results.json) but {gone}: its weights '
                          'were deleted; restore them from a copy (or train again in another --workdir)')


def checkpoints_gone(workdir: str) -> str:
  """Where local `workdir` holds a finished run (results.json) and no checkpoint, what became of them;
  '' otherwise."""
  checkpoints = os.path.join(workdir, 'checkpoints')
  if not os.path.isfile(os.path.join(workdir, 'results.json')):
    return ''
  if not os.path.lexists(checkpoints):
    return f'no {checkpoints} folder'
  if not os.path.isdir(checkpoints):
    return f'{checkpoints} is a file, not its checkpoints folder'
  return '' if any(name.isdigit() for name in os.listdir(checkpoints)) else f'no checkpoint in {checkpoints}'
