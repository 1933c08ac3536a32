"""Issue 38's closing demo: fine-tune a family new to flaxtpu from a LOCAL timm folder on a photo-like
folder, export it, and load the export back with `timm.create_model`.

    PYTHONPATH=$PWD python -m experiments.timm_folder_demo --out /tmp/demo [--model efficientnet_b0]

1. A timm model with random weights (BatchNorm statistics measured on images) saved as timm saves one:
   OUT/timm_source/{model.safetensors, config.json} (`timm.models._hub.save_for_hf`).
2. A photo-like folder OUT/photos/{train,test}/<class>/: four classes of drawn shapes and stripes, mixed
   sizes (40-120 px, not square), JPEG and PNG, RGB and grayscale.
3. `--config=configs/finetune.py --config.init_from.checkpoint=OUT/timm_source` (the commands are printed).
4. `--mode=export`, then `timm.create_model('local-dir:OUT/run/export/timm', pretrained=True)`.
5. `--mode=predict` on the test photos (no flip averaging) beside timm's softmax on the same pixels:
   flaxtpu's predict reads each photo with its own pipeline; timm sees those pixels normalised by the
   export's mean/std. Prints the largest probability and log-probability differences and the top-1
   agreement.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ('disc', 'stripes', 'bars', 'checks')


def draw(kind: str, rng: np.random.Generator) -> Image.Image:
  """One photo of class `kind`: a random size, background and hue, noise on top."""
  width, height = (int(v) for v in rng.integers(40, 121, 2))
  background = tuple(int(v) for v in rng.integers(0, 120, 3))
  color = tuple(int(v) for v in rng.integers(130, 256, 3))
  image = Image.new('RGB', (width, height), background)
  pen = ImageDraw.Draw(image)
  step = int(rng.integers(6, 14))
  if kind == 'disc':
    r = min(width, height) * rng.uniform(0.25, 0.45)
    cx, cy = width * rng.uniform(0.35, 0.65), height * rng.uniform(0.35, 0.65)
    pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
  elif kind == 'stripes':
    for y in range(0, height, 2 * step):
      pen.rectangle((0, y, width, y + step - 1), fill=color)
  elif kind == 'bars':
    for x in range(0, width, 2 * step):
      pen.rectangle((x, 0, x + step - 1, height), fill=color)
  else:
    for y in range(0, height, step):
      for x in range((y // step % 2) * step, width, 2 * step):
        pen.rectangle((x, y, x + step - 1, y + step - 1), fill=color)
  pixels = np.asarray(image, np.float32) + rng.normal(0, 12, (height, width, 3))
  return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_photos(root: str, train: int, test: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  counts = {'jpeg': 0, 'png': 0, 'gray': 0, 'sizes': set()}
  for split, count in (('train', train), ('test', test)):
    for kind in CLASSES:
      os.makedirs(os.path.join(root, split, kind), exist_ok=True)
      for index in range(count):
        image = draw(kind, rng)
        if index % 3 == 2:
          image = image.convert('L')
          counts['gray'] += 1
        counts['sizes'].add(image.size)
        if index % 2:
          image.save(os.path.join(root, split, kind, f'{index:03d}.jpg'), quality=90)
          counts['jpeg'] += 1
        else:
          image.save(os.path.join(root, split, kind, f'{index:03d}.png'))
          counts['png'] += 1
  counts['sizes'] = len(counts['sizes'])
  return counts


def run(*args: str) -> None:
  command = [sys.executable, '-m', 'flaxtpu.main', *args]
  print('$ python -m flaxtpu.main ' + ' '.join(args), flush=True)
  started = time.perf_counter()
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  print(f'  ({time.perf_counter() - started:.0f} s, exit {result.returncode})', flush=True)
  if result.returncode:
    sys.exit(result.stderr[-3000:])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--model', default='efficientnet_b0', help="timm's architecture")
  parser.add_argument('--image-size', type=int, default=64)
  parser.add_argument('--steps', type=int, default=60)
  args = parser.parse_args()
  sys.modules.setdefault('torchvision._meta_registrations',
                         types.ModuleType('torchvision._meta_registrations'))
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from timm.models._hub import save_for_hf  # pylint: disable=g-import-not-at-top

  from tests import test_pretrained  # pylint: disable=g-import-not-at-top
  source, photos, workdir = (os.path.join(args.out, name) for name in ('timm_source', 'photos', 'run'))
  torch.manual_seed(0)
  calibration = np.random.default_rng(1).normal(size=(16, args.image_size, args.image_size, 3))
  model = test_pretrained.measure_batch_norm(torch, timm.create_model(args.model),
                                             calibration.astype(np.float32))
  save_for_hf(model, source, safe_serialization=True,
              data_config={'input_size': (3, args.image_size, args.image_size), 'crop_pct': 1.0,
                           'interpolation': 'bilinear', 'mean': (0.485, 0.456, 0.406),
                           'std': (0.229, 0.224, 0.225)})
  print(f'timm folder: {source}: {sorted(os.listdir(source))}')
  print('photos:', make_photos(photos, train=40, test=10))

  run('--config=configs/finetune.py', f'--workdir={workdir}', f'--config.init_from.checkpoint={source}',
      f'--config.dataset.folder={photos}', f'--config.dataset.image_size={args.image_size}',
      f'--config.num_train_steps={args.steps}', '--config.batch_size=16',
      '--config.compilation_cache_dir=none')
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    print('model:', json.load(f)['model']['name'])
  run('--mode=export', f'--workdir={workdir}')
  output = os.path.join(args.out, 'predictions.csv')
  run('--mode=predict', f'--workdir={workdir}', f'--config.predict.input={photos}/test',
      f'--config.predict.top_k={len(CLASSES)}', f'--config.predict.output_csv={output}',
      '--config.eval.flip_tta=false')

  exported = timm.create_model(f'local-dir:{workdir}/export/timm', pretrained=True).eval()
  mean, std = np.array(exported.pretrained_cfg['mean']), np.array(exported.pretrained_cfg['std'])
  with open(output, newline='', encoding='utf-8') as f:
    rows = list(csv.DictReader(f))
  from flaxtpu.data import pipeline, predict_inputs  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    saved = json.load(f)
  config.dataset.update(saved['dataset'])
  config.augment.update(saved.get('augment', {}))
  paths, images = predict_inputs.read_images(f'{photos}/test', (args.image_size, args.image_size, 3),
                                             pipeline.image_transform(config, channels=3))
  logits = test_pretrained.torch_logits(torch, exported, ((images / 255.0 - mean) / std).astype(np.float32))
  theirs = np.exp(logits - logits.max(-1, keepdims=True))
  theirs /= theirs.sum(-1, keepdims=True)
  names = exported.pretrained_cfg.get('label_names') or list(CLASSES)
  by_path = {row['path']: row for row in rows}
  ours = np.array([[float(by_path[path][f'probability_{rank}']) for rank in range(1, len(CLASSES) + 1)]
                   for path in paths])
  order = [[names.index(by_path[path][f'class_{rank}']) for rank in range(1, len(CLASSES) + 1)]
           for path in paths]
  theirs_ordered = np.take_along_axis(theirs, np.array(order), 1)
  labels = np.array([names.index(os.path.basename(os.path.dirname(path))) for path in paths])
  top1 = np.array(order)[:, 0]
  log = lambda p: np.log(np.maximum(p, 1e-30))  # a random source is sure of some photos: p rounds to 0
  print(f'{len(paths)} test photos: flaxtpu predict top-1 accuracy {np.mean(top1 == labels):.1%}, '
        f'timm top-1 agreement {np.mean(top1 == theirs.argmax(-1)):.1%}, '
        f'max |probability diff| {np.abs(ours - theirs_ordered).max():.2e}, '
        f'max |log-probability diff| {np.abs(log(ours) - log(theirs_ordered)).max():.2e} (floored at 1e-30)')


if __name__ == '__main__':
  main()
