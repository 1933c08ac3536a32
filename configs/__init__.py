"""Ready-made recipes: `python -m flaxtpu.main --config=configs/NAME.py`.

Each builds on `flaxtpu.settings.defaults` (every key, its default and its meaning).
"""
