"""configs/cifar10_fast.py's recipe in PyTorch eager: the same run, to check flaxtpu's accuracy and time.

    python benchmarks/fast_recipe_torch.py --folder=/path/to/cifar10 [--seed=0] [--eval-epochs=2,4,6]
    python benchmarks/fast_recipe_torch.py --folder=/path/to/cifar10 \
        --config=experiments/cifar10_fast_ablation.py   # its 2-epoch base run

The peer trains what flaxtpu trains, written independently in PyTorch: the
same network (`fastnet_whiten`: frozen 2x2 whitening stem fitted to the same
5,000 evenly spaced train images with flaxtpu's `whitening_kernel`, conv ->
pool -> BN -> GELU -> conv -> BN -> GELU blocks of 64/256/256 with partial
identity kernels, BatchNorm biases only, global max pool, logits / 9), the same
optimizer (Nesterov SGD, L2 on kernels, flaxtpu's learning-rate schedule
evaluated step by step), label smoothing, zero-padded 2-pixel translations and
flips, and flip TTA. Same data (read by flaxtpu's loader), its own order and
augmentation draws. If flaxtpu's implementation were off, the two would part
at equal epochs; the wall time compares the frameworks on this CPU.

Prints one JSON line: accuracy after each evaluated epoch, seconds, images/s.
Needs torch (`pip install torch==2.13.0`, the `bench` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit('/benchmarks/', 1)[0])
from flaxtpu import config as config_lib  # pylint: disable=wrong-import-position
from flaxtpu import data, optim, steps  # pylint: disable=wrong-import-position
from flaxtpu.models import fastnet  # pylint: disable=wrong-import-position


def build_model(torch, kernel: np.ndarray, widths=(64, 256, 256), num_classes: int = 10):
  nn = torch.nn

  class Block(nn.Module):
    def __init__(self, inputs: int, outputs: int):
      super().__init__()
      self.conv1 = nn.Conv2d(inputs, outputs, 3, padding='same', bias=False)
      self.conv2 = nn.Conv2d(outputs, outputs, 3, padding='same', bias=False)
      # PyTorch's momentum is the new batch's weight: flaxtpu's 0.6 (the old statistics') is 0.4 here.
      self.norm1 = nn.BatchNorm2d(outputs, momentum=0.4, eps=1e-12)
      self.norm2 = nn.BatchNorm2d(outputs, momentum=0.4, eps=1e-12)
      for conv in (self.conv1, self.conv2):  # partial identity: the first min(in, out) filters copy through
        identity = min(conv.in_channels, conv.out_channels)
        torch.nn.init.dirac_(conv.weight.data[:identity])
      for norm in (self.norm1, self.norm2):
        norm.weight.requires_grad_(False)  # a bias only

    def forward(self, x):
      gelu = lambda y: torch.nn.functional.gelu(y, approximate='tanh')
      x = gelu(self.norm1(torch.nn.functional.max_pool2d(self.conv1(x), 2)))
      return gelu(self.norm2(self.conv2(x)))

  class Net(nn.Module):
    def __init__(self):
      super().__init__()
      channels, width = kernel.shape[2], kernel.shape[3]
      self.stem = nn.Conv2d(channels, width, kernel.shape[0], padding=0, bias=True)
      self.stem.weight.data.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy()))  # HWIO -> OIHW
      self.stem.weight.requires_grad_(False)
      self.stem.bias.data.zero_()  # as Flax initialises it
      inputs, blocks = width, []
      for width in widths:
        blocks.append(Block(inputs, width))
        inputs = width
      self.blocks = nn.Sequential(*blocks)
      self.head = nn.Linear(inputs, num_classes, bias=False)

    def forward(self, x):
      x = torch.nn.functional.gelu(self.stem(x), approximate='tanh')
      x = torch.amax(self.blocks(x), dim=(2, 3))
      return self.head(x) / 9

  return Net().to(memory_format=torch.channels_last)


def augment(torch, images, generator, padding: int):
  """Zero-pad, a random window of the original size, a random flip: per image."""
  n, _, height, width = images.shape
  padded = torch.nn.functional.pad(images, (padding,) * 4)
  offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=generator)
  out = torch.empty_like(images)
  for dy in range(2 * padding + 1):
    for dx in range(2 * padding + 1):
      rows = ((offsets[:, 0] == dy) & (offsets[:, 1] == dx)).nonzero().flatten()
      out[rows] = padded[rows, :, dy:dy + height, dx:dx + width]
  flip = (torch.rand(n, generator=generator) < 0.5).nonzero().flatten()
  out[flip] = out[flip].flip(3)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--folder', required=True, help='CIFAR-10 in image-folder layout')
  parser.add_argument('--config', default='configs/cifar10_fast.py', help='the recipe (a fastnet_whiten config)')
  parser.add_argument('--epochs', type=float, default=None, help="default: the recipe's")
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='', help='also write the JSON here')
  parser.add_argument('--eval-epochs', default='', help='comma-separated epochs to evaluate at (the end always)')
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  torch.manual_seed(args.seed)
  generator = torch.Generator().manual_seed(args.seed)
  spec = importlib.util.spec_from_file_location('recipe', args.config)
  recipe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(recipe)
  config = recipe.get_config()
  assert config.model.name == 'fastnet_whiten' and config.optimizer.name == 'sgd', args.config
  config.dataset.folder = args.folder
  if args.epochs:
    config.num_epochs = args.epochs
  dataset = data.load(config)
  mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (dataset.mean, dataset.std))
  to_tensor = lambda u8: torch.from_numpy(np.ascontiguousarray(u8.transpose(0, 3, 1, 2)))
  train_x, train_y = to_tensor(dataset.train.images), torch.from_numpy(dataset.train.labels.astype(np.int64))
  test_x, test_y = to_tensor(dataset.eval.images), torch.from_numpy(dataset.eval.labels.astype(np.int64))
  normalize = lambda u8: ((u8.float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)

  sample = np.stack(data.train_sample(dataset, steps.DATA_FIT_IMAGES))
  kernel = fastnet.whitening_kernel((sample.astype(np.float32) / 255 - dataset.mean) / dataset.std)
  model = build_model(torch, kernel)

  length = config_lib.run_length(config, len(train_y))
  schedule = optim.learning_rate_schedule(config, length)
  opt = config.optimizer
  kernels = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
  biases = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
  optimizer = torch.optim.SGD([dict(params=kernels, weight_decay=opt.weight_decay),
                               dict(params=biases, weight_decay=0.0)],
                              lr=opt.learning_rate, momentum=opt.momentum, nesterov=opt.nesterov)
  loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
  eval_at = {round(float(e) * length.steps_per_epoch) for e in args.eval_epochs.split(',') if e}
  eval_at.add(length.total_steps)

  def evaluate() -> float:
    model.eval()
    correct = 0
    with torch.inference_mode():
      for i in range(0, len(test_y), 1000):
        x = normalize(test_x[i:i + 1000])
        logits = model(x) + model(x.flip(3)) if config.eval.flip_tta else model(x)
        correct += int((logits.argmax(1) == test_y[i:i + 1000]).sum())
    model.train()
    return correct / len(test_y)

  curve, order, first_step = [], None, None
  for step in range(length.total_steps):
    epoch, position = divmod(step, length.steps_per_epoch)
    if position == 0:
      order = torch.randperm(len(train_y), generator=generator)
    rows = order[position * config.batch_size:(position + 1) * config.batch_size]
    x = normalize(augment(torch, train_x[rows], generator, config.augment.crop_padding))
    for group in optimizer.param_groups:
      group['lr'] = float(schedule(step))
    loss = loss_fn(model(x), train_y[rows])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if first_step is None:
      first_step = time.perf_counter() - start
    if step + 1 in eval_at:
      accuracy = evaluate()
      curve.append(dict(epoch=round((step + 1) / length.steps_per_epoch, 2), accuracy=accuracy,
                        seconds=round(time.perf_counter() - start, 1)))
      print(f'epoch {curve[-1]["epoch"]}: test accuracy {accuracy:.4f} at {curve[-1]["seconds"]} s',
            file=sys.stderr, flush=True)
  seconds = time.perf_counter() - start
  result = dict(peer=f'torch {torch.__version__} eager, {torch.get_num_threads()} threads', config=args.config,
                epochs=config.num_epochs, seed=args.seed, accuracy=curve[-1]['accuracy'], curve=curve,
                seconds=round(seconds, 1), first_step_seconds=round(first_step, 1),
                images_per_second=round(length.total_steps * config.batch_size / seconds, 1))
  print(json.dumps(result))
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  main()
