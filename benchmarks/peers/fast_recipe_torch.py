"""configs/cifar10_fast.py's recipe in PyTorch eager: the same run, to check flaxtpu's accuracy and time.

    python -m benchmarks.peers.fast_recipe_torch --folder=/path/to/cifar10 [--seed=0] [--eval-epochs=2,4,6]
    python -m benchmarks.peers.fast_recipe_torch --folder=/path/to/cifar10 \
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

`--overrides` applies an ablation row's keys (a Python dict literal) and the
peer follows the ones airbench adds: BatchNorm-bias learning-rate multiplier
and bias decay, Lookahead, the whitening bias' early freeze, reflected crop
padding, alternating flips and translate TTA, e.g. the recipe without them:

    python -m benchmarks.peers.fast_recipe_torch --folder=/path/to/cifar10 \
        --config=experiments/cifar10_fast_ablation.py --overrides=WITHOUT_AIRBENCH_PARTS

Prints one JSON line: accuracy after each evaluated epoch, seconds, images/s.
Needs torch (`pip install torch==2.13.0`, the `bench` extra).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
import time

import numpy as np

from benchmarks.shared import harness
from flaxtpu.data import loaders, pipeline
from flaxtpu.models.nets import fastnet
from flaxtpu.optimizers import optim, param_patterns
from flaxtpu.settings import lengths
from flaxtpu.step import steps
from flaxtpu.validation import config as config_lib


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


def augment(torch, images, generator, padding: int, pad_mode: str = 'zeros', flip: bool = True, mirror=None):
  """Pad (zeros, reflected or repeated pixels), a random window of the original size, a random flip (or
  `mirror`'s, or none): per image."""
  n, _, height, width = images.shape
  if pad_mode == 'zeros':
    padded = torch.nn.functional.pad(images, (padding,) * 4)
  else:  # PyTorch pads only floats with reflected or repeated pixels
    mode = {'reflect': 'reflect', 'edge': 'replicate'}[pad_mode]
    padded = torch.nn.functional.pad(images.float(), (padding,) * 4, mode=mode).to(images.dtype)
  offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=generator)
  out = torch.empty_like(images)
  for dy in range(2 * padding + 1):
    for dx in range(2 * padding + 1):
      rows = ((offsets[:, 0] == dy) & (offsets[:, 1] == dx)).nonzero().flatten()
      out[rows] = padded[rows, :, dy:dy + height, dx:dx + width]
  coins = torch.rand(n, generator=generator) < 0.5  # drawn either way: the same stream for every row
  if flip:
    rows = (coins if mirror is None else mirror).nonzero().flatten()
    out[rows] = out[rows].flip(3)
  return out


SUPPORTED = {'optimizer.lr_multipliers', 'optimizer.bias_weight_decay', 'optimizer.lookahead_every',
             'optimizer.lookahead_decay', 'optimizer.lookahead_decay_power', 'optimizer.freeze_after',
             'eval.translate_tta', 'eval.flip_tta', 'augment.crop_pad_mode', 'augment.alternate_flip',
             'label_smoothing', 'augment.flip', 'augment.crop_padding'}


