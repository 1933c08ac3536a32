"""The one exception type that means "the user's input is wrong", and names fit for its one line."""

import re


class UserError(Exception):
  """Bad input. The message is one line naming the problem and the fix.

  `flaxtpu.main` prints it as `error: <message>` and exits non-zero without a
  traceback; any other exception is a bug and keeps its traceback.
  """


class ConfigError(UserError, ValueError):
  """A config value that cannot work; the message is one line that says why."""


class CheckpointError(UserError):
  """A checkpoint that is missing, incomplete, or from another model."""


def printable(text: str) -> str:
  """A file or class name fit for a one-line message: newlines, control characters and bytes
  that are not UTF-8 written as backslash escapes."""
  if text.isprintable():
    return text
  return ''.join(char if char.isprintable() else
                 # a byte that os.fsdecode kept
                 f'\\x{ord(char) - 0xdc00:02x}' if 0xdc80 <= ord(char) <= 0xdcff else
                 char.encode('unicode_escape').decode('ascii') for char in text)


def join_or(words: list[str], conjunction: str = 'or') -> str:
  """'a, b or c' (conjunction 'and': 'a, b and c'), for a message that lists choices."""
  return words[0] if len(words) == 1 else f'{", ".join(words[:-1])} {conjunction} {words[-1]}'


def first_line(error: BaseException) -> str:
  """'TypeName: the first line of its message' (a KeyError's argument, not its repr); a key that a
  locked ml_collections ConfigDict refuses is named with its did-you-mean."""
  text = str(error.args[0] if isinstance(error, KeyError) and error.args else error).strip()
  if locked := re.search(r'Key "(\w+)" does not exist and cannot be added', text):
    suggestion = re.search(r'Did you mean "(\w+)"', text)
    hint = f' (did you mean {suggestion.group(1)!r}?)' if suggestion else ''
    return f'sets config key {locked.group(1)!r}, which does not exist{hint}'
  return f'{type(error).__name__}: {printable(text.splitlines()[0])}' if text else type(error).__name__


def raised_in(path: str, error: BaseException) -> str:
  """'FILE, line N: TypeName: message' for an exception raised while a user's Python file ran: the
  file's own line that failed (also when the error comes from a library it called), its syntax error's
  line, else the innermost frame."""
  import os  # pylint: disable=g-import-not-at-top
  import traceback  # pylint: disable=g-import-not-at-top
  if isinstance(error, SyntaxError) and error.filename:
    return f'{error.filename}, line {error.lineno}: {type(error).__name__}: {error.msg}'
  frames = traceback.extract_tb(error.__traceback__)
  in_file = [frame for frame in frames if os.path.abspath(frame.filename) == os.path.abspath(path)]
  if not (in_file or frames):
    return f'{path}: {first_line(error)}'
  frame = (in_file or frames)[-1]
  return f'{frame.filename}, line {frame.lineno}: {first_line(error)}'
