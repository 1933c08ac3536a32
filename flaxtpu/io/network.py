"""Whether this machine can reach a host, asked before a library would retry for minutes."""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from typing import Optional

NETWORK_TIMEOUT_S = 5.0


def network_problem(address: tuple[str, int], timeout_s: float = NETWORK_TIMEOUT_S) -> Optional[str]:
  """None if `address` (or the HTTPS proxy) answers within `timeout_s`, else why not."""
  proxy = os.environ.get('HTTPS_PROXY') or os.environ.get('https_proxy')
  parsed = (urllib.parse.urlsplit(proxy if '://' in proxy else f'http://{proxy}') if proxy
            else None)
  host, port = (parsed.hostname, parsed.port or 3128) if parsed and parsed.hostname else address
  outcome: list[str] = []

  def connect() -> None:
    try:
      socket.create_connection((host, port), timeout=timeout_s).close()
      outcome.append('')
    except OSError as e:
      outcome.append(f'connecting to {host}:{port} failed: {e.strerror or e}')

  # A resolver without network can hang longer than the connect timeout: bound both.
  probe = threading.Thread(target=connect, daemon=True)
  probe.start()
  probe.join(2 * timeout_s)
  if not outcome:
    return f'no answer from {host}:{port} in {2 * timeout_s:.0f}s'
  return outcome[0] or None
