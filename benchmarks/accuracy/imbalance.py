"""Class imbalance: CIFAR-10 with 9 classes cut to 5%, trained plain, class-weighted, class-balanced sampled.

    FLAXTPU_CIFAR10=/path/to/cifar10 python -m benchmarks.accuracy.imbalance  # 3 runs, ~5 min each, 2 cores
    python -m benchmarks.accuracy.imbalance --cifar10 /data/cifar10 --epochs 1 --train-fraction 0.2  # quick
    # -> benchmarks/results/local/imbalance.json

Reads CIFAR-10 as an image folder (`train/<class>/*.jpg`, `test/<class>/*.jpg`;
`--cifar10 DIR` or `$FLAXTPU_CIFAR10`). Builds, in a temporary folder, a
folder of symbolic links (no pixels copied): every train image of
`--keep-class` (default: the first class, airplane), and `--fraction` (5%) of
each other class's train images, a seeded choice; the whole test split. That
is 5,000 + 9 x 250 = 7,250 train images, one class 20x each other's.

Then trains three times through `python -m flaxtpu.main` with the same recipe
(`--recipe`, default `configs/cifar10_resnet.py`: ResNet-20, SGD + Nesterov,
cosine, crops and flips) for the same number of steps (`--epochs` x the
7,250-image epoch, whatever an epoch means to a sampler), evaluating once at
the end on the full, balanced test split:

- `none`: `dataset.class_weights=none`, `dataset.sampling=shuffle` (plain training);
- `class_weights`: `dataset.class_weights=balanced` (class c's loss weighs
  n / (C x n_c), Keras' and scikit-learn's rule);
- `balanced_sampling`: `dataset.sampling=balanced` (every class drawn equally often).

For each: balanced accuracy (the mean per-class recall), accuracy, per-class
recall, macro F1, the kept class's recall and the mean recall of the cut ones,
computed with scikit-learn from the run's test logits (read back from its
workdir), with what flaxtpu itself reported (`eval_*` of results.json) beside
them, and wall time, CPU seconds and other processes' load (`harness.cpu_load`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

from benchmarks.accuracy import multilabel
from benchmarks.shared import harness

IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png')
RUNS = {
    'none': {'dataset.class_weights': 'none', 'dataset.sampling': 'shuffle'},
    'class_weights': {'dataset.class_weights': 'balanced', 'dataset.sampling': 'shuffle'},
    'balanced_sampling': {'dataset.class_weights': 'none', 'dataset.sampling': 'balanced'},
}


def images_of(folder: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def cut_folder(cifar: pathlib.Path, out: pathlib.Path, keep_class: str, fraction: float, seed: int,
               train_fraction: float = 1.0, test_fraction: float = 1.0) -> dict:
  """`out/{train,test}/<class>/` of symbolic links: `keep_class` whole, the others' train images cut to
  `fraction` (a seeded choice). `train_fraction` and `test_fraction` shrink everything (smoke runs).
  Returns the train images per class."""
  classes = sorted(p.name for p in (cifar / 'train').iterdir() if p.is_dir())
  if keep_class not in classes:
    raise SystemExit(f'error: --keep-class={keep_class} is not a class of {cifar / "train"} '
                     f'({", ".join(classes)})')
  rng = np.random.default_rng(seed)
  counts = {}
  for split in ('train', 'test'):
    for name in classes:
      files = images_of(cifar / split / name)
      share = (train_fraction if split == 'train' else test_fraction)
      share *= fraction if split == 'train' and name != keep_class else 1.0
      count = max(1, round(len(files) * share))
      chosen = (sorted(rng.choice(len(files), count, replace=False)) if count < len(files)
                else range(len(files)))
      target = out / split / name
      target.mkdir(parents=True, exist_ok=True)
      for index in chosen:
        (target / files[index].name).symlink_to(files[index].resolve())
      if split == 'train':
        counts[name] = count
  return counts


def judged(logits: np.ndarray, labels: np.ndarray, class_names: list[str], keep_class: str) -> dict:
  """Balanced accuracy, accuracy, per-class recall, macro F1 (scikit-learn) of argmax predictions."""
  from sklearn import metrics  # pylint: disable=g-import-not-at-top
  predicted = logits.argmax(1)
  everyone = np.arange(len(class_names))
  recall = metrics.recall_score(labels, predicted, labels=everyone, average=None, zero_division=0)
  kept = class_names.index(keep_class)
  return {
      'examples': int(len(labels)),
      'balanced_accuracy': float(metrics.balanced_accuracy_score(labels, predicted)),
      'accuracy': float(metrics.accuracy_score(labels, predicted)),
      'f1_macro': float(metrics.f1_score(labels, predicted, labels=everyone, average='macro',
                                         zero_division=0)),
      'kept_class_recall': float(recall[kept]),
      'cut_classes_mean_recall': float(np.delete(recall, kept).mean()),
      'per_class_recall': {name: float(r) for name, r in zip(class_names, recall)},
      'predicted_share': {name: float((predicted == i).mean()) for i, name in enumerate(class_names)},
  }


def print_table(runs: dict, class_names: list[str]) -> None:
  short = [name[:5] for name in class_names]
  header = (f'{"run":18s} {"bal. acc":>8s} {"accuracy":>8s} {"F1 macro":>8s} | recall: '
            + ' '.join(f'{name:>5s}' for name in short) + f' | {"wall s":>6s} {"CPU s":>6s} {"others":>6s}')
  print(header)
  print('-' * len(header))
  for name, run in runs.items():
    if 'error' in run:
      print(f'{name:18s} failed: {multilabel.short_error(run["error"])}')
      continue
    m = run['judged']
    print(f'{name:18s} {m["balanced_accuracy"]:8.4f} {m["accuracy"]:8.4f} {m["f1_macro"]:8.4f} | recall: '
          + ' '.join(f'{m["per_class_recall"][c]:5.3f}' for c in class_names)
          + f' | {run["wall_s"]:6.0f} {run["cpu_seconds"]:6.0f} {run["other_cpu_load"]:6.2f}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--cifar10', default=os.environ.get('FLAXTPU_CIFAR10', ''),
                      help='CIFAR-10 as an image folder (default: $FLAXTPU_CIFAR10)')
  parser.add_argument('--keep-class', default='', help='the class kept whole (default: the first)')
  parser.add_argument('--fraction', type=float, default=0.05, help="the other classes' share of their images")
  parser.add_argument('--recipe', default='configs/cifar10_resnet.py',
                      help='the flaxtpu config every run uses')
  parser.add_argument('--epochs', type=float, default=6,
                      help='training length in epochs of the cut train split (the same steps for every run)')
  parser.add_argument('--batch-size', type=int, default=128)
  parser.add_argument('--seed', type=int, default=0, help='seeds the cut and the runs')
  parser.add_argument('--runs', default=','.join(RUNS), help=f'comma-separated, of {", ".join(RUNS)}')
  parser.add_argument('--train-fraction', type=float, default=1.0, help='smoke runs: use this share of train')
  parser.add_argument('--test-fraction', type=float, default=1.0, help='smoke runs: use this share of test')
  parser.add_argument('--work', default='', help='the folder of links, workdirs and logs (default: a '
                      'temporary folder); its folders named after the runs are replaced')
  harness.out_argument(parser, 'imbalance.json')
  args = parser.parse_args()
  if not args.cifar10 or not os.path.isdir(os.path.join(args.cifar10, 'train')):
    parser.error('pass --cifar10 DIR (or set FLAXTPU_CIFAR10): CIFAR-10 as train/<class>/ and test/<class>/')
  wanted = [name for name in args.runs.split(',') if name]
  if unknown := set(wanted) - set(RUNS):
    parser.error(f'--runs: unknown {sorted(unknown)}; choose from {", ".join(RUNS)}')
  cifar = pathlib.Path(args.cifar10)
  keep_class = args.keep_class or sorted(p.name for p in (cifar / 'train').iterdir() if p.is_dir())[0]
  work = pathlib.Path(args.work or tempfile.mkdtemp(prefix='imbalance_'))
  folder = work / 'cifar10_cut'
  if folder.exists():
    raise SystemExit(f'error: {folder} exists; pass another --work or remove it')
  counts = cut_folder(cifar, folder, keep_class, args.fraction, args.seed, args.train_fraction,
                      args.test_fraction)
  class_names = sorted(counts)
  train_images = sum(counts.values())
  steps = int(max(1, np.ceil(args.epochs * (train_images // args.batch_size))))
  print(f'{folder}: {train_images:,} train images ({", ".join(f"{c} {n}" for c, n in counts.items())}); '
        f'{steps} steps of {args.batch_size} per run ({args.recipe})', flush=True)
  common = {'dataset.folder': str(folder), 'batch_size': args.batch_size, 'seed': args.seed,
            'num_train_steps': steps, 'eval_every_steps': steps, 'checkpoint_every_steps': steps,
            'checkpoint.best_metric': '', 'log_every_steps': 50}
  runs = {}
  for name in wanted:
    workdir = str(work / name)
    command = multilabel.flaxtpu_command(workdir, {**common, **RUNS[name]}, recipe=args.recipe)
    try:
      runs[name] = multilabel.run_flaxtpu(name, workdir, command, str(work))
      saved = np.load(runs[name].pop('scores_file'))
      names = [str(n) for n in saved['class_names']]
      runs[name]['judged'] = judged(saved['logits'], np.asarray(saved['labels']), names, keep_class)
    except Exception as error:  # pylint: disable=broad-except  (the other runs still tell something)
      runs[name] = {'error': str(error)}
      print(f'{name} failed: {error}', file=sys.stderr, flush=True)
  print_table(runs, class_names)
  harness.write_results(args.out, {
      'cifar10': str(cifar), 'keep_class': keep_class, 'fraction': args.fraction,
      'train_fraction': args.train_fraction, 'test_fraction': args.test_fraction,
      'train_images_per_class': counts, 'recipe': args.recipe, 'epochs': args.epochs, 'steps': steps,
      'batch_size': args.batch_size, 'seed': args.seed, 'cpu_count': os.cpu_count(), 'work': str(work),
      'runs': runs})
  print(json.dumps({name: {k: run['judged'][k] for k in ('balanced_accuracy', 'accuracy')}
                    for name, run in runs.items() if 'judged' in run}))
  if any('error' in run for run in runs.values()):
    sys.exit(1)


if __name__ == '__main__':
  main()
