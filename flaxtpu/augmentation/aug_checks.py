"""Config checks of issue 41's augmentation and loss keys (`augment.repeats`, augmix, colour
jitter, blur; `loss`, `bce_*`): registered in config.SECTION_CHECKS. No JAX at import."""

from __future__ import annotations

import ml_collections

from flaxtpu.settings.errors import ConfigError

LOSSES = ('softmax', 'bce')
MAX_AUGMIX_SEVERITY = 10


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first bad key."""
  augment = config.augment
  _check_repeats(config)
  if augment.policy == 'augmix':
    if not 1 <= augment.augmix_severity <= MAX_AUGMIX_SEVERITY:
      raise ConfigError(f'config.augment.augmix_severity={augment.augmix_severity!r} must be in '
                        f'[1, {MAX_AUGMIX_SEVERITY}] (timm: 3)')
    if augment.augmix_width < 1:
      raise ConfigError(f'config.augment.augmix_width={augment.augmix_width!r} must be >= 1 chains (timm: 3)')
    if augment.augmix_depth != -1 and augment.augmix_depth < 1:
      raise ConfigError(f'config.augment.augmix_depth={augment.augmix_depth!r} must be >= 1, or -1 for a '
                        'random depth in 1..3 (timm\'s default)')
    if augment.augmix_alpha <= 0:
      raise ConfigError(f'config.augment.augmix_alpha={augment.augmix_alpha!r} must be > 0 (timm: 1.0)')
  if augment.color_jitter < 0:
    raise ConfigError(f'config.augment.color_jitter={augment.color_jitter!r} must be >= 0 '
                      '(0 = off; timm: 0.4)')
  if not 0.0 <= augment.color_jitter_hue <= 0.5:
    raise ConfigError(f'config.augment.color_jitter_hue={augment.color_jitter_hue!r} must be in [0, 0.5]')
  for key in ('color_jitter_prob', 'blur'):
    if not 0.0 <= augment[key] <= 1.0:
      raise ConfigError(f'config.augment.{key}={augment[key]!r} must be a probability in [0, 1]')
  sigma = tuple(augment.blur_sigma)
  if len(sigma) != 2 or not 0 < sigma[0] <= sigma[1]:
    raise ConfigError(f'config.augment.blur_sigma={sigma!r} must be a (min, max) pair with 0 < min <= max '
                      '(torchvision: (0.1, 2.0))')
  if augment.blur_kernel < 3 or augment.blur_kernel % 2 == 0:
    raise ConfigError(f'config.augment.blur_kernel={augment.blur_kernel!r} must be odd and >= 3 (timm: 23)')
  _check_loss(config)


def _check_repeats(config: ml_collections.ConfigDict) -> None:
  repeats = config.augment.repeats
  if repeats < 1:
    raise ConfigError(f'config.augment.repeats={repeats!r} must be >= 1 (1 = off; DeiT: 3)')
  if repeats == 1:
    return
  if config.batch_size % repeats or config.batch_size // repeats < 2:
    raise ConfigError(f'config.batch_size={config.batch_size} must be a multiple of '
                      f'augment.repeats={repeats} with at least 2 distinct images per batch; change one')
  if config.dataset.get('sampling') == 'shards':
    raise ConfigError('config.augment.repeats works with dataset.sampling=shuffle or balanced, not shards '
                      '(each process streams its own shards); set --config.augment.repeats=1')
  if config.augment.alternate_flip:
    raise ConfigError('config.augment.alternate_flip mirrors every copy of an image alike, which defeats '
                      'augment.repeats; set --config.augment.alternate_flip=false')


def _check_loss(config: ml_collections.ConfigDict) -> None:
  if config.loss not in LOSSES:
    raise ConfigError(f'config.loss={config.loss!r} must be one of {", ".join(LOSSES)}')
  if config.loss == 'bce' and config.task == 'multilabel':
    raise ConfigError('config.loss=bce is for single-label training; task=multilabel already trains a '
                      'sigmoid per class: drop --config.loss')
  if not 0.0 <= config.bce_target_threshold < 1.0:
    raise ConfigError(f'config.bce_target_threshold={config.bce_target_threshold!r} must be in [0, 1) '
                      '(0 = off; timm\'s recipes: 0.2)')
