"""Wrong labels found by `--mode=audit` among planted flips: precision and recall in the top k.

    python -m benchmarks.accuracy.audit_label_errors --cifar /path/to/cifar10            # the docs' table
    python -m benchmarks.accuracy.audit_label_errors --digits                            # the embedded digits
    python -m benchmarks.accuracy.audit_label_errors --cifar DIR --recipes fast --settings random5 \\
        --set audit.steps_fraction=0.25                                         # one cell, another fraction

For each recipe and each setting it builds an image folder under --scratch: a class-balanced subset of
the data (CIFAR-10: --images train images, --test-images test images, the first of each class folder;
digits: 1,000 of the embedded train images, no test split) with a share of the train labels flipped:

- randomP: P% of the train images, each filed under another class drawn uniformly;
- similarP: P% of the train images, drawn from cat, dog, automobile and truck, each filed under its
  pair (cat <-> dog, automobile <-> truck); for the digits 1 <-> 7, 3 <-> 8, 4 <-> 9.

Then, each in its own CLI process as a user runs it (the compilation cache off, so each run compiles
what it runs): `--mode=audit` (K fold runs of the recipe, confident learning on their out-of-fold
probabilities); a plain training run of the same recipe on the same folder; and `--mode=predict` of
that trained run over its own train images, confident learning on those in-sample probabilities (what
the audit did before: the model has seen, and partly memorised, the flipped labels). cleanlab's
`find_label_issues` (filter_by=prune_by_noise_rate, ranked by normalized_margin) runs on the audit's
own out-of-fold probabilities (WORKDIR/audit_folds/KEY/probabilities.npz).

For F planted flips: `suspects` (how many the method lists), `precision` and `recall` of that list,
and the recall in its top F and top 2F. The wall time of the audit and of the training run, and the
load average around them (other jobs on the machine slow both alike). Prints a markdown table; writes
the numbers to --out (JSON).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from PIL import Image

from benchmarks.shared import harness

ROOT = str(harness.ROOT)
# Pairs of look-alike classes: CIFAR-10's the issue names, and the digits' most confused (1/7, 3/8, 4/9).
SIMILAR = {'cat': 'dog', 'dog': 'cat', 'automobile': 'truck', 'truck': 'automobile',
           '1': '7', '7': '1', '3': '8', '8': '3', '4': '9', '9': '4'}
# The recipes: a config file and its overrides. `fast`: FastNet-S with airbench's optimizer, schedule,
# augmentation and flip TTA at batch 256 for 15 epochs (~66% test accuracy from 4,000 CIFAR-10 images);
# `keras`: configs/cifar10.py as it is (the Keras CNN, Adam, 5 epochs: ~27% from 4,000).
RECIPES = {
    'fast': ('configs/cifar10_fast.py', [
        'model.name=fastnet_s', 'optimizer.freeze=()', 'optimizer.freeze_after=()', 'batch_size=256',
        'num_epochs=15', 'optimizer.learning_rate=0.8', 'eval.translate_tta=0', 'checkpoint_every_steps=-1',
        'checkpoint.keep=2']),
    'keras': ('configs/cifar10.py', []),
    'digits': ('configs/digits.py', ['dataset.name=', 'dataset.train_split=train',
                                     'dataset.eval_split=train']),
}


def cifar_subset(cifar: str, images: int, test_images: int) -> dict:
  """{split: [(path, class name)]}: the first images of each class folder, in name order."""
  chosen = {}
  for split, count in (('train', images), ('test', test_images)):
    classes = sorted(os.listdir(os.path.join(cifar, split)))
    chosen[split] = [(os.path.join(cifar, split, name, file), name) for name in classes
                     for file in sorted(os.listdir(os.path.join(cifar, split, name)))[:count // len(classes)]]
  return chosen


def flips_of(setting: str, train: list, seed: int) -> dict:
  """{train position: its wrong class} for 'random5', 'similar5', ..."""
  kind, percent = setting.rstrip('0123456789.'), float(setting[len(setting.rstrip('0123456789.')):])
  rng = np.random.default_rng(seed)
  count = int(round(percent / 100 * len(train)))
  classes = sorted({name for _, name in train})
  if kind == 'random':
    flips = {}
    for i in rng.choice(len(train), count, replace=False):
      others = [name for name in classes if name != train[i][1]]
      flips[int(i)] = others[rng.integers(len(others))]
    return flips
  if kind == 'similar':
    eligible = [i for i, (_, name) in enumerate(train) if name in SIMILAR]
    return {int(i): SIMILAR[train[i][1]] for i in rng.choice(eligible, count, replace=False)}
  raise SystemExit(f'unknown setting {setting!r}: randomP or similarP')


def write_folder(root: str, chosen: dict, flips: dict) -> set:
  """The subset under root/{train,test}/CLASS/, flipped files filed under their wrong class; returns the
  flipped files' paths."""
  shutil.rmtree(root, ignore_errors=True)
  flipped = set()
  for split, items in chosen.items():
    for index, (source, name) in enumerate(items):
      wrong = flips.get(index) if split == 'train' else None
      folder = os.path.join(root, split, wrong or name)
      os.makedirs(folder, exist_ok=True)
      extension = '.png' if isinstance(source, np.ndarray) else os.path.splitext(source)[1]
      target = os.path.join(folder, f'{name}_{index:05d}{extension}')
      if isinstance(source, np.ndarray):
        Image.fromarray(source).save(target)
      else:
        shutil.copyfile(source, target)
      if wrong:
        flipped.add(target)
  return flipped


