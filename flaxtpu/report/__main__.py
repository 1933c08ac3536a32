"""`python -m flaxtpu.report WORKDIR`: writes WORKDIR/curves.png and prints its path (no JAX started)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flaxtpu.io import storage
from flaxtpu.report import plots
from flaxtpu.settings.errors import UserError


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m flaxtpu.report WORKDIR`: writes WORKDIR/curves.png and prints its path; 2 on bad input."""
  parser = argparse.ArgumentParser(
      prog='python -m flaxtpu.report',
      description='Plot a live or finished run\'s curves from WORKDIR/metrics.jsonl into WORKDIR/curves.png.')
  parser.add_argument('workdir', help='the run\'s --workdir')
  args = parser.parse_args(argv)
  storage.configure()  # a gs:// workdir on an emulator: STORAGE_EMULATOR_HOST
  try:
    print(plots.write_curves(args.workdir))
  except UserError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
