"""Optimizers and schedules: the optax chain a config describes, its wrappers, SAM, the float16 loss
scale, SWA, the plateau schedule and the parameter patterns.

- `optim`: the optax optimizer and learning-rate schedule, accumulation, per-layer rates.
- `optim_wrappers`: Lookahead and `freeze_after` around a whole chain.
- `optim_contrib`: optax.contrib's Muon and schedule-free optimizers.
- `optim_checks`: the checks of the optimizer, SAM, float16, time_budget and lr_find keys (no JAX).
- `param_patterns`: parameter regexes in the config (freeze, lr_multipliers, init_from.skip),
  checked.
- `plateau`: `schedule.name=plateau`'s host side: whether the learning rate drops.
- `sam`: sharpness-aware minimisation (SAM, ASAM).
- `loss_scale`: float16's dynamic loss scale, kept in the optimizer state.
- `swa`: stochastic weight averaging: the running mean in the train state, its checks, its view.

Nothing is imported here: `import flaxtpu.optimizers.<module>` loads that module and what it
imports, no more.
"""
