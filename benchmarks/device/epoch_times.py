"""How long each evaluation interval of a run took, from its log: does a long run end as fast as it began?

    python -m flaxtpu.main --config=configs/digits.py --workdir=/tmp/d --config.num_epochs=60 \
        --config.log_every_steps=100000 2>&1 | tee /tmp/d.log
    python -m benchmarks.device.epoch_times /tmp/d.log

Reads the timestamps of the `eval at step N` lines (evaluation is once an
epoch by default) and prints the seconds between consecutive ones: the first
and last few, their medians and the ratio of the last to the first. A loop
whose cost per step grows with the steps since the last log line shows a ratio
far above 1 (issue 69: digits 1.0 s -> 18.7 s an epoch over 60 epochs with
`log_every_steps=100000`); a flat loop, ~1.
"""

import argparse
import datetime
import json
import re
import statistics
import sys

# absl's prefix: I1207 19:12:49.706249 THREAD file.py:325] eval at step 44: ...
_EVAL_LINE = re.compile(r'^I(\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2}\.\d+) .*\] eval at step (\d+):')


def eval_times(lines) -> list[tuple[int, float]]:
  """(step, seconds since the first evaluation) of every `eval at step` line."""
  found = []
  for line in lines:
    match = _EVAL_LINE.match(line)
    if match:
      month, day, hour, minute, second, step = match.groups()
      moment = datetime.datetime(2000, int(month), int(day), int(hour), int(minute)) + datetime.timedelta(
          seconds=float(second))
      found.append((int(step), moment))
  if not found:
    return []
  start = found[0][1]
  return [(step, (moment - start).total_seconds()) for step, moment in found]


def summary(times: list[tuple[int, float]], edge: int = 5) -> dict:
  """The seconds between consecutive evaluations, the first and last `edge` of them and their medians."""
  intervals = [later - earlier for (_, earlier), (_, later) in zip(times, times[1:])]
  if len(intervals) < 2:
    return {'evaluations': len(times), 'intervals': intervals}
  first, last = intervals[:edge], intervals[-edge:]
  return {'evaluations': len(times), 'first_seconds': [round(x, 3) for x in first],
          'last_seconds': [round(x, 3) for x in last], 'median_first': round(statistics.median(first), 3),
          'median_last': round(statistics.median(last), 3),
          'last_over_first': round(statistics.median(last) / max(statistics.median(first), 1e-9), 2),
          'total_seconds': round(times[-1][1], 1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('log', nargs='?', default='-', help="a run's log (stderr); '-' reads stdin")
  args = parser.parse_args()
  lines = sys.stdin if args.log == '-' else open(args.log, errors='replace')
  print(json.dumps(summary(eval_times(lines))))


if __name__ == '__main__':
  main()
