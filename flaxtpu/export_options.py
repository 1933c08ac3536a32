"""The config.export section's checks (config.py registers them): the quantized TFLite models' accuracy
margin and calibration size, the hub repository's form. Imports nothing heavy: config validation runs
before JAX or TensorFlow load."""

from __future__ import annotations

import re

import ml_collections

from flaxtpu.errors import ConfigError

QUANTIZED = ('fp16', 'int8')  # tflite_export's quantized models
HUB_REPO = re.compile(r'[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*')


def check_export(config: ml_collections.ConfigDict) -> None:
  export = config.export
  if not isinstance(export.onnx, bool):
    raise ConfigError(f'config.export.onnx={export.onnx!r} must be true or false (write model.onnx or not)')
  kinds = tuple(export.quantize)
  if (unknown := [kind for kind in kinds if kind not in QUANTIZED]) or len(set(kinds)) < len(kinds):
    reason = f'{unknown[0]!r} is not one' if unknown else 'one is repeated'
    raise ConfigError(f'config.export.quantize={export.quantize!r} names quantized TFLite models from '
                      f'{QUANTIZED}, each once ({reason}); () writes none')
  if not 0.0 <= export.int8_max_drop <= 1.0:
    raise ConfigError(f'config.export.int8_max_drop={export.int8_max_drop!r} is an accuracy drop in [0, 1] '
                      '(0.02 = 2 points)')
  if not (isinstance(export.calibration_images, int) and export.calibration_images > 0):
    raise ConfigError(f'config.export.calibration_images={export.calibration_images!r} must be > 0 '
                      '(a few hundred train images calibrate the int8 model)')
  if export.hub_repo and not HUB_REPO.fullmatch(export.hub_repo):
    raise ConfigError(f'config.export.hub_repo={export.hub_repo!r} must be ORG/NAME, a Hugging Face model '
                      'repository such as my-org/cifar10-resnet20')
