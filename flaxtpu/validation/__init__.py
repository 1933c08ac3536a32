"""Config validation: a config resolved, read back from a workdir and validated once, before JAX
starts; every package's checks are called from here.

- `config`: validation of every section, once (each package's own checks are called from here).
- `data_checks`, `training_checks`, `run_checks`: the sections' checks by concern: what a run reads;
  what is trained and how; devices, the loop, checkpoints, evaluation and outputs.
- `values`: the one-line value checks the sections share.
- `resolution`: what a config leaves open, filled in a fixed order before validation.
- `workdir_config`: the config a run trained with, read back over today's defaults (`from_saved`).
- `export_options`: the `config.export` checks (the export itself sits above the loop).

Nothing is imported here: `import flaxtpu.validation.<module>` loads that module and what it
imports, no more.
"""
