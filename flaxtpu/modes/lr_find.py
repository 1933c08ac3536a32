"""`--mode=lr_find`: an exponential learning-rate range test (Smith 2017; fastai's and Lightning's
`lr_find`) on the config's model, optimizer and data.

The rate grows from `lr_find.min_lr` to `lr_find.max_lr` geometrically over
`lr_find.steps` optimizer updates (the config's own schedule is replaced;
warmup included). After each step the train loss is smoothed exponentially
(bias-corrected); the test stops early once the smoothed loss exceeds
`diverge_factor` x its minimum or turns NaN. The suggested rate is where the
smoothed loss falls fastest against log(lr) ('steepest', searched between the
first tenth of the points and the minimum); `min/10` (the rate at the lowest
smoothed loss, over 10) is written beside it. Writes WORKDIR/lr_find.json and
WORKDIR/lr_find.png and nothing else: no checkpoint, config.json or metrics of
a run in the same workdir is read or touched.
"""

from __future__ import annotations

import logging
import math
import os

import jax
import ml_collections
import numpy as np

from flaxtpu.data import loaders, pipeline, sampling
from flaxtpu.io import files
from flaxtpu.report import plots
from flaxtpu.settings.lengths import run_length
from flaxtpu.step import parallel, placing, steps
from flaxtpu.transfer import finetune

RESULT, PICTURE = 'lr_find.json', 'lr_find.png'


def rates(min_lr: float, max_lr: float, count: int) -> np.ndarray:
  """The geometric sequence of `count` rates from min_lr to max_lr."""
  return min_lr * (max_lr / min_lr) ** (np.arange(count) / (count - 1))


def smoothed(losses, beta: float) -> np.ndarray:
  """fastai's bias-corrected exponential moving average of the losses."""
  average, out = 0.0, []
  for index, loss in enumerate(losses, 1):
    average = beta * average + (1 - beta) * loss
    out.append(average / (1 - beta ** index))
  return np.array(out)


def suggest(lrs: np.ndarray, losses: np.ndarray) -> dict:
  """{'steepest': the rate of the most negative slope of loss vs log10(lr) before the minimum,
  'min/10': the rate at the minimum / 10}."""
  lowest = int(np.argmin(losses))
  start = len(losses) // 10
  suggestions = {'min/10': float(lrs[lowest] / 10)}
  if lowest - start >= 2:
    slopes = np.gradient(losses[start:lowest + 1], np.log10(lrs[start:lowest + 1]))
    suggestions['steepest'] = float(lrs[start + int(np.argmin(slopes))])
  return suggestions


def lr_find(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs the range test; returns what lr_find.json holds."""
  settings = config.lr_find
  dataset = pipeline.load(config)
  mesh = parallel.make_mesh(config)
  parallel.log_mesh(mesh, config.parallelism)
  accumulate = config.optimizer.accumulate_steps
  total = settings.steps * accumulate
  length = run_length(config, sampling.examples_per_epoch(dataset, config.batch_size, jax.process_count()),
                      total_steps=total)
  lrs = rates(settings.min_lr, settings.max_lr, settings.steps)
  schedule = lambda update: settings.min_lr * (settings.max_lr / settings.min_lr) ** (
      jax.numpy.minimum(update, settings.steps - 1) / (settings.steps - 1))
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length,
                           class_weights=dataset.class_weights, schedule=schedule)
  placement = placing.place(task, mesh, config)
  state = placing.create_state(task, placement, config.seed)
  if config.init_from.checkpoint:
    state, _ = finetune.init_from(config, task, placement, state, dataset.class_names)
  losses, update_losses = [], []
  batches = loaders.train_batches(dataset, seed=config.seed, batch_size=config.batch_size, first_step=0,
                                  last_step=total, process_index=jax.process_index(),
                                  process_count=jax.process_count(),
                                  alternate_flip=config.augment.alternate_flip)
  stopped = 'reached max_lr'
  for step, batch in enumerate(batches, 1):
    state, step_metrics = placement.train_step(state, placement.put_train_batch(tuple(batch)[:2]))
    update_losses.append(float(placement.to_host_metrics(step_metrics).compute()['loss']))
    if step % accumulate:
      continue
    losses.append(float(np.mean(update_losses)))  # the loss of the batches of the update at lrs[i]
    update_losses = []
    curve = smoothed(losses, settings.smoothing)
    if not math.isfinite(curve[-1]):
      stopped, losses, curve = f'loss NaN/Inf at lr {lrs[len(losses) - 1]:.3g}', losses[:-1], curve[:-1]
      break
    if len(curve) > 1 and curve[-1] > settings.diverge_factor * curve.min():
      stopped = (f'smoothed loss over {settings.diverge_factor:g} x its minimum at lr '
                 f'{lrs[len(losses) - 1]:.3g}')
      break
  curve = smoothed(losses, settings.smoothing)
  tested = lrs[:len(curve)]
  suggestions = suggest(tested, curve) if len(curve) else {}
  rule = 'steepest' if 'steepest' in suggestions else 'min/10'
  result = {'rates': tested.tolist(), 'losses': losses, 'smoothed_losses': curve.tolist(),
            'suggested_lr': suggestions.get(rule), 'rule': rule, 'suggestions': suggestions,
            'stopped': stopped, 'optimizer': config.optimizer.name, 'model': config.model.name,
            'batch_size': config.batch_size, 'min_lr': settings.min_lr, 'max_lr': settings.max_lr,
            'steps': settings.steps, 'smoothing': settings.smoothing}
  if jax.process_index() == 0:
    files.makedirs(workdir)
    files.write_json(os.path.join(workdir, RESULT), result)
    _plot(result, os.path.join(workdir, PICTURE))
  suggested = f'{result["suggested_lr"]:.3g}' if result['suggested_lr'] else 'none'
  logging.info('lr_find: %d rates from %.3g (%s); suggested lr %s (%s; %s); %s and %s in %s', len(tested),
               settings.min_lr, stopped, suggested,
               rule, ', '.join(f'{k} {v:.3g}' for k, v in suggestions.items()), RESULT, PICTURE, workdir)
  return result


def _plot(result: dict, path: str) -> None:
  pyplot = plots._pyplot()  # pylint: disable=protected-access
  figure, axis = pyplot.subplots(figsize=(6, 4))
  axis.plot(result['rates'], result['losses'], color='0.75', linewidth=0.8, label='loss')
  axis.plot(result['rates'], result['smoothed_losses'], label='smoothed loss')
  for name, lr in result['suggestions'].items():
    axis.axvline(lr, linestyle='--' if name == result['rule'] else ':',
                 color='C1' if name == 'steepest' else 'C2',
                 label=f'{name}: {lr:.3g}{" (suggested)" if name == result["rule"] else ""}')
  axis.set_xscale('log')
  axis.set_xlabel('learning rate')
  axis.set_ylabel('train loss')
  axis.set_title(f'LR range test: {result["model"]}, {result["optimizer"]}, batch {result["batch_size"]}')
  finite = [v for v in result['smoothed_losses'] if math.isfinite(v)]
  if finite:
    axis.set_ylim(min(finite) * 0.95, min(max(finite), 4 * min(finite)) * 1.05)
  axis.legend(fontsize=8)
  figure.tight_layout()
  plots._save_figure(figure, path)  # pylint: disable=protected-access
