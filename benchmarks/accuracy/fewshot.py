"""Few-shot probes of trained runs' features against the same backbones at their random initialisation.

    FLAXTPU_CIFAR10=/path/to/cifar10 python -m benchmarks.accuracy.fewshot --workdir runs/r20 [--workdir ...]
    # -> benchmarks/results/local/fewshot.json

For each `--workdir` (a finished flaxtpu run), restores its checkpoint
(`--checkpoint`, default best) and builds the same model from the run's seed
untrained, then runs `eval.fewshot`'s probes (`--shots`, default 1,5,10;
`--seeds` draws each) on both: a closed-form ridge regression on the frozen
features of K train images per class, scored on every image of the eval split
(`--data` or $FLAXTPU_CIFAR10 as the image folder; default: the run's own
data). Prints one row per (run, weights) and writes the JSON.
"""

import argparse
import os
import time

from benchmarks.shared import harness


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', action='append', required=True, help='a finished run (repeatable)')
  parser.add_argument('--checkpoint', default='best', help='latest | best | STEP')
  parser.add_argument('--shots', default='1,5,10')
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--data', default=os.environ.get('FLAXTPU_CIFAR10', ''),
                      help='the image folder (default: $FLAXTPU_CIFAR10, else the run\'s own data)')
  parser.add_argument('--eval-split', default='', help='the split scored (default: the run\'s)')
  harness.out_argument(parser, 'fewshot.json')
  args = parser.parse_args()
  harness.cpu_devices(8)
  # pylint: disable=g-import-not-at-top
  from flaxtpu.data import pipeline
  from flaxtpu.evaluation import fewshot
  from flaxtpu.modes import restore
  from flaxtpu.step import steps
  from flaxtpu.validation import workdir_config
  rows = []
  with harness.cpu_load() as load:
    for workdir in args.workdir:
      rows += _probe_run(workdir, args, pipeline, restore, fewshot, steps, workdir_config)
  harness.write_results(args.out, {'shots': args.shots, 'seeds': args.seeds, 'rows': rows, 'load': load})


def _probe_run(workdir, args, pipeline, restore, fewshot, steps, workdir_config) -> list[dict]:
  """The probe rows of one run: its trained weights, then the same model at its initialisation."""
  config = workdir_config.get_config(workdir)
  with config.unlocked():
    config.eval.checkpoint = args.checkpoint
    config.eval.fewshot.shots = tuple(int(k) for k in args.shots.split(','))
    config.eval.fewshot.seeds = args.seeds
    if args.data:
      config.dataset.folder = args.data
    if args.eval_split:
      config.dataset.eval_split = args.eval_split
  placement, trained, step, record = restore.restore(config, workdir)
  dataset = pipeline.load(config, class_names=record['class_names'])
  norm = record['normalization']
  task = steps.create_task(config, num_classes=record['num_classes'],
                           image_shape=tuple(record['image_shape']), mean=norm['mean'], std=norm['std'])
  probe = fewshot.Probe(config, dataset, task, placement)
  untrained = placement.from_saveable(steps.init_model(task, config.seed))
  rows = []
  for weights, state in (('trained', trained), ('random_init', untrained)):
    started = time.time()
    accuracies = probe(state)
    rows.append({'workdir': workdir, 'model': config.model.name, 'weights': weights,
                 'step': step if weights == 'trained' else 0, 'seconds': round(time.time() - started, 1),
                 **accuracies})
    print(' '.join(f'{key}={value}' for key, value in rows[-1].items()), flush=True)
  return rows


if __name__ == '__main__':
  main()
