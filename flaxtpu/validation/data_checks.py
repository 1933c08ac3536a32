"""The checks of what a run reads: the dataset's source and splits, how its images are read and
normalised, the input workers, the augmentation; and `check_against_data`, what needs the images
themselves. No JAX at import."""

from __future__ import annotations

import math

import ml_collections

from flaxtpu import models  # no JAX at import
from flaxtpu.augmentation import image_sizes  # no JAX at import
from flaxtpu.settings.errors import ConfigError
from flaxtpu.settings.metric_names import check_eval_split_names
from flaxtpu.validation.values import one_of, positive, within

POLICIES = ('', 'randaugment', 'trivialaugment', 'autoaugment', 'augmix')  # augment.policy ('' = none)
ERASE_MODES = ('pixel', 'rand', 'const')  # augment.erase_mode, timm's --remode
NORMALIZATIONS = ('auto', 'unit', 'standardize', 'fixed')


def check_against_data(config: ml_collections.ConfigDict, image_shape: tuple[int, ...],
                       num_classes: int) -> None:
  """Raises ConfigError for a key that cannot work with these images (H, W, C) and classes."""
  del num_classes  # no key depends on the class count yet; the label-file sources will check theirs here
  models.check_image_shape(config.model.name, image_shape, config.model.patch_size)
  image_sizes.check_against_data(config, image_shape)
  if config.eval.translate_tta >= min(image_shape[:2]):
    raise ConfigError(f'config.eval.translate_tta={config.eval.translate_tta} must be smaller than the '
                      f'{image_shape[0]}x{image_shape[1]} images (airbench uses 1)')
  channels, given = image_shape[-1], len(config.dataset.mean)
  # The pipeline averages an RGB model's three numbers for 1-channel images (spec.fixed_normalization).
  if config.dataset.normalize == 'fixed' and given != channels and (channels, given) != (1, 3):
    raise ConfigError(f'config.dataset.mean/std have {given} channels but the images have {channels}; '
                      'give one value per channel')


def check_dataset_source(config: ml_collections.ConfigDict) -> None:
  """Where the examples come from: a source, its splits, sampling, class weights (not in DATALESS_MODES)."""
  # The source kinds own their keys and checks (flaxtpu/data/sources/); imported here, not at the
  # top, so that a config module without a dataset to check stays light.
  from flaxtpu.data import sampling, sources  # pylint: disable=g-import-not-at-top
  dataset = config.dataset
  if not (dataset.folder or dataset.name or sources.named(dataset)):
    raise ConfigError('config.dataset.folder and config.dataset.name are both empty; set '
                      '--config.dataset.folder=/path/to/images (or a TFDS name, e.g. cifar10, or '
                      f'dataset.{sources.named_keys_text()})')
  if isinstance(dataset.eval_splits, str) or not all(
      isinstance(split, str) and split for split in dataset.eval_splits):
    raise ConfigError(f'config.dataset.eval_splits={dataset.eval_splits!r} must be a tuple of split '
                      "names, e.g. --config.dataset.eval_splits=\"('train[:5000]',)\"")
  check_eval_split_names(dataset.eval_split, dataset.eval_splits)
  sources.check_selection(dataset)
  one_of('dataset.sampling', dataset.sampling, sampling.names())
  sources.check(config)
  if not dataset.class_weights:
    raise ConfigError("config.dataset.class_weights='' is not valid; choose none, balanced or a CSV/JSON "
                      'file of class,weight')


