"""The train step (and predict) on a device, flaxtpu's beside its peers': a TPU chip or host, the CPU;
compile, memory plans, start-up and checkpoints: `python -m benchmarks.device.NAME`."""
