"""Multi-label training on generated scenes: flaxtpu (sigmoid) against timm + BCE, and a softmax reference.

    python -m benchmarks.data.make_scenes --out /data/scenes             # once: 20,000 train + 2,000 test
    python -m benchmarks.accuracy.multilabel --scenes /data/scenes [--epochs 10] [--torch-threads 1]
    python -m benchmarks.accuracy.multilabel --scenes /tmp/scenes --epochs 1     # a smoke run on a small set
    # -> benchmarks/results/local/multilabel.json

Three runs on the same images with the same recipe and budget, one after
another, each in its own process:

- `flaxtpu_multilabel`: `python -m flaxtpu.main` with `configs/cifar10_resnet.py`
  (ResNet-20, batch 128, SGD + Nesterov 0.1, weight decay 5e-4 on kernels,
  1 warmup epoch then cosine, 4-pixel zero-padded crops and flips, standardised
  inputs) on `--config.dataset.labels=SCENES/labels.csv` with
  `--config.task=multilabel`, label smoothing 0, evaluated once at the end on
  the test split (`eval.threshold=0`: per-class thresholds chosen there).
- `torch_multilabel`: PyTorch eager, timm's `ResNet` class built as ResNet-20
  (BasicBlock x [3, 3, 3] at 16/32/64 channels, its 7x7 stem and max pool
  replaced by one 3x3 convolution, the first block's projection dropped:
  272,474 parameters, flaxtpu's count; timm's init and zero-initialised last
  BatchNorm of each block, as flaxtpu's) trained with BCEWithLogitsLoss
  summed over the classes and averaged over the batch (flaxtpu's sigmoid loss,
  big_vision's sigmoid_xent: the same gradient scale), with the same
  optimizer, learning rate at every step (flaxtpu's own schedule function),
  weight decay, augmentation, batch size and steps; its own order and
  augmentation draws. No ResNet in timm's registry has the CIFAR stem;
  `resnet18` at 32x32 would end on a 1x1 map with 40x the parameters.
- `flaxtpu_softmax_single`: flaxtpu multiclass (softmax) on the images that
  hold exactly one shape (~30% of each split, `make_scenes.single_label_rows`),
  trained for as many steps (as many images seen) as the multi-label runs,
  evaluated on the single-shape test images.

Every run's scores are judged by one piece of code (scikit-learn): mAP macro
and micro (`average_precision_score`); flaxtpu's headline F1 (`eval_f1` at
`eval.threshold=0`): micro-F1 at the one threshold with the best micro-F1 on
the test split, and the exact-match ratio there; F1 macro and micro at
per-class best-F1 thresholds (flaxtpu's per-class report) and at 0.5; per-class
AP, F1 and threshold; and on the single-shape test images, for every run,
top-1 accuracy and mAP. Thresholds chosen on the split they score are
optimistic, the same way for every run. flaxtpu's scores are its logits over
the test split, read back from the trained workdir (`modes.restore.restore`,
`evaluate.evaluate`); the numbers flaxtpu itself reported (results.json's
`eval_*`) are recorded next to them. Wall time, CPU seconds (the run's process
tree) and the cores other processes kept busy come from `harness.cpu_load`.

Needs torch, torchvision and timm (the `test` extra) and scikit-learn. On this
machine torchvision's C operators are missing beside the CPU build of torch;
its meta registrations are stubbed out before timm is imported (as
tests/test_pretrained.py does).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

from benchmarks.data import make_scenes
from benchmarks.shared import harness

RECIPE = 'configs/cifar10_resnet.py'
# What every run shares on top of the recipe; label smoothing off because BCEWithLogitsLoss has none.
SHARED_OVERRIDES = {'label_smoothing': 0.0, 'checkpoint.best_metric': '', 'log_every_steps': 50}
ARMS = ('flaxtpu_multilabel', 'torch_multilabel', 'flaxtpu_softmax_single')


# --- the judge: one scorer for every run ------------------------------------------------------------


def multi_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """uint8 [N, C] targets from class indices [N] (or multi-hot rows, returned as they are)."""
  labels = np.asarray(labels)
  if labels.ndim == 2:
    return labels.astype(np.uint8)
  return np.eye(num_classes, dtype=np.uint8)[labels.astype(np.int64)]


def best_f1_threshold(scores: np.ndarray, targets: np.ndarray) -> float:
  """The score threshold (`score >= threshold` predicts) with the best F1 of these scores (0.5 without
  positives), from scikit-learn's precision-recall curve."""
  from sklearn.metrics import precision_recall_curve  # pylint: disable=g-import-not-at-top
  if not targets.any():
    return 0.5
  precision, recall, cuts = precision_recall_curve(targets, scores)
  f1 = 2 * precision[:-1] * recall[:-1] / np.maximum(precision[:-1] + recall[:-1], 1e-12)
  return float(cuts[int(np.argmax(f1))])


