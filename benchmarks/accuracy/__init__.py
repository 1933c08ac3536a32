"""Accuracy recipes: flaxtpu's keys trained and scored beside a baseline or a peer (bfloat16, resolution,
few-shot probes, imbalance, multi-label, the label audit, imported weights):
`python -m benchmarks.accuracy.NAME`."""
