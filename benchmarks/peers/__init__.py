"""The peers' own programs: flaxtpu's recipes ported to Keras and PyTorch, and the Flax ImageNet example's
ResNet-50, each run as its authors would: `python -m benchmarks.peers.NAME`."""
