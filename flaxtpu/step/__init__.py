"""Train step: the train state on the devices: mesh and shardings, the pure compiled steps,
gradients, the ahead-of-time plan, BatchNorm recomputation.

- `parallel`: devices, the mesh, shardings and the batch-size check.
- `steps`: the train state (EMA included), the pure train and eval steps.
- `placing`: `Placement` (jit over a mesh or pmap), the train step compiled while the state is made.
- `gradients`: a step's gradient: one pass or SAM's two, under float16's loss scale.
- `compile_plan`: the step compiled ahead of time and its memory plan (`--mode=plan`).
- `bn_recompute`: BatchNorm statistics recomputed for averaged weights (update_bn).

Nothing is imported here: `import flaxtpu.step.<module>` loads that module and what it imports, no
more.
"""
