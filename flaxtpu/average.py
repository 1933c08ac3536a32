"""Model soups: `python -m flaxtpu.average --workdir=OUT RUN [RUN ...] [--greedy]`.

Averages the weights of several runs that share an initialisation (fine-tunes of one base run, with
other learning rates, seeds or augmentation): Wortsman et al. 2022's uniform soup (every run), or with
`--greedy` their greedy soup (runs sorted by held-out accuracy, each added only if the held-out accuracy
of the average does not drop). Each average's BatchNorm statistics are recomputed over train batches
(`bn_recompute`, as SWA's are). OUT becomes a normal workdir: config.json (the first run's),
checkpoints/ (parameters and BatchNorm statistics, which --mode=eval/predict/export and init_from
read), results.json (the soup's eval metrics, the ingredients and their accuracies) and whatever
--mode=eval writes (eval.json, per_class.csv, pictures). It is written beside OUT and renamed into
place: an OUT that already holds something is refused, never overwritten.

    python -m flaxtpu.average --workdir=runs/soup runs/ft_lr1 runs/ft_lr2 runs/ft_seed1 --greedy
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Optional, Sequence

from absl import app, flags, logging

from flaxtpu.io import files, storage
from flaxtpu.settings.errors import UserError
from flaxtpu.validation import config as config_lib
from flaxtpu.validation import resolution, workdir_config
from flaxtpu.weights import saved

# Its own flag set: flaxtpu.main defines --workdir on absl's global one, and both may live in one process.
FLAGS = flags.FlagValues()
flags.DEFINE_string('workdir', None, 'Where the soup is written: a new directory (never overwritten).',
                    flag_values=FLAGS)
flags.DEFINE_bool('greedy', False, 'Greedy soup: add a run only if the held-out accuracy does not drop.',
                  flag_values=FLAGS)
flags.DEFINE_string('checkpoint', 'latest', 'Which checkpoint of each run: latest | best | a step number.',
                    flag_values=FLAGS)
flags.DEFINE_enum('weights', 'raw', ('raw', 'ema', 'swa'), "Each run's weights: raw, or its EMA or SWA "
                  '(the run must have trained one).', flag_values=FLAGS)
flags.DEFINE_string('held_out', '', 'The split the greedy soup is chosen on (default: the eval split of the '
                    'first run; e.g. "train[90%:]" when the eval split is the final test).',
                    flag_values=FLAGS)
flags.DEFINE_integer('bn_batches', 0, 'Train batches BatchNorm statistics are recomputed over (0: the first '
                     "run's swa.bn_batches).", flag_values=FLAGS)

# What every ingredient's checkpoint record must share with the first's: (field, what differs, the fix).
SHARED_FIELDS = (('model', 'architecture', 'average runs of one model'),
                 ('task', 'task', 'average runs of one task'),
                 ('image_shape', 'image shape', 'average runs trained at one image size'),
                 ('class_names', 'class list', 'average runs trained on the same classes'),
                 ('normalization', 'input normalisation', 'average runs of one dataset and normalisation'))


def check_runs(runs: Sequence[str], which: str) -> list[dict]:
  """Each run's checkpoint record (no JAX); a missing run or one that differs from the first in what its
  weights mean is one UserError naming the mismatch and the fix."""
  records = []
  for run in runs:
    if not files.isfile(os.path.join(run, workdir_config.CONFIG_FILE)):
      raise UserError(f'{run} is not a trained run (no {workdir_config.CONFIG_FILE}); name workdirs that '
                      'flaxtpu.main trained')
    directory = os.path.join(run, 'checkpoints')
    config = workdir_config.get_config(run)
    steps = saved.complete_steps(directory)
    step = saved.pick_step(directory, which, 'checkpoint', steps, lambda: saved.best_step(
        directory, steps, _best_metric(config), config.checkpoint.best_mode))
    records.append({**saved.read_record(directory, step), 'run': run, 'step': step})
  first = records[0]
  for record in records[1:]:
    for field, what, fix in SHARED_FIELDS:
      if record.get(field) != first.get(field):
        raise UserError(f'{record["run"]} has another {what} than {first["run"]} ({field} '
                        f'{_short(record.get(field))} vs {_short(first.get(field))}); {fix}, fine-tuned '
                        'from one initialisation')
  return records


def _best_metric(config) -> str:
  from flaxtpu.settings.metric_names import best_metric  # pylint: disable=g-import-not-at-top
  return best_metric(config)


def _short(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 60 else text[:57] + '...'


def check_output(workdir: Optional[str]) -> None:
  """OUT must be new (or an empty directory): a soup never overwrites a run."""
  if not workdir:
    raise UserError('--workdir is required: the new directory the soup is written to')
  if storage.is_remote(workdir):
    raise UserError(f'--workdir={workdir}: soups are written to a local directory; copy it to the bucket '
                    'afterwards')
  if os.path.exists(workdir) and (not os.path.isdir(workdir) or os.listdir(workdir)):
    raise UserError(f'--workdir={workdir} already holds files; choose a new directory (nothing was '
                    'overwritten)')
  # The soup is built beside OUT (OUT.building-PID) and renamed into place.
  if reason := files.creatable(os.path.dirname(os.path.abspath(workdir))):
    raise UserError(f'--workdir={workdir} cannot be written ({reason}); choose a directory you can write '
                    '(nothing was averaged)')


def _resolved_config(run: str, which: str, eval_split: Optional[str] = None, weights: str = 'raw'):
  """The config `run` trained with, resolved and validated for reading `weights` of its `which` checkpoint."""
  config = workdir_config.get_config(run)
  config.eval.checkpoint = which
  config.eval.ema, config.eval.swa = weights == 'ema', weights == 'swa'
  if eval_split:
    config.dataset.eval_split = eval_split
  resolution.resolve(config, run, 'eval')
  config_lib.validate(config, 'eval')
  return config


def make_soup(runs: Sequence[str], workdir: str, *, greedy: bool = False, which: str = 'latest',
              held_out: str = '', bn_batches: int = 0, weights: str = 'raw') -> dict:
  """Writes the soup of `runs` to `workdir` (see the module docstring); returns its results.json."""
  check_output(workdir)
  records = check_runs(runs, which)
  switch = {'raw': None, 'ema': ('ema', 'decay'), 'swa': ('swa', 'every')}[weights]
  for run in runs if switch else ():
    if not workdir_config.get_config(run)[switch[0]][switch[1]]:
      raise UserError(f'--weights={weights} but {run} trained without an {weights.upper()} of its weights; '
                      'use --weights=raw or leave that run out')
  started = time.time()
  # pylint: disable=g-import-not-at-top
  import jax

  from flaxtpu.modes import soup
  configs = [_resolved_config(run, str(record['step']), weights=weights)
             for run, record in zip(runs, records)]
  eval_split = configs[0].dataset.eval_split
  held_out = held_out or eval_split
  kitchen = soup.Kitchen(configs, runs, records, bn_batches or configs[0].swa.bn_batches,
                         _resolved_config(runs[0], str(records[0]['step']), held_out))
  chosen, state, held_out_accuracy, tried = kitchen.greedy() if greedy else kitchen.uniform()
  final = kitchen.score(state, kitchen.eval_set) if held_out != eval_split else held_out_accuracy
  results = {'step': max(record['step'] for record in records), **final,
             'method': 'greedy' if greedy else 'uniform', 'weights': weights,
             'held_out_split': held_out, 'held_out_accuracy': held_out_accuracy['eval_accuracy'],
             'bn_batches': kitchen.bn_batches, 'ingredients': tried,
             'kept': [runs[index] for index in chosen], 'wall_time_s': time.time() - started}
  results.pop('num_examples', None)
  if jax.process_index() == 0:
    _write(workdir, configs[0], records[0], runs[0], state, results)
  logging.info('soup of %d of %d runs (%s): eval accuracy %.4f; written to %s', len(chosen), len(runs),
               results['method'], results['eval_accuracy'], workdir)
  return results


def _write(workdir: str, config, first_record: dict, first_run: str, state, results: dict) -> None:
  """OUT written beside itself and renamed into place: config.json, the checkpoint, results.json, and
  --mode=eval's files of that checkpoint."""
  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import eval as eval_mode
  from flaxtpu.weights import checkpoint
  workdir = os.path.abspath(workdir)
  building = f'{workdir}.building-{os.getpid()}'
  shutil.rmtree(building, ignore_errors=True)
  os.makedirs(building)
  try:
    saved_config = files.read_json(os.path.join(first_run, workdir_config.CONFIG_FILE))
    # The soup is stored as plain weights: eval/predict/export of OUT read them, not an EMA or SWA.
    saved_config.setdefault('eval', {}).update(ema=False, swa=False)
    files.write_json(os.path.join(building, workdir_config.CONFIG_FILE), saved_config)
    record = {key: value for key, value in first_record.items()
              if key not in ('run', 'step', 'progress', 'train_metrics_window', 'data_position')}
    record['soup'] = {key: results[key]
                      for key in ('method', 'weights', 'held_out_split', 'ingredients', 'kept')}
    saver = checkpoint.Checkpoints(building, config)
    saver.save(results['step'], {'params': state.params, 'batch_stats': state.batch_stats}, record,
               metrics={key: value for key, value in results.items() if key.startswith('eval_')})
    saver.wait()
    saver.close()
    files.write_json(os.path.join(building, 'results.json'), results)
    eval_mode.evaluate_checkpoint(_resolved_config(building, 'latest'), building)
    eval_path = os.path.join(building, 'eval.json')
    with open(eval_path) as f:  # it names the checkpoint it scored: by the path it will have
      text = f.read().replace(json.dumps(building)[1:-1], json.dumps(workdir)[1:-1])
    with open(eval_path, 'w') as f:
      f.write(text)
    if os.path.isdir(workdir):
      os.rmdir(workdir)  # empty (check_output): replaced by the finished soup
    os.rename(building, workdir)
  except BaseException:
    shutil.rmtree(building, ignore_errors=True)
    raise


def main(argv: Sequence[str]) -> None:
  storage.configure()
  logging.get_absl_handler().addFilter(lambda record: 'orbax' not in record.pathname)  # as flaxtpu.main
  runs = list(argv[1:])
  if not runs:
    print('error: name at least one trained run: python -m flaxtpu.average --workdir=OUT RUN [RUN ...]',
          file=sys.stderr)
    sys.exit(2)
  try:
    make_soup(runs, FLAGS.workdir, greedy=FLAGS.greedy, which=FLAGS.checkpoint, held_out=FLAGS.held_out,
              bn_batches=FLAGS.bn_batches, weights=FLAGS.weights)
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """This module's flags, then absl's own (logging): the program name and the runs are left."""
  try:
    return flags.FLAGS(FLAGS(list(argv), known_only=True))
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