def best_f1_thresholds(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Per class, the threshold with the best F1 on these examples (0.5 for a class without positives)."""
  return np.array([best_f1_threshold(scores[:, c], targets[:, c]) for c in range(scores.shape[1])])


def f1_scores(predicted: np.ndarray, targets: np.ndarray) -> tuple[float, float, np.ndarray]:
  """(macro F1, micro F1, per-class F1) of boolean predictions [N, C] against targets."""
  true_positives = (predicted & (targets == 1)).sum(0).astype(np.float64)
  false_positives = (predicted & (targets == 0)).sum(0)
  false_negatives = (~predicted & (targets == 1)).sum(0)
  per_class = 2 * true_positives / np.maximum(2 * true_positives + false_positives + false_negatives, 1)
  micro = 2 * true_positives.sum() / max(2 * true_positives.sum() + false_positives.sum()
                                         + false_negatives.sum(), 1)
  return float(per_class.mean()), float(micro), per_class


def judge(scores: np.ndarray, targets: np.ndarray, class_names: list[str]) -> dict:
  """Every number the table shows, from scores [N, C] in [0, 1] and multi-hot targets [N, C]."""
  from sklearn.metrics import average_precision_score  # pylint: disable=g-import-not-at-top
  present = targets.any(0)  # AP is undefined for a class without positives: left out of the macro mean
  per_class_ap = np.full(len(class_names), np.nan)
  per_class_ap[present] = average_precision_score(targets[:, present], scores[:, present], average=None)
  # flaxtpu's headline (eval_f1, eval_threshold, eval_accuracy): one threshold for every class, the
  # best micro-F1 over all (example, class) pairs, and the exact-match ratio at it.
  global_threshold = best_f1_threshold(scores.ravel(), targets.ravel())
  _, f1_global, _ = f1_scores(scores >= global_threshold, targets)
  thresholds = best_f1_thresholds(scores, targets)
  chosen = scores >= thresholds
  f1_macro, f1_micro, per_class_f1 = f1_scores(chosen, targets)
  f1_macro_half, f1_micro_half, _ = f1_scores(scores >= 0.5, targets)
  result = {
      'examples': int(len(targets)),
      'map_macro': float(np.nanmean(per_class_ap)),
      'map_micro': float(average_precision_score(targets, scores, average='micro')),
      'f1_micro_global_threshold': f1_global, 'global_threshold': global_threshold,
      'exact_match_global_threshold': float(((scores >= global_threshold) == (targets == 1)).all(1).mean()),
      'f1_macro': f1_macro, 'f1_micro': f1_micro,
      'f1_macro_at_0.5': f1_macro_half, 'f1_micro_at_0.5': f1_micro_half,
      'exact_match': float((chosen == (targets == 1)).all(1).mean()),
      'per_class': {name: {'ap': None if np.isnan(ap) else float(ap), 'f1': float(f1), 'threshold': float(t),
                           'positives': int(p)}
                    for name, ap, f1, t, p in zip(class_names, per_class_ap, per_class_f1, thresholds,
                                                  targets.sum(0))},
  }
  single = targets.sum(1) == 1  # the images holding exactly one shape
  if single.any():
    subset_scores, subset_targets = scores[single], targets[single]
    keep = subset_targets.any(0)
    result['single_shape'] = {
        'examples': int(single.sum()),
        'top1_accuracy': float((subset_scores.argmax(1) == subset_targets.argmax(1)).mean()),
        'map_macro': float(average_precision_score(subset_targets[:, keep], subset_scores[:, keep],
                                                   average='macro')),
        'map_micro': float(average_precision_score(subset_targets, subset_scores, average='micro')),
    }
  return result


def aligned(scores: np.ndarray, targets: np.ndarray, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Columns reordered to make_scenes.SHAPES order (a source may order its classes otherwise)."""
  order = [list(names).index(name) for name in make_scenes.SHAPES if name in names]
  return scores[:, order], targets[:, order]


# --- flaxtpu: the CLI, then its logits read back ----------------------------------------------------


def flaxtpu_command(workdir: str, overrides: dict, recipe: str = RECIPE) -> list[str]:
  """The CLI training `recipe` in `workdir` with `overrides` ({'dataset.labels': ..., ...})."""
  return [sys.executable, '-m', 'flaxtpu.main', f'--config={recipe}', f'--workdir={workdir}'] + [
      f'--config.{key}={value}' for key, value in overrides.items()]


def run_logged(command: list[str], log_path: str, env=None) -> dict:
  """Runs `command` (output to `log_path`) under harness.cpu_load; raises with the log's end on failure."""
  with open(log_path, 'w', encoding='utf-8') as log, harness.cpu_load() as load:
    returncode = subprocess.call(command, cwd=harness.ROOT, env=env or harness.subprocess_env(), stdout=log,
                                 stderr=subprocess.STDOUT)
  if returncode:
    tail = pathlib.Path(log_path).read_text(encoding='utf-8', errors='replace')[-4000:]
    raise RuntimeError(f'{" ".join(command)} failed (exit {returncode}); the end of {log_path}:\n{tail}')
  return {'wall_s': load['seconds'], 'cpu_seconds': load['cpu_seconds'],
          'other_cpu_load': load['other_cpu_load']}


def run_flaxtpu(name: str, workdir: str, command: list[str], work: str) -> dict:
  """Trains through the CLI `command` (into `workdir`), then scores the eval split from the workdir in
  another process: the result's `scores_file` (see `score_workdir`); the logs go to `work`."""
  shutil.rmtree(workdir, ignore_errors=True)  # a workdir left by an earlier run would be resumed, not trained
  print(f'{name}: {" ".join(command[1:])}', flush=True)
  result = {'command': ' '.join(command[1:]), **run_logged(command, os.path.join(work, f'{name}.log'))}
  saved = json.loads(pathlib.Path(workdir, 'results.json').read_text(encoding='utf-8'))
  result['reported'] = {k: v for k, v in saved.items()
                        if k.startswith('eval_') and isinstance(v, (int, float))}
  for key in ('step', 'train_images_per_sec', 'time_to_first_step_s', 'wall_time_s'):
    result[key] = saved.get(key)
  scores_file = os.path.join(work, f'{name}_scores.npz')
  run_logged([sys.executable, '-m', 'benchmarks.accuracy.multilabel', '--score-workdir', workdir,
              '--scores-out', scores_file], os.path.join(work, f'{name}_score.log'))
  result['scores_file'] = scores_file
  return result


def score_workdir(workdir: str, out: str) -> None:
  """(In its own process.) The logits and labels of every test example under the trained weights -> npz."""
  from flaxtpu import main as cli  # pylint: disable=g-import-not-at-top  (no JAX at import)
  from flaxtpu.validation import workdir_config  # pylint: disable=g-import-not-at-top
  config = workdir_config.get_config(workdir)
  os.environ['XLA_FLAGS'], _ = cli.cpu_xla_flags(config, 'eval', os.environ.get('XLA_FLAGS', ''))
  from flaxtpu.data import pipeline  # pylint: disable=g-import-not-at-top
  from flaxtpu.evaluation import evaluate  # pylint: disable=g-import-not-at-top
  from flaxtpu.modes import restore  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings.lengths import resolved_eval_batch_size  # pylint: disable=g-import-not-at-top
  placement, state, _, record = restore.restore(config, workdir)
  dataset = pipeline.load(config, need_train=False, class_names=record.get('class_names'))
  _, predictions = evaluate.evaluate(placement, state, dataset, resolved_eval_batch_size(config),
                                     keep_logits=True)
  np.savez(out, logits=predictions.logits, labels=predictions.labels,
           class_names=np.array(dataset.class_names), task=config.task)


def flaxtpu_scores(scores_file: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """Probabilities (sigmoid for multilabel, softmax for multiclass) and multi-hot targets."""
  saved = np.load(scores_file)
  logits, names = saved['logits'].astype(np.float64), [str(n) for n in saved['class_names']]
  if str(saved['task']) == 'multilabel':
    probabilities = 1 / (1 + np.exp(-logits))
  else:
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    probabilities = shifted / shifted.sum(1, keepdims=True)
  return probabilities, multi_hot(saved['labels'], len(names)), names


# --- PyTorch: timm's ResNet as ResNet-20, BCE -------------------------------------------------------


def import_torch():
  """torch and timm: the x86_64 torchvision wheel beside CPU torch lacks its C operators (detection only),
  so its meta registrations are skipped; the classification models work."""
  name = 'torchvision._meta_registrations'
  sys.modules.setdefault(name, types.ModuleType(name))
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  return torch, timm


def timm_resnet20(torch, num_classes: int):
  """timm's ResNet class as the CIFAR ResNet-20: 3x3 stem of 16, BasicBlocks [3, 3, 3] at 16/32/64."""
  from timm.models import resnet  # pylint: disable=g-import-not-at-top
  nn = torch.nn
  model = resnet.ResNet(resnet.BasicBlock, [3, 3, 3], num_classes=num_classes, channels=(16, 32, 64))
  # timm's stem is fixed at 64 channels (7x7 stride 2 + max pool): the CIFAR stem instead, and the first
  # block then takes 16 channels without a projection.
  model.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
  model.bn1 = nn.BatchNorm2d(16)
  model.maxpool = nn.Identity()
  model.layer1[0].conv1 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
  model.layer1[0].downsample = None
  model.layer4 = nn.Identity()  # forward_features calls it
  for conv in (model.conv1, model.layer1[0].conv1):  # timm's init of its convolutions
    nn.init.kaiming_normal_(conv.weight, mode='fan_out', nonlinearity='relu')
  return model


def read_scenes(labels_csv: str, root: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  """uint8 images [N, H, W, 3] and multi-hot targets [N, 10] (SHAPES order) of a labels.csv split."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  with open(labels_csv, newline='', encoding='utf-8') as f:
    rows = [row for row in csv.DictReader(f) if row['split'] == split]
  images = np.stack([np.asarray(Image.open(os.path.join(root, row['path'])).convert('RGB')) for row in rows])
  targets = np.zeros((len(rows), len(make_scenes.SHAPES)), np.uint8)
  for i, row in enumerate(rows):
    for tag in filter(None, row['labels'].split(';')):
      targets[i, make_scenes.SHAPES.index(tag)] = 1
  return images, targets


def torch_arm(args) -> None:
  """(In its own process.) Trains and scores the PyTorch peer; scores -> --scores-out, a JSON line out."""
  torch, _ = import_torch()
  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  # pylint: disable-next=g-import-not-at-top  (the run length and schedule, evaluated step by step)
  from flaxtpu.optimizers import optim
  from flaxtpu.settings import lengths
  started = time.perf_counter()
  torch.manual_seed(args.seed)
  generator = torch.Generator().manual_seed(args.seed)
  config = recipe_config(args)
  train_x, train_y = read_scenes(os.path.join(args.scenes, 'labels.csv'), args.scenes, 'train')
  test_x, test_y = read_scenes(os.path.join(args.scenes, 'labels.csv'), args.scenes, 'test')
  pixels = train_x.reshape(-1, 3).astype(np.float64) / 255
  mean = torch.tensor(pixels.mean(0), dtype=torch.float32).view(1, 3, 1, 1)
  std = torch.tensor(pixels.std(0), dtype=torch.float32).view(1, 3, 1, 1)
  del pixels
  to_tensor = lambda u8: torch.from_numpy(np.ascontiguousarray(u8.transpose(0, 3, 1, 2)))
  train_x, test_x = to_tensor(train_x), to_tensor(test_x)
  train_y = torch.from_numpy(train_y.astype(np.float32))
  normalize = lambda u8: ((u8.float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)

  length = lengths.run_length(config, len(train_y))
  schedule = optim.learning_rate_schedule(config, length)
  rates = [float(schedule(step)) for step in range(length.total_steps)]
  model = timm_resnet20(torch, len(make_scenes.SHAPES)).to(memory_format=torch.channels_last)
  opt = config.optimizer
  kernels = [p for p in model.parameters() if p.ndim > 1]
  others = [p for p in model.parameters() if p.ndim <= 1]
  optimizer = torch.optim.SGD([{'params': kernels, 'weight_decay': opt.weight_decay},
                               {'params': others, 'weight_decay': opt.bias_weight_decay}],
                              lr=opt.learning_rate, momentum=opt.momentum, nesterov=opt.nesterov)
  loss_fn = torch.nn.BCEWithLogitsLoss(reduction='sum')  # then / batch: flaxtpu's (big_vision's) sigmoid_xent
  padding, batch_size = config.augment.crop_padding, config.batch_size
  load_s = time.perf_counter() - started
  train_started, order = time.perf_counter(), None
  for step in range(length.total_steps):
    position = step % length.steps_per_epoch
    if position == 0:
      order = torch.randperm(len(train_y), generator=generator)
    rows = order[position * batch_size:(position + 1) * batch_size]
    x = normalize(augment(torch, train_x[rows], generator, padding, config.augment.flip))
    for group in optimizer.param_groups:
      group['lr'] = rates[step]
    loss = loss_fn(model(x), train_y[rows]) / len(rows)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if (step + 1) % 50 == 0 or step + 1 == length.total_steps:
      print(f'step {step + 1}/{length.total_steps} loss {loss.item():.4f} '
            f'{(step + 1) * batch_size / (time.perf_counter() - train_started):.0f} img/s',
            file=sys.stderr, flush=True)
  train_s = time.perf_counter() - train_started
  model.eval()
  with torch.inference_mode():
    logits = torch.cat([model(normalize(test_x[i:i + 500])) for i in range(0, len(test_x), 500)])
  np.savez(args.scores_out, logits=logits.numpy(), labels=test_y,
           class_names=np.array(make_scenes.SHAPES), task='multilabel')
  print(json.dumps({'model': 'timm ResNet(BasicBlock, [3, 3, 3], channels=(16, 32, 64)) with a CIFAR stem',
                    'params': sum(p.numel() for p in model.parameters()),
                    'torch': torch.__version__, 'threads': torch.get_num_threads(),
                    'steps': length.total_steps, 'load_s': load_s, 'train_s': train_s,
                    'train_images_per_sec': length.total_steps * batch_size / train_s,
                    'bce_reduction': 'sum over classes, mean over the batch'}))


def augment(torch, images, generator, padding: int, flip: bool):
  """flaxtpu's augment.crop_padding (zeros) + augment.flip per image: pad, a random window, a coin flip."""
  n, _, height, width = images.shape
  padded = torch.nn.functional.pad(images, (padding,) * 4)
  offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=generator)
  out = torch.empty_like(images)
  for dy in range(2 * padding + 1):
    for dx in range(2 * padding + 1):
      rows = ((offsets[:, 0] == dy) & (offsets[:, 1] == dx)).nonzero().flatten()
      out[rows] = padded[rows, :, dy:dy + height, dx:dx + width]
  if flip:
    rows = (torch.rand(n, generator=generator) < 0.5).nonzero().flatten()
    out[rows] = out[rows].flip(3)
  return out


def recipe_config(args):
  """The recipe with this benchmark's shared values, for the numbers the PyTorch peer copies."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('recipe', harness.ROOT / RECIPE)
  recipe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(recipe)
  config = recipe.get_config()
  config.update_from_flattened_dict({**SHARED_OVERRIDES, 'num_epochs': float(args.epochs),
                                     'batch_size': args.batch_size, 'seed': args.seed})
  return config


def run_torch(args, work: str) -> dict:
  scores_file = os.path.join(work, 'torch_multilabel_scores.npz')
  command = [sys.executable, '-m', 'benchmarks.accuracy.multilabel', '--torch-arm', '--scenes', args.scenes,
             '--epochs', str(args.epochs), '--batch-size', str(args.batch_size), '--seed', str(args.seed),
             '--torch-threads', str(args.torch_threads), '--scores-out', scores_file]
  print(f'torch_multilabel: {" ".join(command[1:])}', flush=True)
  log_path = os.path.join(work, 'torch_multilabel.log')
  env = harness.subprocess_env()
  if args.torch_threads:
    env['OMP_NUM_THREADS'] = str(args.torch_threads)
  result = run_logged(command, log_path, env)
  lines = pathlib.Path(log_path).read_text(encoding='utf-8').splitlines()
  result.update(json.loads(next(line for line in reversed(lines) if line.startswith('{'))))
  result['scores_file'] = scores_file
  return result


# --- the benchmark -----------------------------------------------------------------------------------


def count_rows(labels_csv: str) -> dict:
  with open(labels_csv, newline='', encoding='utf-8') as f:
    rows = list(csv.DictReader(f))
  return {split: sum(row['split'] == split for row in rows) for split in make_scenes.SPLITS}


def write_single_csv(scenes: str, path: str) -> dict:
  """The single-shape rows of SCENES/labels.csv -> `path` (paths stay relative to SCENES)."""
  rows = make_scenes.single_label_rows(os.path.join(scenes, 'labels.csv'))
  with open(path, 'w', newline='', encoding='utf-8') as f:
    writer = csv.DictWriter(f, ['path', 'labels', 'split'])
    writer.writeheader()
    writer.writerows(rows)
  return count_rows(path)


def short_error(text: str) -> str:
  """The line of a failed run's output that says what went wrong (flaxtpu's `error: ...`, else the last)."""
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  said = [line for line in lines if line.startswith(('error:', 'Error', 'RuntimeError', 'ValueError'))]
  return (said or lines or [''])[-1][:200]


def print_table(arms: dict) -> None:
  header = (f'{"run":24s} {"mAP macro":>9s} {"mAP micro":>9s} {"F1":>6s} {"exact":>6s} {"F1 macro":>8s} '
            f'{"F1@0.5":>7s} | {"1-shape top-1":>13s} {"1-shape mAP":>11s} | '
            f'{"wall s":>7s} {"CPU s":>7s} {"train img/s":>11s} {"others":>6s}')
  print(header)
  print('-' * len(header))
  for name, arm in arms.items():
    if 'error' in arm:
      print(f'{name:24s} failed: {short_error(arm["error"])}')
      continue
    m, single = arm['judged'], arm['judged'].get('single_shape', {})
    print(f'{name:24s} {m["map_macro"]:9.4f} {m["map_micro"]:9.4f} {m["f1_micro_global_threshold"]:6.4f} '
          f'{m["exact_match_global_threshold"]:6.3f} {m["f1_macro"]:8.4f} {m["f1_micro_at_0.5"]:7.4f} | '
          f'{single.get("top1_accuracy", float("nan")):13.4f} '
          f'{single.get("map_macro", float("nan")):11.4f} | {arm["wall_s"]:7.0f} {arm["cpu_seconds"]:7.0f} '
          f'{arm.get("train_images_per_sec") or float("nan"):11.0f} {arm["other_cpu_load"]:6.2f}')
  print('F1: micro-F1 at the one threshold with the best micro-F1 on the test split, exact: every tag right '
        'there (flaxtpu\'s eval_f1 and eval_accuracy at eval.threshold=0); F1 macro: at per-class best-F1 '
        'thresholds; F1@0.5: micro at 0.5; 1-shape: the test images with one shape; others: cores other '
        'processes kept busy')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--scenes', help='a folder made by python -m benchmarks.data.make_scenes (labels.csv)')
  parser.add_argument('--epochs', type=float, default=10, help='epochs of the multi-label runs')
  parser.add_argument('--batch-size', type=int, default=128)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--arms', default=','.join(ARMS), help=f'comma-separated, of {", ".join(ARMS)}')
  parser.add_argument('--torch-threads', type=int, default=0,
                      help="PyTorch's intra-op threads (0 = its default); on a shared machine 1 is often "
                      'faster')
  parser.add_argument('--work', default='', help='keep the workdirs and logs here (default: a temporary '
                      'folder); its folders named after the runs are replaced')
  harness.out_argument(parser, 'multilabel.json')
  parser.add_argument('--score-workdir', help=argparse.SUPPRESS)  # internal: score a trained workdir
  parser.add_argument('--torch-arm', action='store_true', help=argparse.SUPPRESS)  # internal: the peer
  parser.add_argument('--scores-out', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.score_workdir:
    return score_workdir(args.score_workdir, args.scores_out)
  if not args.scenes or not os.path.isfile(os.path.join(args.scenes, 'labels.csv')):
    parser.error('--scenes must be a folder with labels.csv '
                 '(python -m benchmarks.data.make_scenes --out DIR)')
  if args.torch_arm:
    return torch_arm(args)
  arms_wanted = [arm for arm in args.arms.split(',') if arm]
  if unknown := set(arms_wanted) - set(ARMS):
    parser.error(f'--arms: unknown {sorted(unknown)}; choose from {", ".join(ARMS)}')
  scenes = os.path.abspath(args.scenes)
  work = args.work or tempfile.mkdtemp(prefix='multilabel_')
  os.makedirs(work, exist_ok=True)
  sizes = count_rows(os.path.join(scenes, 'labels.csv'))
  single_csv = os.path.join(work, 'labels_single.csv')
  single_sizes = write_single_csv(scenes, single_csv)
  multilabel_steps = int(max(1, np.ceil(args.epochs * (sizes['train'] // args.batch_size))))
  common = {'batch_size': args.batch_size, 'seed': args.seed, 'dataset.train_split': 'train',
            'dataset.eval_split': 'test', 'eval_every_steps': multilabel_steps,
            'checkpoint_every_steps': multilabel_steps}
  print(f'{scenes}: {sizes["train"]:,} train / {sizes["test"]:,} test images; single-shape '
        f'{single_sizes["train"]:,} / {single_sizes["test"]:,}; {multilabel_steps} steps of '
        f'{args.batch_size} per run; work in {work}',
        flush=True)
  runs = {
      'flaxtpu_multilabel': {'dataset.labels': os.path.join(scenes, 'labels.csv'), 'task': 'multilabel',
                             'num_epochs': float(args.epochs)},
      # As many steps (images seen) as the multi-label runs, on about a third of their images.
      'flaxtpu_softmax_single': {'dataset.labels': single_csv, 'dataset.folder': scenes, 'task': 'multiclass',
                                 'num_train_steps': multilabel_steps},
  }
  arms = {}
  for name in arms_wanted:
    try:
      if name == 'torch_multilabel':
        arms[name] = run_torch(args, work)
      else:
        workdir = os.path.join(work, name)
        command = flaxtpu_command(workdir, {**SHARED_OVERRIDES, **common, **runs[name]})
        arms[name] = run_flaxtpu(name, workdir, command, work)
      probabilities, targets, names = flaxtpu_scores(arms[name].pop('scores_file'))
      probabilities, targets = aligned(probabilities, targets, names)
      arms[name]['judged'] = judge(probabilities, targets, [n for n in make_scenes.SHAPES if n in names])
    except Exception as error:  # pylint: disable=broad-except  (the other runs still tell something)
      arms[name] = {'error': str(error)}
      print(f'{name} failed: {error}', file=sys.stderr, flush=True)
  print_table(arms)
  harness.write_results(args.out, {
      'scenes': scenes, 'train_images': sizes['train'], 'test_images': sizes['test'],
      'single_shape_images': single_sizes, 'recipe': RECIPE, 'shared_overrides': SHARED_OVERRIDES,
      'epochs': args.epochs, 'steps': multilabel_steps, 'batch_size': args.batch_size, 'seed': args.seed,
      'cpu_count': os.cpu_count(), 'work': work, 'arms': arms})
  if any('error' in arm for arm in arms.values()):
    sys.exit(1)


if __name__ == '__main__':
  main()
