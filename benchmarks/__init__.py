"""Side-by-side benchmarks of flaxtpu; run each from the repository root as `python -m benchmarks.NAME`."""
