"""The ops that take the time in a `profile_steps` trace: total duration per XLA op, top N.

    python -m flaxtpu.main --config=configs/cifar10_resnet.py --workdir=runs/prof \
        --config.num_train_steps=25 --config.profile_steps=5
    python -m benchmarks.device.profile_ops runs/prof/profile [--top 15]

Reads the Perfetto/Chrome trace (`*.trace.json.gz`) that jax.profiler wrote and
sums the self time (duration minus nested events) of every complete event on
XLA's op threads by name, so collectives, waits and the thunks that run
fusions and convolutions rank by the time they took across the traced steps.
Host-side Python and runtime events are listed apart.
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


def by_thread(events: list[dict]) -> dict:
  complete = collections.defaultdict(list)
  for event in events:
    if event.get('ph') == 'X' and 'dur' in event:
      complete[(event.get('pid'), event.get('tid'))].append(event)
  return complete


def self_times(events: list[dict]):
  """(name, duration minus the events nested inside it) for one thread: nothing is counted twice."""
  events = sorted(events, key=lambda e: (e['ts'], -e['dur']))
  stack: list[list] = []  # [name, end, self time]
  for event in events:
    while stack and event['ts'] >= stack[-1][1]:
      name, _, own = stack.pop()
      yield name, own
    if stack:
      stack[-1][2] -= event['dur']
    stack.append([event['name'], event['ts'] + event['dur'], event['dur']])
  for name, _, own in stack:
    yield name, own


def track_names(events: list[dict]) -> tuple[dict, dict]:
  """({(pid, tid): thread name}, {pid: process name}) from the trace's metadata events."""
  threads = {(e.get('pid'), e.get('tid')): e['args']['name'] for e in events
             if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  processes = {e.get('pid'): e['args']['name'] for e in events
               if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  return threads, processes


def is_device_thread(process: str, thread: str) -> bool:
  """XLA's op threads: the Eigen pool that runs XLA:CPU thunks, or an accelerator's device lines."""
  return 'XLAEigen' in thread or process.startswith('/device:')


def category(name: str) -> str:
  if name.startswith(('all-reduce', 'all-gather', 'reduce-scatter', 'collective', 'Rendezvous', 'Wait')):
    return 'collectives and waiting for the other devices'
  if name.startswith('ThunkExecutor'):
    return 'thunk execution (fusions, convolutions, dots: not itemised by XLA:CPU)'
  return 'other ops'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('profile_dir')
  parser.add_argument('--top', type=int, default=15)
  args = parser.parse_args()
  events = load_events(args.profile_dir)
  threads, processes = track_names(events)
  ops, host = collections.Counter(), collections.Counter()
  for (pid, tid), thread_events in by_thread(events).items():
    on_device = is_device_thread(processes.get(pid, ''), threads.get((pid, tid), ''))
    for name, micros in self_times(thread_events):
      (ops if on_device else host)[name] += micros
  overall = sum(ops.values())
  print(f'XLA op threads: {overall / 1e3:.1f} ms of thread time in all')
  by_category = collections.Counter()
  for name, micros in ops.items():
    by_category[category(name)] += micros
  for name, micros in by_category.most_common():
    print(f'  {micros / 1e3:10.1f} ms  {100 * micros / max(overall, 1):5.1f}%  {name}')
  print(f'top {args.top} ops:')
  for name, micros in ops.most_common(args.top):
    print(f'  {micros / 1e3:10.1f} ms  {100 * micros / max(overall, 1):5.1f}%  {name[:100]}')
  print(f'top {args.top // 2} host events:')
  for name, micros in host.most_common(args.top // 2):
    print(f'  {micros / 1e3:10.1f} ms  {name[:100]}')


if __name__ == '__main__':
  main()
