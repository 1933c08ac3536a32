"""Where a chip case's step spends its time: flaxtpu's compiled train step traced, its ops ranked.

    python -m benchmarks.device.step_profile --case resnet50 [--override space_to_depth=true] [--steps 5]

Builds the step as `benchmarks/device/chip.py` does (configs/imagenet_resnet50.py with the case's model, the
batch already on the device), runs a few steps to warm up, traces `--steps` more with jax.profiler,
and prints the device time per kind of op (convolution fusions, loop fusions, copies, reductions ...),
the slowest ops with what XLA says of them, and how much of the wall time the device was busy. Not a
measurement for the docs' tables: it says which optimisation to try next. `--quick` is a smoke run.
"""

import argparse
import collections
import pathlib
import re
import tempfile
import time

from benchmarks.device import chip, profile_ops
from benchmarks.device.tpu import say


def parse_override(text: str):
  key, _, value = text.partition('=')
  lowered = value.lower()
  parsed = {'true': True, 'false': False}.get(lowered, value)
  if parsed is value:
    try:
      parsed = int(value)
    except ValueError:
      try:
        parsed = float(value)
      except ValueError:
        pass
  return key, parsed


# XLA:CPU's executor events around (or beside) the ops they run: not ops.
CPU_RUNTIME_EVENTS = ('ThunkExecutor', 'SlinkyThreadPool', 'end: ')


def op_kind(name: str, event_args: dict) -> str:
  """XLA's category for the op where the trace has one, else its name without the numbers."""
  for key in ('hlo_category', 'category'):
    if event_args.get(key):
      return str(event_args[key])
  return re.sub(r'[._-]?\d+$', '', name) or name


def device_op_events(events: list[dict]) -> tuple[list[dict], list[dict]]:
  """(the ops, the module runs) on the first device's threads: 'XLA Ops' and 'XLA Modules' on an
  accelerator, or XLA:CPU's thunk threads (no modules there)."""
  threads, processes = profile_ops.track_names(events)
  device_pids = sorted(pid for pid, name in processes.items() if name.startswith('/device:'))
  complete = [e for e in events if e.get('ph') == 'X' and 'dur' in e]
  if device_pids:
    pid = device_pids[0]
    on = lambda e, thread: e.get('pid') == pid and threads.get((pid, e.get('tid')), '') == thread
    ops = [e for e in complete if on(e, 'XLA Ops')]
    if ops:
      return ops, [e for e in complete if on(e, 'XLA Modules')]
  ops = [e for e in complete if profile_ops.is_device_thread(processes.get(e.get('pid'), ''),
                                                              threads.get((e.get('pid'), e.get('tid')), ''))
         and not e['name'].startswith(CPU_RUNTIME_EVENTS)]
  return ops, []


def _number(event_args: dict, key: str) -> float:
  try:
    return float(event_args.get(key, 0))
  except (TypeError, ValueError):
    return 0.0


def _rates(micros: float, flops: float, nbytes: float) -> str:
  """Achieved TFLOP/s and GB/s over `micros` of device time, and FLOPs per byte."""
  if not micros or not (flops or nbytes):
    return f'{"(no FLOPs or bytes in the trace)":38s}'
  intensity = f'{flops / nbytes:6.0f}' if nbytes else '     -'
  return f'{flops / micros / 1e6:6.1f} TF/s {nbytes / micros / 1e3:6.0f} GB/s {intensity} F/B'


