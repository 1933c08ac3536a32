"""The one exception type that means "the user's input is wrong", and names fit for its one line."""


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
