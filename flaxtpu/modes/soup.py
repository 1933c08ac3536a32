"""The arrays side of `flaxtpu.average`: ingredients restored, averaged, BatchNorm recomputed, scored.

`average.py` owns the CLI, the checks that need no JAX and the files; this module runs after JAX
started. Uniform soup: the mean of every ingredient. Greedy soup (Wortsman et al. 2022, Algorithm 1):
ingredients sorted by held-out accuracy, best first; each joins only if the held-out accuracy of the
average (its BatchNorm statistics recomputed) does not drop.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from flaxtpu.data import pipeline
from flaxtpu.evaluation.evaluate import evaluate
from flaxtpu.modes.restore import restore
from flaxtpu.optimizers import optim
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size
from flaxtpu.step import bn_recompute, steps


def mean_state(states: Sequence[steps.ModelState]) -> steps.ModelState:
  """The elementwise mean of `states` (parameters and BatchNorm statistics), in float32."""
  return jax.tree.map(lambda *leaves: (sum(leaf.astype(jnp.float32) for leaf in leaves) / len(leaves))
                      .astype(leaves[0].dtype), *states)


def check_same_tree(first_run: str, first, run: str, state) -> None:
  """UserError naming the first array that `run`'s weights lack or shape otherwise than `first_run`'s."""
  shapes = [{optim.path_name(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(
      {'params': s.params, 'batch_stats': s.batch_stats})} for s in (first, state)]
  for name in sorted(set(shapes[0]) | set(shapes[1])):
    if shapes[0].get(name) != shapes[1].get(name):
      raise UserError(f'{run} has another parameter tree than {first_run} ({name}: {shapes[1].get(name)} vs '
                      f'{shapes[0].get(name)}); average runs of one model with the same options, fine-tuned '
                      'from one initialisation')


class Kitchen:
  """The ingredients on the devices, the train batches their averages' statistics come from, the held-out
  and eval splits they are scored on."""

  def __init__(self, configs: Sequence[ml_collections.ConfigDict], runs: Sequence[str],
               records: Sequence[dict], bn_batches: int, held_out_config: ml_collections.ConfigDict):
    config = configs[0]  # the first run's: its train batches, eval split and placement serve every average
    self.config, self.runs, self.bn_batches = config, list(runs), bn_batches
    placements, self.states = [], []
    for run_config, run in zip(configs, runs):  # each reads the step check_runs picked (eval.checkpoint)
      placement, state, _, _ = restore(run_config, run, calibrated=False)
      placements.append(placement)
      self.states.append(state)
    self.placement = placements[0]
    for run, state in zip(runs[1:], self.states[1:]):
      check_same_tree(runs[0], self.states[0], run, state)
    first = records[0]
    norm = first['normalization']
    self.task = steps.create_task(config, num_classes=first['num_classes'],
                                  image_shape=tuple(first['image_shape']), mean=norm['mean'], std=norm['std'])
    self.dataset = pipeline.load(config, class_names=first['class_names'])
    self.eval_set = self.dataset
    self.held_out = (self.dataset if held_out_config.dataset.eval_split == config.dataset.eval_split
                     else pipeline.load(held_out_config, need_train=False, class_names=first['class_names']))
    self.batch_size = resolved_eval_batch_size(config)

  def score(self, state, dataset) -> dict[str, float]:
    """Eval metrics of `state` on `dataset`'s eval split (every example once)."""
    return evaluate(self.placement, state, dataset, self.batch_size)[0]

  def average(self, indices: Sequence[int]) -> steps.ModelState:
    """The mean of the ingredients at `indices`, with BatchNorm statistics recomputed for it."""
    if len(indices) == 1:  # one ingredient is itself, statistics as trained
      return self.states[indices[0]]
    state = mean_state([self.states[index] for index in indices])
    batches = bn_recompute.train_batches(self.config, self.dataset, self.bn_batches)
    statistics = bn_recompute.recompute(self.task, self.placement, state.params, state.batch_stats, batches)
    return state.replace(batch_stats=statistics)

  def ingredients(self) -> list[dict[str, Any]]:
    """Each run with its held-out accuracy and loss."""
    tried = []
    for run, state in zip(self.runs, self.states):
      scores = self.score(state, self.held_out)
      tried.append({'run': run, 'held_out_accuracy': scores['eval_accuracy'],
                    'held_out_loss': scores['eval_loss']})
    return tried

  def uniform(self):
    """(chosen indices, state, held-out scores, ingredients): every run averaged."""
    tried = self.ingredients()
    chosen = list(range(len(self.runs)))
    state = self.average(chosen)
    return chosen, state, self.score(state, self.held_out), tried

  def greedy(self):
    """(chosen indices, state, held-out scores, ingredients): Wortsman et al.'s greedy soup. A tie keeps
    the ingredient (accuracy 'does not drop')."""
    tried = self.ingredients()
    order = sorted(range(len(self.runs)), key=lambda index: -tried[index]['held_out_accuracy'])
    chosen = [order[0]]
    state, best = self.states[order[0]], self.score(self.states[order[0]], self.held_out)
    for index in order[1:]:
      candidate = self.average(chosen + [index])
      scores = self.score(candidate, self.held_out)
      tried[index]['soup_accuracy_with_it'] = scores['eval_accuracy']
      if scores['eval_accuracy'] >= best['eval_accuracy']:
        chosen, state, best = chosen + [index], candidate, scores
      tried[index]['kept'] = index in chosen
    tried[order[0]]['kept'] = True
    return sorted(chosen), state, best, tried
