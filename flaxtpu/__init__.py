"""flaxtpu: train image classifiers with JAX and Flax on TPU, GPU or CPU."""

__version__ = '0.1.0'
