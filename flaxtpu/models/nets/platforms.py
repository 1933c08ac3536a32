"""An operation's TPU form beside its plain one, chosen when the program is lowered (not by the machine
that traces it), so that a step compiled for a TPU from another machine (benchmarks/device/tpu_plan.py) gets
the TPU form too: the attention kernels of ViT and Swin, the ResNets' space-to-depth stem."""

import jax


def tpu_or_plain(tpu, plain, *args):
  """tpu(*args) in a program lowered for a TPU, plain(*args) for any other platform. An export (its
  batch symbolic: jax2tf's SavedModel, jax2onnx) always gets the plain form, which its converters read
  and which computes the same function."""
  if not isinstance(args[0].shape[0], int):
    return plain(*args)
  return jax.lax.platform_dependent(*args, tpu=tpu, default=plain)
