"""The Flax networks of the model families, one file per family; the plug-ins in flaxtpu/models/ import them
when a model is built (`models.create`), so that the registry needs no JAX."""
