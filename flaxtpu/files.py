"""The files a run and a sweep leave behind: atomic JSON, metrics.jsonl rows, durations.

JAX-free: the sweep runner and the CLI use it before (or without) starting JAX.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping


def write_json(path: str, payload: Mapping[str, Any]) -> None:
  """Writes through a temporary file and a rename, so a reader (or a crash) never sees half a file."""
  temporary = f'{path}.tmp'
  with open(temporary, 'w', encoding='utf-8') as f:
    json.dump(payload, f, indent=2, sort_keys=True)
    f.write('\n')
  os.replace(temporary, path)


def read_json(path: str) -> dict[str, Any] | None:
  """The JSON object in `path`, or None when it is missing or unreadable (e.g. cut off by a crash)."""
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """Every complete JSON line of `path` ([] when missing); a line cut off mid-write is skipped."""
  rows = []
  try:
    with open(path, encoding='utf-8') as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except ValueError:
          continue
  except OSError:
    return []
  return rows


def truncate_jsonl(path: str, last_step: int) -> None:
  """Drops metrics rows after `last_step`: a resumed run rewrites them, as if never interrupted."""
  if not os.path.exists(path):
    return
  rows = [row for row in read_jsonl(path) if row.get('step', 0) <= last_step]
  with open(f'{path}.tmp', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
  os.replace(f'{path}.tmp', path)


def format_duration(seconds: float) -> str:
  """Seconds as H:MM:SS (whole seconds), e.g. 3725.4 -> '1:02:05'."""
  return str(datetime.timedelta(seconds=int(seconds)))
