"""Ready-made recipes: `python -m flaxtpu.main --config=configs/NAME.py`."""
