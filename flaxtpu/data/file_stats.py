"""Every file's 'path NUL size mtime' line, read in threads: what the decoded store keys a split by
(decoded_store.py).

Only the standard library: the store runs this file as a child process, `python -I -S
file_stats.py THREADS` with the paths NUL-separated on its stdin, so that its threads do not wait
for the GIL of a process that is importing JAX meanwhile.
"""

import concurrent.futures
import os
import sys

CHUNK = 512  # paths a thread stats at a time


def lines(paths: list[bytes], threads: int) -> bytes:
  """The lines of `paths`, in their order; an unreadable file's line differs from any readable one's
  (decoding then names it)."""
  chunks = [paths[start:start + CHUNK] for start in range(0, len(paths), CHUNK)]
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    return b''.join(pool.map(_lines, chunks))


def _lines(paths: list[bytes]) -> bytes:
  out = []
  for path in paths:
    try:
      stat = os.stat(path)
      out.append(b'%s\0%d %d\n' % (path, stat.st_size, stat.st_mtime_ns))
    except OSError as e:
      out.append(b'%s\0unreadable %d\n' % (path, e.errno))
  return b''.join(out)


if __name__ == '__main__':
  given = sys.stdin.buffer.read()
  sys.stdout.buffer.write(lines(given.split(b'\0') if given else [], int(sys.argv[1])))
