"""`--mode=audit` on real images with planted wrong labels (issue 70): precision and recall in the top k
of the audit's list, of cleanlab's `find_label_issues` on the same out-of-fold probabilities, and of the
in-sample ranking (confident learning on the trained run's own probabilities of its train images); the
audit's wall time beside one training run.

    python -m experiments.audit_real_data --cifar /path/to/cifar10 --recipes resnet --settings random1
    python -m experiments.audit_real_data --digits --recipes mnist
    python -m experiments.audit_real_data --table              # issue 70's audit table, re-measured

Each case is a folder built under --scratch, in one process as a user runs it: a training run of the
recipe (`train.train_and_evaluate`, its eval split the clean test images), then `--mode=audit` of that
run's workdir (`run_audit` with `dataset.eval_split=train`: the train images alone are audited, and the
fold runs train the run's own recipe, as the CLI's `--workdir=RUN --mode=audit` does).

Data (a class-balanced subset, flips in train only):
- `cifar`: the first --images / 10 train and --test-images / 10 test images of each class folder of a
  CIFAR-10 image folder (name order);
- `digits`: the embedded 8x8 digits (flaxtpu/datasets: scikit-learn's), enlarged to 28x28 grayscale
  PNGs, 200 a class for train and 50 for test; a digit used twice is shifted by 1-2 px and turned by up
  to 10 degrees (the train digits are drawn from the embedded train split, the test from its test split).

Settings: `randomP` files P% of the train images under another class drawn uniformly; `similarP` P%
drawn from look-alike pairs (cat <-> dog, automobile <-> truck, deer <-> horse, airplane <-> ship; for
the digits 1 <-> 7, 3 <-> 8, 4 <-> 9), each filed under its pair.

For F flips each ranking gets: how many it lists (suspects), their precision and recall, and the recall
in its top F and top 2F. `self_confidence` ranks every audited image by its out-of-fold probability of
its label, lowest first, and is read in its top F / 2F only. The goal: top 2F >= 0.8 with <= 3F
suspects. Writes OUT/RESULTS.json and OUT/RESULTS.md (tables, no run folders).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time

import numpy as np
from PIL import Image

from benchmarks.accuracy.audit_label_errors import cifar_subset  # the first images of each class folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMILAR = {'cat': 'dog', 'dog': 'cat', 'automobile': 'truck', 'truck': 'automobile', 'deer': 'horse',
           'horse': 'deer', 'airplane': 'ship', 'ship': 'airplane',
           '1': '7', '7': '1', '3': '8', '8': '3', '4': '9', '9': '4'}
# The recipe a user picks for each kind of data: a config file of configs/ and the data's location.
RECIPES = {'resnet': 'configs/cifar10_resnet.py', 'fast': 'configs/cifar10_fast.py',
           'keras': 'configs/cifar10.py', 'mnist': 'configs/mnist.py'}
COMMAND = ''  # how the tables were made, written above them


# --- the data -----------------------------------------------------------------------------------


def digit_images(per_class: int, split: str, seed: int) -> list:
  """[(uint8 [28, 28] image, class name)]: `per_class` embedded digits of each class, enlarged; a digit
  used again is shifted and turned a little."""
  from flaxtpu.data.sources.embedded import embedded_arrays  # pylint: disable=g-import-not-at-top
  images, labels, names = embedded_arrays('digits', split)
  rng = np.random.default_rng(seed)
  out = []
  for label, name in enumerate(names):
    own = np.flatnonzero(labels == label)
    for i in range(per_class):
      image = Image.fromarray(np.asarray(images[own[i % len(own)]])[..., 0]).resize((28, 28), Image.BICUBIC)
      if i >= len(own):
        image = image.rotate(float(rng.uniform(-10, 10)), resample=Image.BILINEAR,
                             translate=tuple(int(v) for v in rng.integers(-2, 3, 2)))
      out.append((np.asarray(image), name))
  return out


def flips_of(setting: str, names: list, seed: int) -> dict:
  """{train position: its wrong class} for 'random5', 'similar5', ... over train images of `names`."""
  kind, percent = setting.rstrip('0123456789.'), float(setting[len(setting.rstrip('0123456789.')):])
  rng = np.random.default_rng(seed)
  count = int(round(percent / 100 * len(names)))
  classes = sorted(set(names))
  if kind == 'random':
    chosen = rng.choice(len(names), count, replace=False)
    return {int(i): classes[(classes.index(names[i]) + int(rng.integers(1, len(classes)))) % len(classes)]
            for i in chosen}
  if kind == 'similar':
    eligible = [i for i, name in enumerate(names) if name in SIMILAR and SIMILAR[name] in classes]
    chosen = rng.choice(eligible, count, replace=False)
    return {int(i): SIMILAR[names[i]] for i in chosen}
  raise SystemExit(f'unknown setting {setting!r}: randomP or similarP')


def build(root: str, train: list, test: list, flips: dict) -> set:
  """root/{train,test}/<class>/*: `train` and `test` are [(source path or uint8 image, class name)];
  train image i is filed under flips[i] where flipped. Returns the flipped files' paths."""
  shutil.rmtree(root, ignore_errors=True)
  flipped = set()
  for split, items in (('train', train), ('test', test)):
    for i, (item, name) in enumerate(items):
      label = flips.get(i, name) if split == 'train' else name
      folder = os.path.join(root, split, label)
      os.makedirs(folder, exist_ok=True)
      if isinstance(item, str):
        path = os.path.join(folder, f'{name}_{os.path.basename(item)}')
        shutil.copyfile(item, path)
      else:
        path = os.path.join(folder, f'{name}_{i:05d}.png')
        Image.fromarray(item).save(path)
      if split == 'train' and i in flips:
        flipped.add(path)
  return flipped


# --- one case ---------------------------------------------------------------------------------


def recipe(name: str, folder: str, overrides: list):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('recipe', os.path.join(ROOT, RECIPES[name]))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.dataset.name, config.dataset.folder = '', folder
  config.dataset.train_split, config.dataset.eval_split = 'train', 'test'
  config.checkpoint.keep = 1
  config.log_every_steps = max(config.log_every_steps, 100)
  for override in overrides:
    key, value = override.split('=', 1)
    config.update_from_flattened_dict({key: _value(value)})
  return config


def _value(text: str):
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def in_sample(config, workdir: str, paths: list, labels: np.ndarray, class_names):
  """The trained run's own softmax probabilities of its train images (what it has seen)."""
  from flaxtpu.data import pipeline  # pylint: disable=g-import-not-at-top
  from flaxtpu.data.spec import DatasetSpec  # pylint: disable=g-import-not-at-top
  from flaxtpu.evaluation.evaluate import evaluate  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import audit_pool  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes.restore import restore  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings.lengths import resolved_eval_batch_size  # pylint: disable=g-import-not-at-top
  placement, state, _, record = restore(config, workdir, calibrated=False)
  channels = int(record['image_shape'][-1])  # as the run read them
  template, _ = audit_pool.pool_dataset(config, paths, labels, class_names, channels)
  dataset = pipeline._normalized(dataclasses.replace(template), DatasetSpec.of(config))  # pylint: disable=protected-access
  _, predictions = evaluate(placement, state, dataset, resolved_eval_batch_size(config), keep_logits=True)
  logits = np.asarray(predictions.logits, np.float64)
  e = np.exp(logits - logits.max(axis=1, keepdims=True))
  return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def rates(ranked: list, flipped: set) -> dict:
  f = len(flipped)
  hits = [path in flipped for path in ranked]
  return {'suspects': len(ranked), 'precision': round(sum(hits) / len(ranked), 3) if ranked else None,
          'recall': round(sum(hits) / f, 3), 'top_f': round(sum(hits[:f]) / f, 3),
          'top_2f': round(sum(hits[:2 * f]) / f, 3),
          'goal': bool(sum(hits[:2 * f]) >= 0.8 * f and len(ranked) <= 3 * f)}


def train_paths(root: str):
  """The train images of a built folder, their labels (class indices in name order) and class names."""
  class_names = sorted(os.listdir(os.path.join(root, 'train')))
  paths, labels = [], []
  for label, cls in enumerate(class_names):
    for file in sorted(os.listdir(os.path.join(root, 'train', cls))):
      paths.append(os.path.join(root, 'train', cls, file))
      labels.append(label)
  return paths, np.asarray(labels), class_names


def run_case(name: str, root: str, flipped: set, config, audit_config, workdir: str, train_run: bool = True,
             variants: tuple = (), dump: str = '') -> dict:
  """A training run of `config` in `workdir` (unless `train_run` is False: it is there already), its
  in-sample ranking, then `run_audit(audit_config, workdir)`: the row of the tables. Each of `variants`
  (['KEY=VALUE,KEY=VALUE', ...]) audits the same run again with those overrides (another seed: other folds
  and fold models; a longer audit.steps_fraction); the row then also ranks the mean of all the audits'
  out-of-fold probabilities (an ensemble of fold models per image). `dump`: a folder to save every
  probability set in (NAME.npz), for reading offline."""
  from flaxtpu.data import audit  # pylint: disable=g-import-not-at-top
  from flaxtpu.loop import train  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import audit as audit_mode  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import audit_folds  # pylint: disable=g-import-not-at-top
  started = time.time()
  results = (train.train_and_evaluate(config, workdir) if train_run
             else json.load(open(os.path.join(workdir, 'results.json'))))
  train_seconds = time.time() - started
  paths, labels, class_names = train_paths(root)
  own = in_sample(config, workdir, paths, labels, class_names)
  own_ranked = [paths[i] for i in audit.find_label_issues(labels, own, config.audit.rule).ranked]
  started = time.time()
  report = audit_mode.run_audit(audit_config, workdir)
  audit_seconds = time.time() - started
  search = report['mislabel_search']
  with np.load(os.path.join(search['directory'], audit_folds.PROBABILITIES)) as saved:
    oof_paths, oof_labels, probabilities = list(saved['paths']), saved['labels'], saved['probabilities']
  ours = [row['path'] for row in report['suspected_mislabels']]
  row = {'case': name, 'images': len(oof_paths), 'flips': len(flipped),
         'run_eval_accuracy': round(float(results.get('eval_accuracy', float('nan'))), 4),
         'run_steps': int(results.get('step', 0)), 'fold_steps': search.get('steps'),
         'fold_accuracies': search.get('fold_accuracies'),
         'held_out_accuracy': search.get('held_out_accuracy'),
         'chance': search.get('chance'), 'verdict': search.get('verdict'), 'withheld': search.get('withheld'),
         'note': search.get('note'), 'recipe': search.get('recipe'),
         'train_seconds': round(train_seconds, 1), 'audit_seconds': round(audit_seconds, 1),
         'ours': rates(ours, flipped), 'in_sample': rates(own_ranked, flipped)}
  try:
    from cleanlab import filter as filtering  # pylint: disable=g-import-not-at-top
    theirs = filtering.find_label_issues(oof_labels, probabilities, filter_by='prune_by_noise_rate',
                                         return_indices_ranked_by='normalized_margin', n_jobs=1)
    # Their list on the same probabilities, whatever the audit's verdict (it lists none near chance).
    row['cleanlab'] = rates([oof_paths[i] for i in theirs], flipped)
    row['cleanlab_is_the_audits_rule'] = theirs.tolist() == audit.find_label_issues(
        oof_labels, probabilities, 'prune_by_noise_rate').ranked.tolist()
  except ImportError:
    row['cleanlab'] = None
  ranked = _ranked(oof_labels, probabilities, oof_paths, flipped)
  row['self_confidence'] = ranked['self_confidence']
  row['listed_by_self_confidence'] = ranked['listed_by_self_confidence']
  sets = {'audit': probabilities}
  for variant in variants:
    other = audit_config.copy_and_resolve_references()
    for override in variant.split(','):
      key, value = override.split('=', 1)
      other.update_from_flattened_dict({key: _value(value)})
    started = time.time()
    again = audit_mode.run_audit(other, workdir)
    seconds = time.time() - started
    with np.load(os.path.join(again['mislabel_search']['directory'], audit_folds.PROBABILITIES)) as saved:
      order = {path: i for i, path in enumerate(saved['paths'])}
      sets[variant] = saved['probabilities'][[order[path] for path in oof_paths]]
    search = again['mislabel_search']
    row.setdefault('variants', []).append(
        {'variant': variant, 'fold_steps': search.get('steps'),
         'held_out_accuracy': search.get('held_out_accuracy'),
         'verdict': search.get('verdict'), 'audit_seconds': round(seconds, 1),
         'ours': rates([r['path'] for r in again['suspected_mislabels']], flipped),
         **_ranked(oof_labels, sets[variant], oof_paths, flipped)})
  if variants:
    mean = np.mean(list(sets.values()), axis=0)
    row['ensemble'] = {'of': list(sets),
                       'held_out_accuracy': round(float(np.mean(mean.argmax(1) == oof_labels)), 4),
                       **_ranked(oof_labels, mean, oof_paths, flipped)}
  if dump:
    os.makedirs(dump, exist_ok=True)
    np.savez_compressed(os.path.join(dump, f'{name}.npz'), paths=np.asarray(oof_paths, str),
                        labels=oof_labels, flipped=np.asarray([p in flipped for p in oof_paths]),
                        in_sample_paths=np.asarray(paths, str),
                        in_sample=own, **{f'oof_{i}': v for i, v in enumerate(sets.values())},
                        names=np.asarray(list(sets), str))
  print('audit_real_data:', json.dumps(row), flush=True)
  return row


def _ranked(labels: np.ndarray, probabilities: np.ndarray, paths: list, flipped: set) -> dict:
  """Confident learning's list and the self-confidence ranking of one set of probabilities."""
  from flaxtpu.data import audit  # pylint: disable=g-import-not-at-top
  listed = audit.find_label_issues(labels, probabilities, 'prune_by_noise_rate').ranked
  confidence = probabilities[np.arange(len(labels)), labels]
  ranking = rates([paths[i] for i in np.argsort(confidence, kind='stable')], flipped)
  ranking['suspects'] = None
  by_confidence = listed[np.argsort(confidence[listed], kind='stable')]  # the same list, another order
  return {'confident_learning': rates([paths[i] for i in listed], flipped), 'self_confidence': ranking,
          'listed_by_self_confidence': rates([paths[i] for i in by_confidence], flipped)}


# --- the tables ---------------------------------------------------------------------------------


def _cell(r) -> str:
  if not r:
    return '-'
  if r['suspects'] is None:
    return f'top F {r["top_f"]:.2f} / 2F {r["top_2f"]:.2f}'
  precision = '-' if r['precision'] is None else f'{r["precision"]:.2f}'
  return f'{r["suspects"]:,}, {precision}, {r["recall"]:.2f}, {r["top_f"]:.2f} / {r["top_2f"]:.2f}'


def markdown(rows: list) -> str:
  lines = ['| case | flips | run: steps, eval acc | fold runs: steps, held-out acc (chance) | verdict | '
           'audit: suspects, precision, recall, top F / 2F | cleanlab, same probabilities | '
           'the same list ranked by self-confidence | self-confidence ranking of all | '
           'in-sample (the run\'s own model) | audit / run (s) |',
           '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for r in rows:
    folds = ', '.join(f'{a:.2f}' for a in r['fold_accuracies'] or [])
    verdict = r['verdict'] + (f' ({r["withheld"]:,} withheld)' if r.get('withheld') else '')
    lines.append(f'| {r["case"]} | {r["flips"]} of {r["images"]:,} | '
                 f'{r["run_steps"]}, {r["run_eval_accuracy"]:.3f} | '
                 f'{r["fold_steps"]}, {folds} ({r["chance"]:.2f}) | {verdict} | {_cell(r["ours"])} | '
                 f'{_cell(r.get("cleanlab"))} | {_cell(r.get("listed_by_self_confidence"))} | '
                 f'{_cell(r["self_confidence"])} | {_cell(r["in_sample"])} | '
                 f'{r["audit_seconds"]:.0f} / {r["train_seconds"]:.0f} |')
  return '\n'.join(lines) + '\n'


def issue_table(scratch: str, seed: int, parts: str = 'digits,squares') -> list:
  """Issue 70's audit table, re-measured: (1) a 2,500-image grayscale digits folder (200 a class for
  train, 20 of them filed under a wrong class, 50 a class for test) on configs/mnist.py; (2) 3 classes of
  coloured-pattern images (tests/planted.py: 100 a class for train, 10 flipped, 15 a class for test) on
  configs/cifar10.py with num_train_steps=200 given to both commands; (3) the same run audited without the
  override (a fresh copy of its workdir). Both splits audited, as `--workdir=RUN --mode=audit` does."""
  rows = []
  cache = [f'compilation_cache_dir={scratch}/jax_cache']
  if 'digits' in parts:
    rows.append(_issue_digits(scratch, seed, cache))
  if 'squares' in parts:
    rows.extend(_issue_squares(scratch, seed, cache))
  return rows


def _issue_digits(scratch: str, seed: int, cache: list) -> dict:
  train, test = digit_images(200, 'train', seed), digit_images(50, 'test', seed + 1)
  root = os.path.join(scratch, 'table_digits', 'data')
  flipped = build(root, train, test, flips_of('random1', [n for _, n in train], seed))
  config = recipe('mnist', root, cache)
  workdir = os.path.join(scratch, 'table_digits', 'run')
  shutil.rmtree(workdir, ignore_errors=True)
  return run_case('digits 2,500, configs/mnist.py', root, flipped, config, config, workdir)


def _issue_squares(scratch: str, seed: int, cache: list) -> list:
  sys.path.insert(0, os.path.join(ROOT, 'tests'))
  from planted import TINTS, pattern  # pylint: disable=g-import-not-at-top
  rows = []
  rng = np.random.default_rng(seed)
  names = list(TINTS)
  train = [(pattern(rng, label), names[label]) for label in range(3) for _ in range(100)]
  test = [(pattern(rng, label), names[label]) for label in range(3) for _ in range(15)]
  root = os.path.join(scratch, 'table_squares', 'data')
  flipped = build(root, train, test, {int(i): names[(names.index(train[i][1]) + 1 + int(rng.integers(2))) % 3]
                                      for i in rng.choice(len(train), 10, replace=False)})
  config = recipe('keras', root, cache + ['num_train_steps=200'])
  workdir = os.path.join(scratch, 'table_squares', 'run')
  shutil.rmtree(workdir, ignore_errors=True)
  rows.append(run_case('squares, configs/cifar10.py, num_train_steps=200 to both', root, flipped, config,
                       config, workdir))
  bare = recipe('keras', root, cache)  # the audit command without the step override
  again = os.path.join(scratch, 'table_squares', 'run_again')
  shutil.rmtree(again, ignore_errors=True)
  shutil.copytree(workdir, again, ignore=shutil.ignore_patterns('audit_folds', 'audit.*'))
  rows.append(run_case('the same, the audit without the override', root, flipped, config, bare, again,
                       train_run=False))
  return rows


def markdown_variants(rows: list) -> str:
  """The audits of a run again (`--variant`) and the ensemble of all its audits, ranked alike."""
  lines = []
  for r in rows:
    for v in r.get('variants', []):
      lines.append(f'| {r["case"]} | {v["variant"]} | {v["fold_steps"]} | {v["held_out_accuracy"]:.3f} | '
                   f'{_cell(v["confident_learning"])} | {_cell(v["self_confidence"])} | '
                   f'{v["audit_seconds"]:.0f} |')
    if 'ensemble' in r:
      e = r['ensemble']
      lines.append(f'| {r["case"]} | mean of {len(e["of"])} audits\' probabilities | | '
                   f'{e["held_out_accuracy"]:.3f} | {_cell(e["confident_learning"])} | '
                   f'{_cell(e["self_confidence"])} | |')
  if not lines:
    return ''
  return ('\n| case | audited again with | fold steps | held-out acc | confident learning: suspects, '
          'precision, recall, top F / 2F | self-confidence ranking | audit (s) |\n'
          '| --- | --- | --- | --- | --- | --- | --- |\n' + '\n'.join(lines) + '\n')


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cifar', default='', help='a CIFAR-10 image folder (train/<class>/*, test/<class>/*)')
  parser.add_argument('--digits', action='store_true', help='the embedded digits, enlarged to 28x28')
  parser.add_argument('--table', action='store_true', help="issue 70's audit table (3 rows), nothing else")
  parser.add_argument('--table-parts', default='digits,squares', help='of --table: digits (row 1), squares')
  parser.add_argument('--recipes', default='resnet', help='comma-separated: ' + ', '.join(RECIPES))
  parser.add_argument('--settings', default='random1,random5,random10,similar5')
  parser.add_argument('--images', type=int, default=2000)
  parser.add_argument('--test-images', type=int, default=1000)
  parser.add_argument('--set', action='append', default=[], help='KEY=VALUE for the recipe (both runs)')
  parser.add_argument('--audit-set', action='append', default=[], help='KEY=VALUE for the audit only')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--variant', action='append', default=[],
                      help='KEY=VALUE,...: audit the same run again with these (an ensemble row follows)')
  parser.add_argument('--resume', action='store_true', help='keep the runs in --scratch: they resume')
  parser.add_argument('--dump', default='', help='save each case\'s probabilities in this folder')
  parser.add_argument('--scratch', default='/tmp/audit_real_data')
  parser.add_argument('--out', default=os.path.join(ROOT, 'experiments/results/audit_real_data'))
  parser.add_argument('--name', default='results', help='OUT/NAME.json and OUT/NAME.md')
  args = parser.parse_args(argv)
  global COMMAND
  COMMAND = 'python -m experiments.audit_real_data ' + ' '.join(sys.argv[1:] if argv is None else argv)
  logging.basicConfig(level=logging.WARNING)
  import jax  # pylint: disable=g-import-not-at-top
  # The CLI's persistent compilation cache (flaxtpu/main.py): each fold run reads the programs the run
  # compiled, as `--mode=audit` from the command line does.
  jax.config.update('jax_compilation_cache_dir', os.path.join(args.scratch, 'jax_cache'))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  if args.table:
    rows = issue_table(args.scratch, args.seed, args.table_parts)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'issue_table.json'), 'w') as f:
      json.dump({'command': COMMAND, 'rows': rows}, f, indent=1)
    with open(os.path.join(args.out, 'issue_table.md'), 'w') as f:
      f.write(f'    {COMMAND}\n\n' + markdown(rows))
    print(markdown(rows))
    return
  rows = []
  for recipe_name in args.recipes.split(','):
    for setting in args.settings.split(','):
      if args.cifar:
        subset = cifar_subset(args.cifar, args.images, args.test_images)
        train, test, data = subset['train'], subset['test'], 'cifar10'
      elif args.digits:
        train = digit_images(args.images // 10, 'train', args.seed)
        test = digit_images(args.test_images // 10, 'test', args.seed + 1)
        data = 'digits'
      else:
        raise SystemExit('give --cifar DIR or --digits')
      name = f'{data}{len(train)}_{setting}_{recipe_name}'
      root = os.path.join(args.scratch, name, 'data')
      flips = flips_of(setting, [n for _, n in train], args.seed)
      flipped = build(root, train, test, flips)
      workdir = os.path.join(args.scratch, name, 'run')
      if not args.resume:
        shutil.rmtree(workdir, ignore_errors=True)
      config = recipe(recipe_name, root, args.set + [f'compilation_cache_dir={args.scratch}/jax_cache'])
      audit_config = config.copy_and_resolve_references()
      audit_config.dataset.eval_split = 'train'  # the train images alone: the flips' split
      for override in args.audit_set:
        key, value = override.split('=', 1)
        audit_config.update_from_flattened_dict({key: _value(value)})
      rows.append(run_case(name, root, flipped, config, audit_config, workdir, variants=tuple(args.variant),
                           dump=args.dump))
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, f'{args.name}.json'), 'w') as f:
        json.dump({'command': COMMAND, 'rows': rows}, f, indent=1)
      with open(os.path.join(args.out, f'{args.name}.md'), 'w') as f:
        f.write(f'    {COMMAND}\n\n' + markdown(rows) + markdown_variants(rows))
  print(markdown(rows) + markdown_variants(rows))


if __name__ == '__main__':
  main()
