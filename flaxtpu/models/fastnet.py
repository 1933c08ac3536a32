"""The FastNet family (network: nets/fastnet.py): airbench's VGG-like shape, fastnet_s, fastnet and
fastnet_whiten, whose whitening stem a fresh run fits to the train images before step 1."""

from __future__ import annotations

import numpy as np

from flaxtpu.models.family import Family, Spec


def _build(spec: Spec, *, num_classes, dtype, wrap, bn_axis_name):
  from flaxtpu.models.nets import fastnet  # pylint: disable=g-import-not-at-top
  return fastnet.FastNet(num_classes=num_classes, stem_width=spec.widths[0], widths=spec.widths[1:],
                         block=wrap(fastnet.ConvBlock), dtype=dtype, bn_axis_name=bn_axis_name,
                         whiten=spec.whiten)


def _layers(spec: Spec) -> list[tuple[str, ...]]:
  """The stem, one layer per block, the head."""
  return [('stem', 'stem_bn'), *[(f'block{index}',) for index in range(1, len(spec.widths))], ('head',)]


def _smallest_image(spec: Spec) -> int:
  """Each block halves the side; the whitening stem's unpadded 2x2 kernel takes one pixel."""
  return 2 ** (len(spec.widths) - 1) + spec.whiten


def fit_whitening_stem(pixels: np.ndarray) -> dict[str, np.ndarray]:
  """The whitening stem's kernel, fitted to normalised train images [N, H, W, C]."""
  from flaxtpu.models.nets import fastnet  # pylint: disable=g-import-not-at-top
  return {'stem/kernel': fastnet.whitening_kernel(pixels)}


FAMILY = Family('fastnet', {
    'fastnet_s': Spec('fastnet', widths=(16, 16, 32, 64)),
    'fastnet': Spec('fastnet', widths=(24, 64, 256, 256)),
    'fastnet_whiten': Spec('fastnet', widths=(24, 64, 256, 256), whiten=True),
}, _build, _layers, title='FastNet', smallest_image=_smallest_image, input_kernel='params/stem/kernel',
    data_fit=lambda spec: fit_whitening_stem if spec.whiten else None)