def digits_subset(count: int = 1000) -> dict:
  sys.path.insert(0, ROOT)
  from flaxtpu.data.sources.embedded import embedded_arrays  # pylint: disable=g-import-not-at-top
  images, labels, names = embedded_arrays('digits', 'train')
  order = np.random.default_rng(0).permutation(len(labels))[:count]
  return {'train': [(images[i][..., 0], names[labels[i]]) for i in order]}


def cli(config: str, overrides: list, workdir: str, folder: str, mode: str, extra: list = ()) -> float:
  """Runs the CLI; returns its wall time (the whole command: start-up, data, compilation included)."""
  command = [sys.executable, '-m', 'flaxtpu.main', f'--config={config}', f'--workdir={workdir}',
             f'--mode={mode}', f'--config.dataset.folder={folder}', '--config.compilation_cache_dir=none',
             *[f'--config.{item}' for item in [*overrides, *extra]]]
  started = time.time()
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=harness.subprocess_env())
  if result.returncode:
    raise SystemExit(f'{" ".join(command)} failed:\n{result.stderr[-3000:]}')
  return time.time() - started


def rates(ranked: list, flipped: set) -> dict:
  """precision/recall of a ranked list of paths against the flipped ones, and recall in its top F, 2F."""
  planted = len(flipped)
  found = sum(path in flipped for path in ranked)
  return {'suspects': len(ranked), 'precision': round(found / len(ranked), 3) if ranked else None,
          'recall': round(found / planted, 3),
          'recall_top_f': round(sum(path in flipped for path in ranked[:planted]) / planted, 3),
          'recall_top_2f': round(sum(path in flipped for path in ranked[:2 * planted]) / planted, 3)}


def in_sample(csv_path: str, folder: str, class_names: list) -> tuple[list, np.ndarray, np.ndarray]:
  """(paths, labels, probabilities) of --mode=predict's CSV (every class's probability listed)."""
  sys.path.insert(0, ROOT)
  paths, labels, rows = [], [], []
  with open(csv_path, newline='', encoding='utf-8') as f:
    for row in csv.DictReader(f):
      path = row['path']
      paths.append(path)
      labels.append(class_names.index(os.path.basename(os.path.dirname(path))))
      probabilities = np.zeros(len(class_names), np.float32)
      for rank in range(1, len(class_names) + 1):
        probabilities[class_names.index(row[f'class_{rank}'])] = float(row[f'probability_{rank}'])
      rows.append(probabilities)
  return paths, np.asarray(labels), np.stack(rows)


