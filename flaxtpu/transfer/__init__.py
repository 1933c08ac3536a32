"""Weight transfer: a run started from other weights: init_from (another run's or published),
distillation from a teacher.

- `finetune`: `init_from`: another run's or a published model's parameters and BatchNorm statistics.
- `distill`: knowledge distillation: a frozen teacher on the student's mesh.

Nothing is imported here: `import flaxtpu.transfer.<module>` loads that module and what it imports,
no more.
"""
