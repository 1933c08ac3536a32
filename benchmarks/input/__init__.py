"""The input pipeline: flaxtpu's streaming and in-memory input beside tf.data, its memory, tar shards, and the
host probes that split an accelerator host's input time: `python -m benchmarks.input.NAME`."""
