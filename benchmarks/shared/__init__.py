"""What the benchmarks share: `harness` (the repo root, the results folder, JSON, medians, timing, CPU
accounting) and `peers` (the peers' CPU models and their timed steps: Keras on TensorFlow and JAX,
PyTorch)."""
