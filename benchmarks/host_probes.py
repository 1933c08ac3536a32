"""Two probes of an accelerator host's costs that the rows of `benchmarks/tpu.py` only show summed.

    python -m benchmarks.host_probes pages   # a fresh 38 MiB batch array against a reused one
    python -m benchmarks.host_probes gil     # whether starting the devices holds Python's GIL

`pages`: filling a new array the size of a batch (256 crops of 224 px) against refilling one
already touched, before and after `workers.keep_freed_memory`. Under gVisor (Cloud TPU hosts) every
first touch of a page is a costly fault; on a TPU v5e host 42.9 ms against 3.3 ms (docs/performance.md).

`gil`: a thread ticks every 5 ms while the main thread starts JAX's devices; its longest gap is how
long it could not run. On a TPU v5e host one gap of 4.4 s in a 6.1 s start: nothing in Python runs
beside the TPU runtime's start, which bounds the time to a first step.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

BATCH_SHAPE = (256, 224, 224, 3)


def median_ms(function, repeats: int = 20) -> float:
  seconds = []
  for _ in range(repeats):
    started = time.perf_counter()
    function()
    seconds.append(time.perf_counter() - started)
  return 1e3 * statistics.median(seconds)


def pages() -> dict:
  from flaxtpu.data import workers  # pylint: disable=g-import-not-at-top
  source = np.random.default_rng(0).integers(0, 256, BATCH_SHAPE, dtype=np.uint8)
  reused = np.empty_like(source)
  result = {'fresh_ms': median_ms(lambda: np.array(source)),
            'reused_ms': median_ms(lambda: np.copyto(reused, source))}
  workers.keep_freed_memory(source.nbytes)
  result['fresh_after_keep_freed_memory_ms'] = median_ms(lambda: np.array(source))
  return result


def gil() -> dict:
  ticks, done = [], threading.Event()

  def tick() -> None:
    while not done.is_set():
      ticks.append(time.perf_counter())
      time.sleep(0.005)
  started = time.perf_counter()
  import jax  # pylint: disable=g-import-not-at-top
  imported = time.perf_counter()
  threading.Thread(target=tick, daemon=True).start()
  devices = jax.devices()
  ready = time.perf_counter()
  done.set()
  gaps = sorted((later - earlier for earlier, later in zip(ticks, ticks[1:])), reverse=True)
  return {'device': f'{devices[0].device_kind} x{len(devices)}', 'import_jax_s': imported - started,
          'devices_s': ready - imported, 'longest_gaps_s': gaps[:3],
          'stalled_s': sum(gap for gap in gaps if gap > 0.1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('probe', choices=('pages', 'gil'))
  args = parser.parse_args()
  result = pages() if args.probe == 'pages' else gil()
  for key, value in result.items():
    print(f'{key}: {[round(v, 3) for v in value] if isinstance(value, list) else value}')


if __name__ == '__main__':
  main()
