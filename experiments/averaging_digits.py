"""Weight averaging measured on the embedded digits (issue 41 part 5): model soups and SWA.

    python experiments/averaging_digits.py --out=runs/averaging            # ~20 min on 2 CPU cores
    python experiments/averaging_digits.py --out=runs/averaging --only=swa

Soups: a ResNet-20 base run on train[:90%] (8x8 digits), then fine-tunes from it (init_from) that differ
in learning rate, seed and augmentation; then `python -m flaxtpu.average` makes the uniform soup of all
of them and the greedy soup chosen on the held-out train[90%:] (never the test split), and each is
scored on the test split. SWA: the same recipe from scratch with and without swa.every. Every number
comes from a run's results.json; the table is printed and written to OUT/averaging.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RECIPE = ['--config=configs/digits.py', '--config.model.name=resnet20',
          "--config.dataset.train_split=train[:90%]", '--config.log_every_steps=200']
HELD_OUT = 'train[90%:]'
FINE_TUNES = {  # name -> overrides of a 4-epoch fine-tune from the base run
    'ft_lr1e-3': ['--config.optimizer.learning_rate=1e-3'],
    'ft_lr3e-3': ['--config.optimizer.learning_rate=3e-3'],
    'ft_lr1e-3_seed1': ['--config.optimizer.learning_rate=1e-3', '--config.seed=1'],
    'ft_lr1e-3_crop': ['--config.optimizer.learning_rate=1e-3', '--config.augment.crop_padding=1'],
    'ft_lr3e-2': ['--config.optimizer.learning_rate=3e-2'],
}


def _run(args: list[str], log: str) -> None:
  print('$', ' '.join(args), flush=True)
  with open(log, 'w') as f:  # the command's log beside its workdir
    subprocess.run(args, check=True, stdout=f, stderr=subprocess.STDOUT)


def _train(workdir: str, overrides: list[str]) -> dict:
  if not os.path.exists(os.path.join(workdir, 'results.json')):
    _run([sys.executable, '-m', 'flaxtpu.main', f'--workdir={workdir}', *RECIPE, *overrides],
         f'{workdir}.log')
  with open(os.path.join(workdir, 'results.json')) as f:
    return json.load(f)


def _soup(workdir: str, runs: list[str], greedy: bool) -> dict:
  if not os.path.exists(os.path.join(workdir, 'results.json')):
    _run([sys.executable, '-m', 'flaxtpu.average', f'--workdir={workdir}', *runs,
          f'--held_out={HELD_OUT}', *(['--greedy'] if greedy else [])], f'{workdir}.log')
  with open(os.path.join(workdir, 'results.json')) as f:
    return json.load(f)


def soups(out: str) -> dict:
  base = os.path.join(out, 'base')
  table = {'base': _train(base, ['--config.num_epochs=8'])['eval_accuracy']}
  runs = []
  for name, overrides in FINE_TUNES.items():
    workdir = os.path.join(out, name)
    results = _train(workdir, ['--config.num_epochs=4', f'--config.init_from.checkpoint={base}',
                               '--config.schedule.warmup_epochs=0', *overrides])
    table[name] = results['eval_accuracy']
    runs.append(workdir)
  # Every fine-tune; then only the three at the base's learning rate (seed, crop: the nearest ones).
  close = [run for run in runs if os.path.basename(run).startswith('ft_lr1e-3')]
  for group, members in (('', runs), ('close_', close)):
    for greedy in (False, True):
      name = f'{group}{"greedy" if greedy else "uniform"}'
      results = _soup(os.path.join(out, f'{name}_soup'), members, greedy)
      table[f'{name}_soup'] = results['eval_accuracy']
      table[f'{name}_kept'] = [os.path.basename(run) for run in results['kept']]
      table[f'{name}_held_out'] = results['held_out_accuracy']
      if not group:
        table['ingredients_held_out'] = {os.path.basename(i['run']): i['held_out_accuracy']
                                         for i in results['ingredients']}
  return table


def swa(out: str) -> dict:
  table = {}
  for name, overrides in (('no_swa', []), ('swa', ['--config.swa.every=40', '--config.swa.start=0.5'])):
    results = _train(os.path.join(out, name), ['--config.num_epochs=16', *overrides])
    table[name] = {key: value for key, value in results.items() if key.startswith('eval_accuracy')}
  return table


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='runs/averaging')
  parser.add_argument('--only', choices=('soups', 'swa', ''), default='')
  args = parser.parse_args()
  table = {}
  if args.only in ('', 'soups'):
    table['soups'] = soups(args.out)
  if args.only in ('', 'swa'):
    table['swa'] = swa(args.out)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f'averaging{"_" + args.only if args.only else ""}.json'), 'w') as f:
    json.dump(table, f, indent=2)
  print(json.dumps(table, indent=2))


if __name__ == '__main__':
  main()
