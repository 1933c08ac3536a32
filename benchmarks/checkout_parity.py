"""Two checkouts of flaxtpu, the same five runs: are the checkpoints bitwise equal and the metrics rows equal?

A refactor that changes the shape of the code and not what it computes must
pass this. It builds its own data (no download), then runs each recipe with
`python -m flaxtpu.main` from each checkout (PYTHONPATH = the checkout, so the
two never share code) and compares every array of every saved checkpoint and
every row of metrics.jsonl (timing fields aside):

    git worktree add /tmp/old main~5
    python -m benchmarks.checkout_parity --old=/tmp/old --new=. --workdir=/tmp/parity

The five runs: the embedded digits default; a streamed folder of mixed
photos (sizes, modes, formats) decoded by input worker processes; WebDataset
tar shards with the shard sampler; a label file of multi-label tags; a
fine-tune from a timm ResNet-18 .safetensors file (random weights, made here
with timm). Exits 1 when any run differs.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import tarfile
import time

import numpy as np
from PIL import Image

STEPS = 12
COMMON = [f'--config.num_train_steps={STEPS}', '--config.log_every_steps=4', '--config.eval_every_steps=6',
          '--config.checkpoint_every_steps=6', '--config.compilation_cache_dir=none']


def _photos(root: str, seed: int = 0, per_class: tuple[int, int] = (24, 8)) -> list[tuple[str, int, str]]:
  """Class c is brightness 80c..80c+60: JPEG/PNG, RGB/L/CMYK/P/RGBA, 12-59 px of any aspect."""
  rng = np.random.default_rng(seed)
  kinds = [('RGB', '.jpg'), ('L', '.png'), ('CMYK', '.jpeg'), ('P', '.png'), ('RGBA', '.png'),
           ('RGB', '.png')]
  made = []
  for split, count in zip(('train', 'test'), per_class):
    for label, name in enumerate(('cat', 'dog', 'frog')):
      os.makedirs(os.path.join(root, split, name), exist_ok=True)
      for i in range(count):
        height, width = rng.integers(12, 60, 2)
        pixels = (rng.integers(0, 60, (height, width, 3)) + label * 80).astype(np.uint8)
        mode, extension = kinds[i % len(kinds)]
        path = os.path.join(split, name, f'{i:03d}{extension}')
        Image.fromarray(pixels, 'RGB').convert(mode).save(os.path.join(root, path))
        made.append((path, label, split))
  return made


def _shards(root: str, photos: list, folder: str) -> str:
  """The photos as tar shards, 2 per split, with classes.txt: KEY.<ext> + KEY.cls."""
  os.makedirs(root, exist_ok=True)
  for split in ('train', 'test'):
    rows = [row for row in photos if row[2] == split]
    for shard in range(2):
      with tarfile.open(os.path.join(root, f'{split}-{shard}.tar'), 'w', format=tarfile.USTAR_FORMAT) as tar:
        for i, (path, label, _) in enumerate(rows[shard::2]):
          key = f'{shard}_{i:04d}'
          with open(os.path.join(folder, path), 'rb') as f:
            image = f.read()
          members = ((key + os.path.splitext(path)[1], image), (f'{key}.cls', str(label).encode()))
          for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
  with open(os.path.join(root, 'classes.txt'), 'w') as f:
    f.write('cat\ndog\nfrog\n')
  return os.path.join(root, '{split}-{0..1}.tar')


def _tags(root: str, photos: list) -> str:
  """labels.csv of the photos with tags: its class, plus 'bright' for the brighter half of the classes."""
  tags = {0: 'cat', 1: 'dog;bright', 2: 'frog;bright'}
  path = os.path.join(root, 'tags.csv')
  with open(path, 'w', newline='') as f:
    csv.writer(f).writerows([['path', 'labels', 'split'], *[(p, tags[c], s) for p, c, s in photos]])
  return path


def _timm_file(root: str) -> str:
  import types  # pylint: disable=g-import-not-at-top
  # The x86_64 torchvision wheel beside the CPU torch lacks its C ops; timm imports it (as in the tests).
  stub = 'torchvision._meta_registrations'
  sys.modules.setdefault(stub, types.ModuleType(stub))
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = timm.create_model('resnet18')
  for module in model.modules():  # statistics that matter, so a wrong mapping shows
    if isinstance(module, torch.nn.BatchNorm2d):
      module.running_mean.uniform_(-0.1, 0.1)
      module.running_var.uniform_(0.5, 1.5)
  path = os.path.join(root, 'resnet18.safetensors')
  save_file(model.state_dict(), path)
  return path


def recipes(data: str) -> dict[str, list[str]]:
  os.makedirs(data, exist_ok=True)
  folder = os.path.join(data, 'photos')
  photos = _photos(folder)
  shards = _shards(os.path.join(data, 'shards'), photos, folder)
  tags = _tags(folder, photos)
  timm_file = _timm_file(data)
  keras = ['--config=configs/cifar10.py', '--config.batch_size=16']
  return {
      'digits': ['--config=configs/digits.py'],
      'streamed_folder': keras + [f'--config.dataset.folder={folder}', '--config.dataset.image_size=24',
                                  '--config.dataset.cache=none', '--config.input.workers=2'],
      'tar_shards': keras + [f'--config.dataset.shards={shards}', '--config.dataset.image_size=24',
                             '--config.dataset.sampling=shards', '--config.input.workers=2'],
      'label_file_multilabel': keras + ['--config.task=multilabel', f'--config.dataset.labels={tags}',
                                        '--config.dataset.image_size=24',
                                        '--config.dataset.class_weights=balanced'],
      'finetune_timm': ['--config=configs/cifar10.py', '--config.model.name=resnet18',
                        '--config.batch_size=16', f'--config.init_from.checkpoint={timm_file}',
                        f'--config.dataset.folder={folder}',
                        '--config.dataset.image_size=32', '--config.optimizer.learning_rate=0.01'],
  }


def run(checkout: str, flags: list[str], workdir: str) -> float:
  env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout),
             XLA_FLAGS='--xla_force_host_platform_device_count=8', TF_CPP_MIN_LOG_LEVEL='2')
  start = time.perf_counter()
  done = subprocess.run([sys.executable, '-m', 'flaxtpu.main', *flags, *COMMON, f'--workdir={workdir}'],
                        cwd=checkout, env=env, capture_output=True, text=True)
  if done.returncode:
    raise SystemExit(f'{checkout}: {" ".join(flags)} failed:\n{done.stderr[-3000:]}')
  return time.perf_counter() - start


def checkpoint_arrays(workdir: str) -> dict[str, dict[str, np.ndarray]]:
  """Every saved step's state as flat {path: array}, restored on one CPU device."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)  # orbax warns of metadata files its own format does not write
  saved = {}
  root = os.path.join(workdir, 'checkpoints')
  for step in sorted((s for s in os.listdir(root) if s.isdigit()), key=int):
    path = os.path.join(root, step, 'state')
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(path).item_metadata
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    state = checkpointer.restore(path, target)
    saved[step] = {jax.tree_util.keystr(key): np.asarray(leaf)
                   for key, leaf in jax.tree_util.tree_leaves_with_path(state)}
  return saved


