"""The `python -m flaxtpu.sweep` command line: check an experiment, then print, run or report its runs."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from flaxtpu import sweep
from flaxtpu.sweep import report, runner


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(
      prog='python -m flaxtpu.sweep', description=sweep.__doc__.split('\n\n')[0],
      epilog='Extra --config.KEY=VALUE arguments are passed to every run.')
  parser.add_argument('experiment', help='experiment file defining get_config() and get_sweep()')
  parser.add_argument('--workdir', required=True, help='sweep directory; each run goes to WORKDIR/<run name>')
  parser.add_argument('--parallel', type=int, default=1, help='runs at once (each is a full trainer process)')
  parser.add_argument('--dry-run', action='store_true', help='print the commands, one per line; run nothing')
  parser.add_argument('--report', action='store_true', help='only (re)write the results table and plots')
  # --config.* overrides are split off first: argparse would take them for abbreviations.
  config_args, other_args, index = [], [], 0
  while index < len(argv):
    arg = argv[index]
    if arg.startswith('--config.'):
      config_args.append(arg)
      if '=' not in arg and index + 1 < len(argv):
        config_args.append(argv[index + 1])
        index += 1
    else:
      other_args.append(arg)
    index += 1
  return parser.parse_args(other_args), config_args


def _raise_keyboard_interrupt(signal_number: int, frame: Any) -> None:
  raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
  """The `python -m flaxtpu.sweep` CLI; returns the exit status (0 only if every run finished)."""
  args, config_args = _parse_args(sys.argv[1:] if argv is None else argv)
  try:
    if args.parallel < 1:
      raise sweep.SweepError(f'--parallel={args.parallel}: must be at least 1')
    config, runs_overrides = runner.load_experiment(args.experiment)
    swept_keys = {key for overrides in runs_overrides for key in overrides}
    extra_overrides = runner.parse_extra_overrides(config, config_args, swept_keys)
    runs = runner.make_runs(args.experiment, args.workdir, runs_overrides, extra_overrides)
    if not args.dry_run and not args.report:
      runner.check_data_folders(config, runs_overrides, extra_overrides)
      runner.device_groups(args.parallel)  # refuses a --parallel the accelerators cannot split
  except sweep.SweepError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  except Exception as error:  # A bug in the experiment file: say so in one line, then show where.
    print(f'error: loading {args.experiment} failed: {type(error).__name__}: {error}', file=sys.stderr)
    traceback.print_exc()
    return 2

  if args.dry_run:
    for run in runs:
      print(shlex.join(run.command))
    return 0
  if args.report:
    report.write_report(args.experiment, args.workdir, runs, config)
    print(f'[sweep] wrote {os.path.join(args.workdir, "results.md")}, results.csv, {report.PLOTS_DIR}/',
          flush=True)
    return 0

  print(f'[sweep] {len(runs)} runs of {args.experiment} in {args.workdir}, {args.parallel} at a time',
        flush=True)
  # A scheduler or `kill` stopping the sweep gets the same clean stop as Ctrl-C.
  signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
  try:
    runner.run_sweep(args.experiment, args.workdir, runs, args.parallel, extra_overrides)
  except KeyboardInterrupt:
    print('[sweep] interrupted; run the same command again to resume', file=sys.stderr)
    report.write_report(args.experiment, args.workdir, runs, config)
    return 130
  rows = report.write_report(args.experiment, args.workdir, runs, config)
  print(f'[sweep] results: {os.path.join(args.workdir, "results.md")}', flush=True)
  best = rows[0] if rows and rows[0]['eval_accuracy'] is not None else None
  if best:
    print(f'[sweep] best: {best["run"]} eval_accuracy={best["eval_accuracy"]:.4f}', flush=True)
  failed = [run.name for run in runs if run.status != runner.DONE]
  if failed:
    print(f'error: {len(failed)} of {len(runs)} runs failed: {", ".join(failed)}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
