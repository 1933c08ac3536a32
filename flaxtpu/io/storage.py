"""Object stores (`gs://`, `s3://`) as workdirs and data: which paths are remote, and pointing every
library at a storage emulator from the one standard variable, STORAGE_EMULATOR_HOST.

Who reads and writes a `gs://` path in flaxtpu, and how each finds an emulator:

- checkpoint arrays and the lease: TensorStore's `gcs` kvstore (through orbax). TENSORSTORE_GCS_HTTP_URL,
  and a fixed token (GOOGLE_AUTH_TOKEN_FOR_TESTING) so it never asks the GCE metadata server for one.
- checkpoint directories, JSON, metrics, pictures, SavedModels, image folders, TFDS: `etils.epath`
  (orbax, TFDS and flaxtpu.io.files use it). EPATH_USE_TF=false: epath then uses fsspec's gcsfs, which
  reads STORAGE_EMULATOR_HOST itself; FSSPEC_GCS (no token, no cached listings);
  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
  (its bucket-type probe is a gRPC call to the real control plane).
- TFDS's ArrayRecord files: array_record's C++ reader, through google-cloud-cpp, which reads
  CLOUD_STORAGE_EMULATOR_ENDPOINT (without it, it waits on the real endpoints and the metadata server).
- TensorBoard events: TensorFlow's GCS filesystem (clu's SummaryWriter) cannot be pointed at an
  emulator: its endpoints are fixed (https://www.googleapis.com). flaxtpu.io.writers writes events to a
  local directory and copies them with epath.

Nothing here imports those libraries: `configure()` runs before any of them is used. Without
STORAGE_EMULATOR_HOST nothing is set and every library talks to the real store as it always does.
"""

from __future__ import annotations

import json
import os
import sys
from typing import MutableMapping

SCHEMES = ('gs://', 's3://')
EMULATOR_VARIABLE = 'STORAGE_EMULATOR_HOST'
# gcsfs on an emulator: no credentials, and no cached listings (TensorStore writes checkpoints behind
# gcsfs's back, and another process may be writing the bucket: a cached listing would miss their objects).
GCSFS_OPTIONS = {'token': 'anon', 'use_listings_cache': False}


def is_remote(path) -> bool:
  """Whether `path` names an object in a store (gs://, s3://) rather than a local file."""
  return isinstance(path, str) and path.startswith(SCHEMES)


def emulator_settings(environ: MutableMapping[str, str]) -> dict[str, str]:
  """The settings STORAGE_EMULATOR_HOST (HOST:PORT or a URL) stands for in each library; {} when unset."""
  host = environ.get(EMULATOR_VARIABLE, '').strip()
  if not host:
    return {}
  url = (host if '://' in host else f'http://{host}').rstrip('/')
  return {
      'TENSORSTORE_GCS_HTTP_URL': url,
      'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',
      'CLOUD_STORAGE_EMULATOR_ENDPOINT': url,
      'EPATH_USE_TF': 'false',
      'FSSPEC_GCS': json.dumps(GCSFS_OPTIONS),
      'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
  }


def configure(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
  """Maps STORAGE_EMULATOR_HOST onto every library's own settings (a value the user set wins);
  returns what it set. Idempotent; nothing happens without the variable."""
  environ = os.environ if environ is None else environ
  applied = {}
  for name, value in emulator_settings(environ).items():
    if name not in environ:
      environ[name] = applied[name] = value
  if applied and environ is os.environ and 'fsspec' in sys.modules:
    # fsspec reads FSSPEC_* variables once, when it is imported.
    conf = sys.modules['fsspec'].config.conf.setdefault('gcs', {})
    for key, value in json.loads(environ['FSSPEC_GCS']).items():
      conf.setdefault(key, value)
  return applied


def check_workdir_scheme(workdir: str) -> str | None:
  """Why `workdir` cannot hold a run, or None: s3:// checkpoints are not served by orbax's TensorStore
  layout (it opens them as local files), so an s3:// workdir is refused before anything is written."""
  if workdir.startswith('s3://'):
    return ('orbax writes checkpoint arrays to s3:// as if it were a local path; use a gs:// bucket or a '
            'local (or mounted) directory for --workdir')
  return None
