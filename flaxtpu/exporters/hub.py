"""`--config.export.hub_repo=ORG/NAME`: the exported timm folder and its card, uploaded to the Hugging
Face hub with huggingface_hub (create_repo, then upload_folder), after the export is in place.

The hub is asked first whether it can be reached at all, within seconds: with HF_HUB_OFFLINE set, or
no connection to the endpoint (HF_ENDPOINT, else huggingface.co) within CONNECT_SECONDS, nothing is
tried and one line says the folder is ready for `hf upload` later. Any failure raises UserError (a
non-zero exit); the export itself stays. A model with no timm twin (the Keras CNN) uploads the whole
export folder (SavedModel, TFLite, card) instead.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from typing import Optional

from flaxtpu.io import files
from flaxtpu.settings.errors import UserError

CONNECT_SECONDS = 3.0  # the reachability probe, DNS included
DEFAULT_ENDPOINT = 'https://huggingface.co'


def endpoint() -> str:
  """Where huggingface_hub sends requests: HF_ENDPOINT as set now (its constant is read at import)."""
  return (os.environ.get('HF_ENDPOINT') or DEFAULT_ENDPOINT).rstrip('/')


def _offline_reason(url: str) -> Optional[str]:
  """Why the hub at `url` cannot be reached now, or None; never takes much over CONNECT_SECONDS."""
  if os.environ.get('HF_HUB_OFFLINE', '').strip().lower() in ('1', 'on', 'yes', 'true'):
    return 'HF_HUB_OFFLINE is set'
  parsed = urllib.parse.urlparse(url)
  port = parsed.port or (443 if parsed.scheme == 'https' else 80)
  outcome: list[Optional[str]] = []

  def probe() -> None:  # in a thread: getaddrinfo has no timeout of its own
    try:
      socket.create_connection((parsed.hostname, port), timeout=CONNECT_SECONDS).close()
      outcome.append(None)
    except OSError as e:
      outcome.append(files.short_error(e))

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(CONNECT_SECONDS + 0.5)
  if not outcome:
    return f'no answer from {parsed.hostname}:{port} within {CONNECT_SECONDS:g} s'
  return None if outcome[0] is None else f'{parsed.hostname}:{port} cannot be reached ({outcome[0]})'


def upload(repo_id: str, export_dir: str, token: Optional[str] = None) -> str:
  """Uploads `export_dir`/timm (or `export_dir` for a model without it) to model repository `repo_id`
  -> the repository's URL. Raises UserError, the export untouched, when that fails."""
  folder = os.path.join(export_dir, 'timm')
  if not os.path.isdir(folder):
    folder = export_dir
  ready = f'the export in {export_dir} is kept and {folder} is ready for `hf upload {repo_id} {folder}`'
  url = endpoint()
  if (reason := _offline_reason(url)) is not None:
    raise UserError(f'config.export.hub_repo={repo_id}: the hub is offline ({reason}); {ready}')
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  api = huggingface_hub.HfApi(endpoint=url, token=token)
  try:
    repo = api.create_repo(repo_id, repo_type='model', exist_ok=True)
    api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type='model',
                      commit_message='flaxtpu --mode=export', ignore_patterns=['.*'])
  except Exception as e:  # pylint: disable=broad-except  # HTTP, auth, network: one line each
    hint = ('log in with `hf auth login` or set HF_TOKEN; ' if '401' in str(e) or '403' in str(e) else '')
    raise UserError(f'config.export.hub_repo={repo_id}: the upload to {url} failed '
                    f'({files.short_error(e)}); {hint}{ready}') from e
  return str(repo)
