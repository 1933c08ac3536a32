"""Ready-made recipes: `python -m flaxtpu.main --config=configs/NAME.py`.

Each builds on `flaxtpu.defaults` (every key, its default and its meaning).
"""