def metric_rows(workdir: str) -> list[dict]:
  timing = ('images_per_sec', 'input_wait_fraction')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in f]


def compare(old: str, new: str) -> list[str]:
  """What differs between two workdirs: checkpoint steps, array names, bytes, metrics rows."""
  problems = []
  a, b = checkpoint_arrays(old), checkpoint_arrays(new)
  if a.keys() != b.keys():
    return [f'saved steps {sorted(a)} vs {sorted(b)}']
  for step in a:
    if a[step].keys() != b[step].keys():
      problems.append(f'step {step}: arrays {sorted(a[step].keys() ^ b[step].keys())} differ')
      continue
    for name, array in a[step].items():
      other = b[step][name]
      if array.dtype != other.dtype or array.shape != other.shape or array.tobytes() != other.tobytes():
        problems.append(f'step {step}: {name} differs')
  rows_a, rows_b = metric_rows(old), metric_rows(new)
  if rows_a != rows_b:
    problems.append(f'metrics.jsonl rows differ ({len(rows_a)} vs {len(rows_b)} rows)')
  return problems


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--old', required=True, help='the reference checkout')
  parser.add_argument('--new', default='.', help='the checkout under test')
  parser.add_argument('--workdir', required=True, help='data and runs go here')
  parser.add_argument('--only', default='', help='comma-separated recipe names')
  args = parser.parse_args()
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  all_recipes = recipes(os.path.join(args.workdir, 'data'))
  chosen = args.only.split(',') if args.only else list(all_recipes)
  failed = False
  for name in chosen:
    runs = {}
    for label, checkout in (('old', args.old), ('new', args.new)):
      runs[label] = os.path.join(args.workdir, label, name)
      if not os.path.exists(os.path.join(runs[label], 'results.json')):
        seconds = run(checkout, all_recipes[name], runs[label])
        print(f'{name}: {label} ran in {seconds:.0f} s', flush=True)
    problems = compare(runs['old'], runs['new'])
    saved = sorted(checkpoint_arrays(runs['new']), key=int)
    rows = len(metric_rows(runs['new']))
    equal = f'bitwise equal: checkpoints at steps {", ".join(saved)}, {rows} metrics rows equal'
    print(f'{name}: ' + ('; '.join(problems[:5]) if problems else equal), flush=True)
    failed |= bool(problems)
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  main()
