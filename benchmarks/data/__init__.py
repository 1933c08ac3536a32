"""Generators of the image folders the benchmarks read: `python -m benchmarks.data.NAME`."""
