"""Saved weights: weights at rest: a run's orbax checkpoints, a saved run read without JAX, and
published weights (where they come from, which family they are); family knowledge stays in models/.

- `checkpoint`: orbax checkpoints: async saves, latest N + best, restore onto any mesh.
- `saved`: a saved run's checkpoint steps, best step and records, read without JAX.
- `pretrained`: published weights: where they come from, which family recognises them, how they want
  images prepared.

Nothing is imported here: `import flaxtpu.weights.<module>` loads that module and what it imports,
no more.
"""
