"""The input side: dataset specs, source kinds, loading, sampling, caching and batches.

Light on purpose: `from flaxtpu.data import spec` imports no pipeline, numpy-heavy or JAX code.
`spec.py` resolves the dataset spec from the config; `sources/` holds one file per source kind
and the registry; `pipeline.py` loads a `Dataset`; `sampling.py`, `cache.py`, `loaders.py`,
`class_weights.py`, `predict_inputs.py`, `preprocess.py` and `workers.py` do the rest.

Also here: `audit.py`: the data audit's findings: duplicates, leaks, unreadable files, suspected
wrong labels (no JAX); `memory.py`: whether a run fits in host and device memory, checked before it
starts (no JAX).

`samplers.py` holds the samplers (the source kinds add theirs); `sampling.py` picks the one
`dataset.sampling` names and wraps it for `augment.repeats`.
"""
