"""The input side: dataset specs, source kinds, loading, sampling, caching and batches.

Light on purpose: `from flaxtpu.data import spec` imports no pipeline, numpy-heavy or JAX code.
`spec.py` resolves the dataset spec from the config; `sources/` holds one file per source kind
and the registry; `pipeline.py` loads a `Dataset`; `sampling.py`, `cache.py`, `loaders.py`,
`class_weights.py`, `predict_inputs.py`, `preprocess.py` and `workers.py` do the rest.
"""
