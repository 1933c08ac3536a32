"""The Keras/TPU recipe's CNN (network: nets/cnn.py): `cnn`, the default model."""

from __future__ import annotations

from flaxtpu.models.family import Family, Spec


def _build(spec: Spec, *, num_classes, dtype, wrap, bn_axis_name):
  del spec, bn_axis_name
  from flaxtpu.models.nets import cnn  # pylint: disable=g-import-not-at-top
  return cnn.CNN(num_classes=num_classes, dtype=dtype, stage=wrap(cnn.ConvStage))


FAMILY = Family('cnn', {'cnn': Spec('cnn')}, _build,
                layers=lambda spec: [('stage1',), ('stage2',), ('Dense_0',)], title='CNN',
                input_kernel='params/stage1/Conv_0/kernel')
