"""The ops that take the time in a `profile_steps` trace: total duration per XLA op, top N.

    python -m flaxtpu.main --config=configs/cifar10_resnet.py --workdir=runs/prof \
        --config.num_train_steps=25 --config.profile_steps=5
    python benchmarks/profile_ops.py runs/prof/profile [--top 15]

Reads the Perfetto/Chrome trace (`*.trace.json.gz`) that jax.profiler wrote and
sums the duration of every complete event on the XLA device threads by name,
so fusions, convolutions and collectives rank by the time they took across
the traced steps. Host-side Python and runtime events are listed apart.
"""

import argparse
import collections
import glob
import gzip
import json
import os


def load_events(profile_dir: str) -> list[dict]:
  traces = sorted(glob.glob(os.path.join(profile_dir, '**', '*.trace.json.gz'), recursive=True))
  if not traces:
    raise SystemExit(f'error: no *.trace.json.gz under {profile_dir}; train with --config.profile_steps=N')
  with gzip.open(traces[-1], 'rt', encoding='utf-8') as f:
    trace = json.load(f)
  return trace['traceEvents'] if isinstance(trace, dict) else trace


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('profile_dir')
  parser.add_argument('--top', type=int, default=15)
  args = parser.parse_args()
  events = load_events(args.profile_dir)
  thread_names = {(e.get('pid'), e.get('tid')): e['args']['name'] for e in events
                  if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  process_names = {e.get('pid'): e['args']['name'] for e in events
                   if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  device, host = collections.Counter(), collections.Counter()
  for event in events:
    if event.get('ph') != 'X' or 'dur' not in event:
      continue
    where = f'{process_names.get(event.get("pid"), "")} {thread_names.get((event.get("pid"), event.get("tid")), "")}'
    on_device = '/device:' in where or 'XLA Ops' in where or 'TFRT_CPU' in where.upper()
    (device if on_device else host)[event['name']] += event['dur']
  for title, totals in (('XLA ops (device threads)', device), ('host events', host)):
    overall = sum(totals.values())
    print(f'{title}: {overall / 1e3:.1f} ms in all')
    for name, micros in totals.most_common(args.top):
      print(f'  {micros / 1e3:10.1f} ms  {100 * micros / max(overall, 1):5.1f}%  {name[:100]}')


if __name__ == '__main__':
  main()
