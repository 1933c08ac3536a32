"""Config keys: every config key with its default and comment, the lengths and metric names that
follow from keys, and the errors that tell a user an input is wrong; no JAX.

- `errors`: `UserError` and its kinds (`ConfigError`, `CheckpointError`): the one line a failure
  prints.
- `defaults`: every config key with its default and comment; `derived` (a second config from a
  run's).
- `lengths`: epochs turned into steps, and the batch sizes that follow from the config.
- `metric_names`: the eval metrics a run watches (best checkpoint, early stopping), extra splits'
  names.
- `hub_names`: Hugging Face hub names as users write them, checked before anything is fetched.

Nothing is imported here: `import flaxtpu.settings.<module>` loads that module and what it imports,
no more.
"""