def check_dataset(config: ml_collections.ConfigDict) -> None:
  """How the images are read: size, crop, cache, normalisation."""
  dataset = config.dataset
  if dataset.image_size < 0:
    raise ConfigError(f'config.dataset.image_size={dataset.image_size} must be >= 0 (0 = native size)')
  if not 0.0 <= dataset.crop_fraction <= 1.0:
    raise ConfigError(f'config.dataset.crop_fraction={dataset.crop_fraction!r} must be in (0, 1] '
                      '(0 = the init_from source\'s, else 0.875)')
  one_of('dataset.cache', dataset.cache, ('auto', 'memory', 'none'))
  if '://' in dataset.decoded_cache_dir:
    raise ConfigError(f'config.dataset.decoded_cache_dir={dataset.decoded_cache_dir!r} must be a local '
                      "folder (decoded images are read back at disk speed); '' = ~/.cache/flaxtpu/decoded, "
                      'none = off')
  one_of('dataset.normalize', dataset.normalize, NORMALIZATIONS)
  if dataset.normalize == 'fixed' and not (
      len(dataset.mean) == len(dataset.std) > 0 and min(dataset.std) > 0):
    raise ConfigError(f'config.dataset.normalize=fixed needs dataset.mean and dataset.std, one positive '
                      f'std per channel (got mean={tuple(dataset.mean)}, std={tuple(dataset.std)}); e.g. '
                      "--config.dataset.mean='(0.485, 0.456, 0.406)' "
                      "--config.dataset.std='(0.229, 0.224, 0.225)'")


def check_input(config: ml_collections.ConfigDict) -> None:
  if config.input.workers < -1:
    raise ConfigError(f'config.input.workers={config.input.workers} must be >= 0 (or -1 = auto)')
  positive('input.prefetch', config.input.prefetch)


def check_augment(config: ml_collections.ConfigDict) -> None:
  augment = config.augment
  for key, low, high in (('crop_area', 0.0, 1.0), ('crop_aspect', 0.0, math.inf), ('erase_area', 0.0, 1.0),
                         ('erase_aspect', 0.0, math.inf)):
    value = tuple(augment[key])
    if len(value) != 2 or not low < value[0] <= value[1] <= high:
      raise ConfigError(f'config.augment.{key}={value!r} must be a (min, max) pair with '
                        f'{low} < min <= max <= {high}')
  within('augment', augment, ('crop_padding', 'cutout'), '>= 0')
  one_of('augment.crop_pad_mode', augment.crop_pad_mode, ('zeros', 'reflect', 'edge'))
  if augment.alternate_flip and not augment.flip:
    raise ConfigError('config.augment.alternate_flip=True alternates the flip, which is off; set '
                      '--config.augment.flip=true as well (or alternate_flip=false)')
  one_of('augment.policy', augment.policy, POLICIES)
  if augment.policy == 'randaugment':
    positive('augment.randaugment_layers', augment.randaugment_layers)
    if not 0.0 <= augment.randaugment_magnitude <= 30.0:
      raise ConfigError(f'config.augment.randaugment_magnitude={augment.randaugment_magnitude!r} must be '
                        'in [0, 30] (9-10 is the usual strength)')
  _check_erase(augment)
  for key in ('mixup_alpha', 'cutmix_alpha'):
    if augment[key] < 0:
      raise ConfigError(f'config.augment.{key}={augment[key]!r} must be >= 0 (0 = off)')
  for key in ('mix_prob', 'mix_switch_prob'):
    if not 0.0 <= augment[key] <= 1.0:
      raise ConfigError(f'config.augment.{key}={augment[key]!r} must be a probability in [0, 1]')
  if (augment.mixup_alpha or augment.cutmix_alpha) and config.batch_size % 2:
    raise ConfigError(f'config.batch_size={config.batch_size} must be even with mixup/CutMix (examples are '
                      'mixed in pairs); use an even batch size')


def _check_erase(augment: ml_collections.ConfigDict) -> None:
  """Random erasing: a probability, a mode, a box count; its other keys only matter when it is on."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  if not 0.0 <= augment.erase_prob <= 1.0:
    raise ConfigError(f'config.augment.erase_prob={augment.erase_prob!r} must be a probability in [0, 1] '
                      '(0 = off; timm uses 0.25)')
  one_of('augment.erase_mode', augment.erase_mode, ERASE_MODES)
  positive('augment.erase_count', augment.erase_count)
  default = defaults.get_config().augment
  for key in ('erase_mode', 'erase_count', 'erase_area', 'erase_aspect'):
    if not augment.erase_prob and augment[key] != default[key]:
      raise ConfigError(f'config.augment.{key}={augment[key]!r} has no effect while random erasing is off; '
                        'set --config.augment.erase_prob (e.g. 0.25) or leave it at '
                        f'{default[key]!r}')
