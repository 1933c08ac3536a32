"""The config.export section's checks (config.py registers them): the quantized TFLite models' accuracy
margin and calibration size, the hub repository's form. Imports nothing heavy: config validation runs
before JAX or TensorFlow load."""

from __future__ import annotations

import ml_collections

from flaxtpu.settings import hub_names
from flaxtpu.settings.errors import ConfigError, printable

QUANTIZED = ('fp16', 'int8')  # tflite_export's quantized models


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
  if export.hub_repo and (problem := hub_names.repo_problem(export.hub_repo)):
    raise ConfigError(f"config.export.hub_repo='{printable(export.hub_repo)}' is not a hub repository name: "
                      f'{problem}; give ORG/NAME, e.g. my-org/cifar10-resnet20')