def measure(recipe: str, setting: str, chosen: dict, scratch: str, extra: list, seed: int,
            audit_only: bool = False) -> dict:
  sys.path.insert(0, ROOT)
  from cleanlab.filter import find_label_issues  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import audit  # pylint: disable=g-import-not-at-top
  config, overrides = RECIPES[recipe]
  folder = os.path.join(scratch, f'{recipe}_{setting}', 'images')
  flipped = write_folder(folder, chosen, flips_of(setting, chosen['train'], seed))
  audit_dir, train_dir = (os.path.join(scratch, f'{recipe}_{setting}', name) for name in ('audit', 'train'))
  for directory in (audit_dir, train_dir):
    shutil.rmtree(directory, ignore_errors=True)
  load_before = os.getloadavg()[0]
  audit_seconds = cli(config, overrides, audit_dir, folder, 'audit', extra)
  train_seconds = None if audit_only else cli(config, overrides, train_dir, folder, 'train', extra)
  load_after = os.getloadavg()[0]
  report = json.load(open(os.path.join(audit_dir, 'audit.json'), encoding='utf-8'))
  search = report['mislabel_search']
  with np.load(os.path.join(search['directory'], 'probabilities.npz')) as saved:
    paths, labels, probabilities = list(saved['paths']), saved['labels'], saved['probabilities']
    class_names = list(saved['class_names'])
  ours = [row['path'] for row in report['suspected_mislabels']]
  theirs = [paths[i] for i in find_label_issues(labels, probabilities, filter_by='prune_by_noise_rate',
                                                return_indices_ranked_by='normalized_margin', n_jobs=1)]
  own, results = None, {}
  if not audit_only:  # the run's own model over its own train images: what the audit scored before folds
    predictions = os.path.join(train_dir, 'in_sample.csv')
    cli(config, overrides, train_dir, folder, 'predict', [f'predict.input={os.path.join(folder, "train")}',
                                                           f'predict.top_k={len(class_names)}',
                                                           f'predict.output_csv={predictions}'])
    own_paths, own_labels, own_probabilities = in_sample(predictions, folder, class_names)
    own = [own_paths[i] for i in audit.find_label_issues(own_labels, own_probabilities).ranked]
    results = json.load(open(os.path.join(train_dir, 'results.json'), encoding='utf-8'))
  return {'recipe': recipe, 'setting': setting, 'train_images': len(chosen['train']),
          'audited_images': len(paths), 'flips': len(flipped), 'extra': list(extra),
          'audit': rates(ours, flipped), 'cleanlab': rates(theirs, flipped),
          'cleanlab_same_set': set(ours) == set(theirs), 'cleanlab_same_order': ours == theirs,
          'in_sample': None if own is None else rates(own, flipped),
          'fold_steps': search.get('steps'), 'held_out_accuracy': search.get('held_out_accuracy'),
          'test_accuracy': results.get('eval_accuracy') if 'test' in chosen else None,
          'audit_seconds': round(audit_seconds, 1), 'fold_seconds': search.get('seconds'),
          'train_seconds': None if audit_only else round(train_seconds, 1),
          'load_average': [round(load_before, 1), round(load_after, 1)]}


def table(rows: list) -> str:
  lines = ['| recipe | flips | audit: suspects, precision, recall, recall top F / 2F | cleanlab, same '
           'probabilities | own model in-sample | audit time / training run |',
           '| --- | --- | --- | --- | --- | --- |']
  show = lambda r: (f'{r["suspects"]}, {r["precision"]}, {r["recall"]}, '
                    f'{r["recall_top_f"]} / {r["recall_top_2f"]}' if r else 'not run')
  for row in rows:
    same = ('identical' if row['cleanlab_same_order'] else
            'same set' if row['cleanlab_same_set'] else 'differs')
    lines.append(f'| {row["recipe"]} | {row["setting"]}: {row["flips"]} of {row["train_images"]} | '
                 f'{show(row["audit"])} | {show(row["cleanlab"])} ({same}) | {show(row["in_sample"])} | '
                 f'{row["audit_seconds"]:.0f} s / {row["train_seconds"] or 0:.0f} s |')
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument('--cifar', help='CIFAR-10 as an image folder (train/CLASS/*, test/CLASS/*)')
  source.add_argument('--digits', action='store_true', help='the embedded digits instead (1,000 images)')
  parser.add_argument('--images', type=int, default=4000, help='CIFAR-10 train images (a tenth per class)')
  parser.add_argument('--test-images', type=int, default=1000, help='CIFAR-10 test images')
  parser.add_argument('--recipes', default='fast,keras', help=f'comma-separated, of {", ".join(RECIPES)}')
  parser.add_argument('--settings', default='random1,random5,random10,similar5')
  parser.add_argument('--set', action='append', default=[], help='another config override, KEY=VALUE')
  parser.add_argument('--seed', type=int, default=0, help='which images are flipped')
  parser.add_argument('--audit-only', action='store_true',
                      help='no training run, so no in-sample column (another audit.steps_fraction)')
  parser.add_argument('--scratch', default='/tmp/flaxtpu-audit-label-errors')
  harness.out_argument(parser, 'audit_label_errors.json')
  args = parser.parse_args()
  chosen = digits_subset() if args.digits else cifar_subset(args.cifar, args.images, args.test_images)
  recipes = ['digits'] if args.digits else args.recipes.split(',')
  rows = []
  for recipe in recipes:
    for setting in args.settings.split(','):
      rows.append(measure(recipe, setting, chosen, args.scratch, args.set, args.seed, args.audit_only))
      print(json.dumps(rows[-1]), flush=True)
  print(table(rows))
  harness.write_results(args.out, {'rows': rows, 'command': sys.argv})


if __name__ == '__main__':
  main()
