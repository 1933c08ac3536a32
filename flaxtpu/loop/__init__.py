"""Training loop: the loop and its helpers: progress, stop requests, early stopping, divergence, the
time budget, the start-of-run log, profiles, pruning.

- `train`: the loop: resume, log, evaluate, checkpoint, results.json.
- `progress`: the run's progress record and its clock.
- `signals`: SIGTERM and Ctrl-C as a request to stop at the next safe point.
- `early_stopping`: stopping when the watched metric stalls.
- `divergence`: a NaN/Inf loss: its first step and the one-line error.
- `time_budget`: a wall-clock budget that sets the run's length.
- `run_log`: what a run logs at its start.
- `profiling`: `profile_steps`: a few steps traced into WORKDIR/profile.
- `pruning`: a study's trial reporting each evaluation, stopped where the pruner says.

Nothing is imported here: `import flaxtpu.loop.<module>` loads that module and what it imports, no
more.
"""
