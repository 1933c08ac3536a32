"""The one exception type that means "the user's input is wrong"."""


class UserError(Exception):
  """Bad input. The message is one line naming the problem and the fix.

  `flaxtpu.main` prints it as `error: <message>` and exits non-zero without a
  traceback; any other exception is a bug and keeps its traceback.
  """


class CheckpointError(UserError):
  """A checkpoint that is missing, incomplete, or from another model."""