def report(events: list[dict], steps: int, wall_seconds: float, top: int) -> None:
  """Device time by kind of op and the slowest ops, each with the FLOP/s and bytes/s it achieved (from
  XLA's `model_flops` and `bytes_accessed` where the trace has them): an op near the chip's memory
  bandwidth gains nothing from more FLOP/s, one near its peak FLOP/s nothing from fewer bytes."""
  ops, modules = device_op_events(events)
  if not ops:
    say('no device op events in the trace (this backend does not itemise its ops)')
    return
  own, flops, nbytes = collections.Counter(), collections.Counter(), collections.Counter()
  args_of = {}
  for event in ops:
    event_args = event.get('args') or {}
    args_of[event['name']] = event_args
    flops[event['name']] += _number(event_args, 'model_flops')
    nbytes[event['name']] += _number(event_args, 'bytes_accessed')
  for name, micros in profile_ops.self_times(ops):
    own[name] += micros
  total = sum(own.values())
  say(f'device ops: {total / 1e3:.1f} ms over {steps} steps = {total / 1e3 / steps:.2f} ms a step; '
      f'wall {1e3 * wall_seconds / steps:.2f} ms a step')
  train = [m for m in modules if 'step' in m['name']]
  if train:
    busy = sum(m['dur'] for m in train) / 1e3
    say(f'  {len(train)} module runs ({train[0]["name"][:60]}): {busy / len(train):.2f} ms each')
  kinds = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
  for name, micros in own.items():
    kind = kinds[op_kind(name, args_of.get(name, {}))]
    kind[0] += micros
    kind[1] += flops[name]
    kind[2] += nbytes[name]
    kind[3] += 1
  say('by kind of op: device time a step, share, achieved rates, distinct ops')
  for kind, (micros, kind_flops, kind_bytes, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:20]:
    rates = _rates(micros, kind_flops, kind_bytes)
    print(f'  {micros / 1e3 / steps:8.2f} ms {100 * micros / total:5.1f}%  {rates}  {count:4d}  {kind}')
  say(f'the {top} slowest ops: time a step, share, achieved rates, name, XLA\'s kind; its HLO')
  for name, micros in own.most_common(top):
    event_args = args_of.get(name, {})
    rates = _rates(micros, flops[name], nbytes[name])
    print(f'  {micros / 1e3 / steps:8.3f} ms {100 * micros / total:5.1f}%  {rates}  {name[:40]}  '
          f'{op_kind(name, event_args)}')
    if event_args.get('long_name'):
      print(f'        {str(event_args["long_name"])[:260]}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--case', default='resnet50', choices=sorted(chip.CASES))
  parser.add_argument('--override', action='append', default=[], type=parse_override,
                      help='config.model KEY=VALUE, e.g. space_to_depth=true (repeatable)')
  parser.add_argument('--remat', default=None, help='model.remat (default: the case\'s)')
  parser.add_argument('--batch', type=int, default=None, help='default: the chip benchmark\'s (256)')
  parser.add_argument('--steps', type=int, default=5, help='steps traced')
  parser.add_argument('--top', type=int, default=25)
  parser.add_argument('--trace-dir', type=pathlib.Path, default=None,
                      help='keep the trace here (default: a temporary folder)')
  parser.add_argument('--quick', action='store_true', help='tiny sizes (batch 8, 32 px): a smoke run')
  args = parser.parse_args()

  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  sizes = chip.QUICK if args.quick else chip.Sizes()
  if args.batch:
    sizes = dataclasses.replace(sizes, batch=args.batch)
  case = chip.CASES[args.case]
  case = dataclasses.replace(case, overrides=case.overrides + tuple(args.override))
  sizes = chip.case_sizes(case, sizes)
  config = chip.flaxtpu_config(case, sizes, args.remat)
  say(f'{case.title} {dict(case.overrides)} remat={config.model.remat}, batch {sizes.batch} at '
      f'{sizes.image_size} px on {jax.devices()[0].device_kind}')
  images, labels = flax_imagenet_resnet.random_batch(sizes.batch, sizes.image_size)
  started = time.perf_counter()
  entry = chip.build_flaxtpu(config, sizes, images, labels)
  plan = entry['memory_plan'].get('total_bytes')
  say(f'built in {time.perf_counter() - started:.1f} s (compile {entry["compile_seconds"]} s), '
      f'{entry["flops_per_step"] / 1e12:.2f} TFLOP a step, memory plan '
      f'{f"{plan / 2**30:.2f} GiB" if plan else "unknown"}')
  state = entry['state']
  for _ in range(3):
    state, metrics = entry['call'](state)
  jax.block_until_ready((state, metrics))
  trace_dir = args.trace_dir or pathlib.Path(tempfile.mkdtemp(prefix='step_profile_'))
  with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
    started = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = entry['call'](state)
    jax.block_until_ready((state, metrics))
    wall = time.perf_counter() - started
  peak = chip.tpu.PEAK_BF16_FLOPS.get(jax.devices()[0].device_kind)
  rate = args.steps * sizes.batch / wall
  mfu = f', MFU {100 * entry["flops_per_step"] * args.steps / wall / peak:.1f}%' if peak else ''
  say(f'traced {args.steps} steps: {rate:.0f} img/s{mfu}')
  report(profile_ops.load_events(str(trace_dir)), args.steps, wall, args.top)


if __name__ == '__main__':
  main()
