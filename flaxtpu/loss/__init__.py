"""Loss functions: the per-example losses and accuracy the train and eval steps share.

- `losses`: the per-example loss and accuracy that train and eval steps share.
- `bce`: `loss=bce`: timm's binary cross-entropy for single-label training.

Nothing is imported here: `import flaxtpu.loss.<module>` loads that module and what it imports, no
more.
"""
