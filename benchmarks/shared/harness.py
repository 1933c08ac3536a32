"""What every benchmark shares: the repo root, CPU accounting, medians, timing, XLA's device count, results.

Benchmarks run from the repository root as `python -m benchmarks.FOLDER.NAME`, so `benchmarks`, `configs` and
`flaxtpu` import without touching sys.path. No JAX here: a benchmark sets XLA_FLAGS before it imports JAX.
"""

import contextlib
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Callable, Iterable

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The committed results in benchmarks/results/ are replaced only on purpose (copy them from here, or --out).
RESULTS = ROOT / 'benchmarks' / 'results' / 'local'


def median(values: Iterable, key: str = '') -> float:
  """The median of `values`, or with `key` of `row[key]` over the rows `values`."""
  return statistics.median(row[key] for row in values) if key else statistics.median(values)


def timings(call: Callable[[], object], repeats: int) -> list[float]:
  """Seconds of each of `repeats` calls of `call`, which must return only once its work is done."""
  seconds = []
  for _ in range(repeats):
    started = time.perf_counter()
    call()
    seconds.append(time.perf_counter() - started)
  return seconds


def train_step_ms(entry: dict, steps: int) -> None:
  """Times `steps` calls of `entry['step']` on `entry['state']`, `entry['batch']` after one warm call:
  appends the milliseconds per step to `entry['step_ms']` and keeps the state the steps reached."""
  import jax  # pylint: disable=g-import-not-at-top
  state = jax.block_until_ready(entry['step'](entry['state'], entry['batch'])[0])  # warm
  started = time.perf_counter()
  for _ in range(steps):
    state, _ = entry['step'](state, entry['batch'])
  jax.block_until_ready(state)
  entry['step_ms'].append(1000 * (time.perf_counter() - started) / steps)
  entry['state'] = state


def cpu_seconds() -> tuple[float, float]:
  """CPU seconds used so far by this process and every descendant, and by this process alone.

  A live descendant counts its own time; one that has ended counts in its parent's children_* times
  once it is waited for (grain workers, the CLI, a peer's subprocess): nothing is counted twice.
  """
  import psutil  # pylint: disable=g-import-not-at-top
  total = main = 0.0
  me = psutil.Process()
  for process in [me, *me.children(recursive=True)]:
    try:
      times = process.cpu_times()
    except psutil.Error:  # ended between the listing and the read
      continue
    used = (times.user + times.system
            + getattr(times, 'children_user', 0.0) + getattr(times, 'children_system', 0.0))
    total += used
    if process is me:
      main = times.user + times.system
  return total, main


def machine_busy_seconds() -> float:
  """CPU seconds every process on the machine has been busy since boot."""
  import psutil  # pylint: disable=g-import-not-at-top
  times = psutil.cpu_times()
  return sum(getattr(times, name, 0.0) for name in ('user', 'nice', 'system', 'irq', 'softirq'))


@contextlib.contextmanager
def cpu_load():
  """Measures the block: yields a dict that gets `seconds` (wall), `cpu_seconds` (ours, with every
  descendant), `main_process_cpu_seconds` and `other_cpu_load`: the cores other processes kept busy
  meanwhile. On a shared machine, well above 0 means a pessimistic number."""
  load = {}
  (cpu, main), busy, started = cpu_seconds(), machine_busy_seconds(), time.perf_counter()
  yield load
  seconds = time.perf_counter() - started
  (cpu_end, main_end), busy_end = cpu_seconds(), machine_busy_seconds()
  load.update(seconds=seconds, cpu_seconds=cpu_end - cpu, main_process_cpu_seconds=main_end - main,
              other_cpu_load=max(0.0, (busy_end - busy - (cpu_end - cpu)) / max(seconds, 1e-9)))


def cpu_devices(count: int) -> None:
  """Makes XLA show `count` CPU devices to this process; call before JAX is imported."""
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                             + f' --xla_force_host_platform_device_count={count}')


def subprocess_env(devices: int = 0) -> dict:
  """This environment for a child process without our XLA_FLAGS (with `devices` CPU devices if given)."""
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  if devices:
    env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  return env


def out_argument(parser, filename: str) -> None:
  """`--out FILE`, by default benchmarks/results/local/FILENAME."""
  parser.add_argument('--out', type=pathlib.Path, default=RESULTS / filename, help='JSON results file')


def write_results(out, payload) -> pathlib.Path:
  """Writes `payload` as JSON to the file `out` (making its folder) and says where."""
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(payload, indent=2) + '\n', encoding='utf-8')
  print(f'wrote {out}', file=sys.stderr, flush=True)  # stdout keeps the measurements alone
  return out
