"""Side-by-side benchmarks of flaxtpu, one folder per concern (device, input, peers, accuracy, data; shared
code in shared/); run each from the repository root as `python -m benchmarks.FOLDER.NAME`."""
