"""The Keras/TPU recipe's CNN (network: nets/cnn.py): `cnn`, the default model."""

from __future__ import annotations

from flaxtpu.models.family import Family, Spec


def _build(spec: Spec, *, num_classes, dtype, wrap, bn_axis_name):
  del spec, bn_axis_name
  from flaxtpu.models.nets import cnn  # pylint: disable=g-import-not-at-top
  return cnn.CNN(num_classes=num_classes, dtype=dtype, stage=wrap(cnn.ConvStage))


def _smallest_image(spec: Spec) -> int:
  """Unpadded 3x3, 2x2 pooling, unpadded 3x3: a side below 8 leaves no pixel to average (a NaN loss)."""
  del spec
  return 8


FAMILY = Family('cnn', {'cnn': Spec('cnn')}, _build,
                layers=lambda spec: [('stage1',), ('stage2',), ('Dense_0',)], title='CNN',
                smallest_image=_smallest_image, input_kernel='params/stage1/Conv_0/kernel')