def apply_overrides(recipe, config, text: str):
  """An ablation row (a dict literal, or the name of one in the recipe module) applied to `config`."""
  if not text:
    return
  if text.isidentifier() and not hasattr(recipe, text):
    raise SystemExit(f'error: --overrides={text} names nothing in the --config module; pass a dict literal '
                     'or the name of one there (e.g. WITHOUT_AIRBENCH_PARTS with '
                     'experiments/cifar10_fast_ablation.py)')
  overrides = getattr(recipe, text) if text.isidentifier() else ast.literal_eval(text)
  if unsupported := set(overrides) - SUPPORTED:
    raise SystemExit(f'error: the PyTorch peer does not implement {sorted(unsupported)}')
  config.update_from_flattened_dict(overrides)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--folder', required=True, help='CIFAR-10 in image-folder layout')
  parser.add_argument('--config', default='configs/cifar10_fast.py',
                      help='the recipe (a fastnet_whiten config)')
  parser.add_argument('--epochs', type=float, default=None, help="default: the recipe's")
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='', help='also write the JSON here')
  parser.add_argument('--overrides', default='',
                      help="an ablation row: a dict literal or a name in --config's module")
  parser.add_argument('--eval-epochs', default='',
                      help='comma-separated epochs to evaluate at (the end always)')
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
  apply_overrides(recipe, config, args.overrides)
  config.dataset.folder = args.folder
  if args.epochs:
    config.num_epochs = args.epochs
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    raise SystemExit(f'error: {e}') from None
  dataset = pipeline.load(config)
  mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (dataset.mean, dataset.std))
  to_tensor = lambda u8: torch.from_numpy(np.ascontiguousarray(u8.transpose(0, 3, 1, 2)))
  train_x, train_y = to_tensor(dataset.train.images), torch.from_numpy(dataset.train.labels.astype(np.int64))
  test_x, test_y = to_tensor(dataset.eval.images), torch.from_numpy(dataset.eval.labels.astype(np.int64))
  normalize = lambda u8: ((u8.float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)

  sample = np.stack(loaders.train_sample(dataset, steps.DATA_FIT_IMAGES))
  kernel = fastnet.whitening_kernel((sample.astype(np.float32) / 255 - dataset.mean) / dataset.std)
  model = build_model(torch, kernel)

  length = lengths.run_length(config, len(train_y))
  schedule = optim.learning_rate_schedule(config, length)
  opt = config.optimizer
  # flaxtpu's names for PyTorch's parameters, for the lr multipliers and freeze_after patterns.
  names = {'stem.bias': 'stem/bias', 'head.weight': 'head/kernel'}
  for index in range(3):
    for conv, norm in ((1, 0), (2, 1)):
      names[f'blocks.{index}.conv{conv}.weight'] = f'block{index + 1}/Conv_{conv - 1}/kernel'
      names[f'blocks.{index}.norm{conv}.bias'] = f'block{index + 1}/BatchNorm_{norm}/bias'
  multipliers = param_patterns.parse_lr_multipliers(opt.lr_multipliers)
  stops = param_patterns.parse_freeze_after(opt.freeze_after)
  groups = []
  for torch_name, param in model.named_parameters():
    if not param.requires_grad:
      continue
    name = names[torch_name]
    factor = next((f for pattern, f in multipliers if re.search(pattern, name)), 1.0)
    stop = next((round(e * length.steps_per_epoch) for pattern, e in stops if re.search(pattern, name)), None)
    decay = opt.weight_decay if param.ndim > 1 else opt.bias_weight_decay
    # The multiplier scales the whole update, L2 term included, in both frameworks.
    groups.append(dict(params=[param], factor=factor, stop=stop, weight_decay=decay))
  optimizer = torch.optim.SGD(groups, lr=opt.learning_rate, momentum=opt.momentum, nesterov=opt.nesterov)
  trained = [p for p in model.parameters() if p.requires_grad]
  slow = [p.detach().clone() for p in trained] if opt.lookahead_every else None
  first_flips = torch.rand(len(train_y), generator=generator) < 0.5 if config.augment.alternate_flip else None
  loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
  eval_at = {round(float(e) * length.steps_per_epoch) for e in args.eval_epochs.split(',') if e}
  eval_at.add(length.total_steps)

  def views(x, flip):
    return 0.5 * (model(x) + model(x.flip(3))) if flip else model(x)

  def evaluate() -> float:
    model.eval()
    correct = 0
    with torch.inference_mode():
      for i in range(0, len(test_y), 1000):
        x = normalize(test_x[i:i + 1000])
        logits = views(x, config.eval.flip_tta)
        if config.eval.translate_tta:  # half the image, a quarter each reflected shift down-right / up-left
          t = config.eval.translate_tta
          padded = torch.nn.functional.pad(x, (t,) * 4, mode='reflect')
          height, width = x.shape[2:]
          logits = 0.5 * logits + 0.25 * (views(padded[:, :, :height, :width], config.eval.flip_tta)
                                          + views(padded[:, :, 2 * t:, 2 * t:], config.eval.flip_tta))
        correct += int((logits.argmax(1) == test_y[i:i + 1000]).sum())
    model.train()
    return correct / len(test_y)

  curve, order, first_step = [], None, None
  for step in range(length.total_steps):
    epoch, position = divmod(step, length.steps_per_epoch)
    if position == 0:
      order = torch.randperm(len(train_y), generator=generator)
    rows = order[position * config.batch_size:(position + 1) * config.batch_size]
    mirror = first_flips[rows] ^ (epoch % 2 == 1) if config.augment.alternate_flip else None
    x = normalize(augment(torch, train_x[rows], generator, config.augment.crop_padding,
                          config.augment.crop_pad_mode, config.augment.flip, mirror))
    for group in optimizer.param_groups:
      group['lr'] = float(schedule(step)) * group['factor'] * (group['stop'] is None or step < group['stop'])
    loss = loss_fn(model(x), train_y[rows])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    updates = step + 1
    if slow is not None and (updates % opt.lookahead_every == 0 or updates == length.total_steps):
      keep = opt.lookahead_decay * (updates / length.total_steps) ** opt.lookahead_decay_power
      with torch.no_grad():  # the trained parameters, as flaxtpu's (airbench: BatchNorm statistics too)
        for slow_value, value in zip(slow, trained):
          slow_value.lerp_(value, 1 - keep)
          value.copy_(slow_value)
    if first_step is None:
      first_step = time.perf_counter() - start
    if step + 1 in eval_at:
      accuracy = evaluate()
      curve.append(dict(epoch=round((step + 1) / length.steps_per_epoch, 2), accuracy=accuracy,
                        seconds=round(time.perf_counter() - start, 1)))
      print(f'epoch {curve[-1]["epoch"]}: test accuracy {accuracy:.4f} at {curve[-1]["seconds"]} s',
            file=sys.stderr, flush=True)
  seconds = time.perf_counter() - start
  result = dict(peer=f'torch {torch.__version__} eager, {torch.get_num_threads()} threads',
                config=args.config, epochs=config.num_epochs, seed=args.seed,
                accuracy=curve[-1]['accuracy'], curve=curve,
                seconds=round(seconds, 1), first_step_seconds=round(first_step, 1),
                images_per_second=round(length.total_steps * config.batch_size / seconds, 1))
  print(json.dumps(result))
  if args.out:
    harness.write_results(args.out, result)


if __name__ == '__main__':
  main()
