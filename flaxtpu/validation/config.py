"""Validate a config before any work starts.

Every check raises `ConfigError` with one line: the key, the bad value, and
what is allowed. This module must not import JAX (the CLI validates before
JAX starts, so that a typo never costs a compile).
"""

from __future__ import annotations

import difflib
import math
from typing import Sequence

import ml_collections

from flaxtpu import models  # no JAX at import
from flaxtpu.augmentation import (  # no JAX at import
  aug_checks,
  image_sizes,
)
from flaxtpu.data import audit  # no JAX at import
from flaxtpu.io import (  # no JAX at import
  files,
  tracking,
)
from flaxtpu.optimizers import (  # no JAX at import
  optim_checks,
  swa,
)
from flaxtpu.optimizers.param_patterns import check_patterns, parse_freeze_after, parse_lr_multipliers
from flaxtpu.report import calibration  # no JAX at import
from flaxtpu.settings import hub_names  # no JAX at import
from flaxtpu.settings.errors import ConfigError
from flaxtpu.settings.metric_names import check_eval_split_names, early_stopping_metric
from flaxtpu.validation.export_options import check_export as _check_export

# The optimizer.* keys each optimizer reads, besides those all of them do (learning rate, weight
# decay, clipping, accumulation, freezing, lr multipliers, layer decay, Lookahead).
OPTIMIZER_KEYS = {
    'sgd': ('momentum', 'nesterov'),
    'adam': ('b1', 'b2', 'eps'),
    'adamw': ('b1', 'b2', 'eps'),
    'lamb': ('b1', 'b2', 'eps'),
    'lars': ('momentum', 'nesterov', 'trust_coefficient'),
    'lion': ('b1', 'b2'),
    'adafactor': ('decay_rate', 'factored', 'min_dim_size_to_factor', 'clipping_threshold',
                  'multiply_by_parameter_scale'),
    'rmsprop': ('decay', 'centered', 'eps', 'momentum', 'nesterov'),
    'muon': ('momentum', 'nesterov', 'b1', 'b2', 'eps', 'muon_adam_lr'),  # b1, b2: its AdamW's
    'schedule_free_adamw': ('b1', 'b2', 'eps'), 'schedule_free_sgd': ('b1',),
}
OPTIMIZERS = tuple(OPTIMIZER_KEYS)
# The schedule.* keys each schedule reads besides warmup_epochs.
SCHEDULE_KEYS = {
    'constant': (),
    'cosine': ('final_lr_fraction',),
    'linear': ('final_lr_fraction',),
    'onecycle': (),
    'step': ('milestones', 'factor'),
    'exponential': ('decay_rate', 'final_lr_fraction'),
    'rsqrt': ('timescale', 'cooldown_epochs'),
    'plateau': ('factor', 'final_lr_fraction', 'plateau_patience', 'plateau_metric', 'plateau_cooldown'),
}
SCHEDULES = tuple(SCHEDULE_KEYS)
POLICIES = ('', 'randaugment', 'trivialaugment', 'autoaugment', 'augmix')  # augment.policy ('' = none)
ERASE_MODES = ('pixel', 'rand', 'const')  # augment.erase_mode, timm's --remode
REMAT_POLICIES = ('none', 'full', 'nothing_saveable', 'everything_saveable',
                  'dots_saveable', 'dots_with_no_batch_dims_saveable', 'auto')
DTYPES = ('float32', 'bfloat16', 'float16')
PARALLELISMS = ('jit', 'pmap')
PLATFORMS = ('', 'cpu', 'gpu', 'tpu')
# config.cpu_convolutions -> the XLA flag that selects it (set by main before JAX starts). XLA:CPU (jaxlib
# >= 0.9) runs convolutions through YNNPACK by default; without it, Eigen's kernels (2 cores, median images/s
# of a bare train step: FastNet at batch 1024 132 against 97, the Keras CNN 1,975 against 1,604, ResNet-20
# 172 against 182).
YNN_FUSION_FLAG = '--xla_cpu_experimental_ynn_fusion_type'
CPU_CONVOLUTION_FLAGS = {'xla': '', 'eigen': f'{YNN_FUSION_FLAG}=-individual_convolution'}
NORMALIZATIONS = ('auto', 'unit', 'standardize', 'fixed')
TASKS = ('multiclass', 'multilabel')


def _one_of(key: str, value, allowed) -> None:
  if value not in allowed:
    shown = ', '.join(repr(a) for a in allowed)
    raise ConfigError(f'config.{key}={value!r} is not valid; choose one of: {shown}')


def _positive(key: str, value, allow: tuple = ()) -> None:
  if value not in allow and not value > 0:
    extra = ' (or ' + ', '.join(map(str, allow)) + ')' if allow else ''
    raise ConfigError(f'config.{key}={value!r} must be > 0{extra}')


def _within(group: str, node, keys: tuple, interval: str) -> None:
  """Each of config.`group`'s `keys` in `interval`: '>= 0', '[0, 1)' or '[0, 1]'."""
  inside = {'>= 0': lambda value: value >= 0, '[0, 1)': lambda value: 0.0 <= value < 1.0,
            '[0, 1]': lambda value: 0.0 <= value <= 1.0}[interval]
  for key in keys:
    if not inside(node[key]):
      raise ConfigError(f'config.{group}.{key}={node[key]!r} must '
                        + (f'be {interval}' if interval.startswith('>') else f'be in {interval}'))


# Modes that read no dataset (predict reads predict.input): their dataset source is not checked, so a
# recipe's training folder (or none) is not asked for.
DATALESS_MODES = ('predict',)


def validate(config: ml_collections.ConfigDict, mode: str = 'train') -> None:
  """Raises ConfigError naming the first key whose value cannot work for `mode`.

  One check per section of `defaults.py`, in its order; what needs the data
  (image shape, classes) is `check_against_data`.
  """
  for check in SECTION_CHECKS:
    if not (check is _check_dataset_source and mode in DATALESS_MODES):
      check(config)


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


def _check_dataset_source(config: ml_collections.ConfigDict) -> None:
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
  _one_of('dataset.sampling', dataset.sampling, sampling.names())
  sources.check(config)
  if not dataset.class_weights:
    raise ConfigError("config.dataset.class_weights='' is not valid; choose none, balanced or a CSV/JSON "
                      'file of class,weight')


def _check_dataset(config: ml_collections.ConfigDict) -> None:
  """How the images are read: size, crop, cache, normalisation."""
  dataset = config.dataset
  if dataset.image_size < 0:
    raise ConfigError(f'config.dataset.image_size={dataset.image_size} must be >= 0 (0 = native size)')
  if not 0.0 <= dataset.crop_fraction <= 1.0:
    raise ConfigError(f'config.dataset.crop_fraction={dataset.crop_fraction!r} must be in (0, 1] '
                      '(0 = the init_from source\'s, else 0.875)')
  _one_of('dataset.cache', dataset.cache, ('auto', 'memory', 'none'))
  if '://' in dataset.decoded_cache_dir:
    raise ConfigError(f'config.dataset.decoded_cache_dir={dataset.decoded_cache_dir!r} must be a local '
                      "folder (decoded images are read back at disk speed); '' = ~/.cache/flaxtpu/decoded, "
                      'none = off')
  _one_of('dataset.normalize', dataset.normalize, NORMALIZATIONS)
  if dataset.normalize == 'fixed' and not (
      len(dataset.mean) == len(dataset.std) > 0 and min(dataset.std) > 0):
    raise ConfigError(f'config.dataset.normalize=fixed needs dataset.mean and dataset.std, one positive '
                      f'std per channel (got mean={tuple(dataset.mean)}, std={tuple(dataset.std)}); e.g. '
                      "--config.dataset.mean='(0.485, 0.456, 0.406)' "
                      "--config.dataset.std='(0.229, 0.224, 0.225)'")


def _check_input(config: ml_collections.ConfigDict) -> None:
  if config.input.workers < -1:
    raise ConfigError(f'config.input.workers={config.input.workers} must be >= 0 (or -1 = auto)')
  _positive('input.prefetch', config.input.prefetch)


def _check_augment(config: ml_collections.ConfigDict) -> None:
  augment = config.augment
  for key, low, high in (('crop_area', 0.0, 1.0), ('crop_aspect', 0.0, math.inf), ('erase_area', 0.0, 1.0),
                         ('erase_aspect', 0.0, math.inf)):
    value = tuple(augment[key])
    if len(value) != 2 or not low < value[0] <= value[1] <= high:
      raise ConfigError(f'config.augment.{key}={value!r} must be a (min, max) pair with '
                        f'{low} < min <= max <= {high}')
  _within('augment', augment, ('crop_padding', 'cutout'), '>= 0')
  _one_of('augment.crop_pad_mode', augment.crop_pad_mode, ('zeros', 'reflect', 'edge'))
  if augment.alternate_flip and not augment.flip:
    raise ConfigError('config.augment.alternate_flip=True alternates the flip, which is off; set '
                      '--config.augment.flip=true as well (or alternate_flip=false)')
  _one_of('augment.policy', augment.policy, POLICIES)
  if augment.policy == 'randaugment':
    _positive('augment.randaugment_layers', augment.randaugment_layers)
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
  _one_of('augment.erase_mode', augment.erase_mode, ERASE_MODES)
  _positive('augment.erase_count', augment.erase_count)
  default = defaults.get_config().augment
  for key in ('erase_mode', 'erase_count', 'erase_area', 'erase_aspect'):
    if not augment.erase_prob and augment[key] != default[key]:
      raise ConfigError(f'config.augment.{key}={augment[key]!r} has no effect while random erasing is off; '
                        'set --config.augment.erase_prob (e.g. 0.25) or leave it at '
                        f'{default[key]!r}')


def _check_model(config: ml_collections.ConfigDict) -> None:
  """The model's name and remat, and its ViT/ConvNeXt/ResNet options: valid values, left at their
  defaults for models that ignore them; the compute dtype."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  model = config.model
  _one_of('model.name', model.name, models.NAMES)
  _one_of('model.remat', model.remat, REMAT_POLICIES)
  if model.patch_size < 0:
    raise ConfigError(f'config.model.patch_size={model.patch_size} must be >= 0 (0 = the published size)')
  if model.remat_mlps < 0:
    raise ConfigError(f'config.model.remat_mlps={model.remat_mlps} must be >= 0 (0 = keep every MLP\'s '
                      'activations)')
  _one_of('model.pool', model.pool, models.POOLS)
  _one_of('model.padding', model.padding, models.PADDINGS)
  _one_of('model.gelu', model.gelu, models.GELUS)
  _one_of('model.downsample', model.downsample, models.DOWNSAMPLES)
  _within('model', model, ('dropout', 'drop_path'), '[0, 1)')
  options = models.get_spec(model.name).options
  default = defaults.get_config().model
  for key in models.OPTIONS:
    if key not in options and model[key] != default[key]:
      takers = [name for name in models.NAMES if key in models.get_spec(name).options]
      raise ConfigError(f'config.model.{key}={model[key]!r} has no effect on model.name={model.name!r}; '
                        f'leave it at {default[key]!r} or pick a model that takes it: {", ".join(takers)}')
  _one_of('dtype', config.dtype, DTYPES)


def _check_training(config: ml_collections.ConfigDict) -> None:
  """The top-level keys of the optimization section: batch sizes, length, label smoothing."""
  _positive('batch_size', config.batch_size)
  _positive('eval_batch_size', config.eval_batch_size, allow=(-1,))
  _positive('num_epochs', config.num_epochs)
  _positive('num_train_steps', config.num_train_steps, allow=(-1,))
  if not 0.0 <= config.label_smoothing < 1.0:
    raise ConfigError(f'config.label_smoothing={config.label_smoothing!r} must be in [0, 1)')
  _one_of('task', config.task, TASKS)
  from flaxtpu.data import sources  # pylint: disable=g-import-not-at-top  # the kinds that read tags
  if config.task == 'multilabel' and not sources.multilabel_named(config.dataset):
    raise ConfigError('config.task=multilabel needs images with any number of tags: set '
                      f'config.dataset.{sources.multilabel_keys_text()}')


def _check_optimizer(config: ml_collections.ConfigDict) -> None:
  """The optimizer's name and keys: valid values, and left at their defaults where it does not read them."""
  optimizer = config.optimizer
  _one_of('optimizer.name', optimizer.name, OPTIMIZERS)
  _positive('optimizer.learning_rate', optimizer.learning_rate)
  _within('optimizer', optimizer, ('momentum', 'b1', 'decay', 'lookahead_decay'), '[0, 1)')
  if optimizer.b2 != -1 and not 0.0 <= optimizer.b2 < 1.0:
    raise ConfigError(f'config.optimizer.b2={optimizer.b2!r} must be in [0, 1) (or -1 = the optimizer\'s '
                      'own: 0.999, lion 0.99)')
  _within('optimizer', optimizer, ('weight_decay', 'bias_weight_decay', 'grad_clip_norm', 'lookahead_every',
                                   'lookahead_decay_power', 'eps', 'clipping_threshold'), '>= 0')
  _within('optimizer', optimizer, ('decay_rate', 'layer_decay'), '[0, 1]')
  _positive('optimizer.trust_coefficient', optimizer.trust_coefficient)
  _positive('optimizer.min_dim_size_to_factor', optimizer.min_dim_size_to_factor)
  _positive('optimizer.accumulate_steps', optimizer.accumulate_steps)
  check_patterns('optimizer.freeze', optimizer.freeze)
  parse_lr_multipliers(optimizer.lr_multipliers)
  parse_freeze_after(optimizer.freeze_after)
  _check_read('optimizer', optimizer, OPTIMIZER_KEYS)
  if optimizer.nesterov and not optimizer.momentum:
    raise ConfigError('config.optimizer.nesterov=True has no effect with optimizer.momentum=0; set '
                      '--config.optimizer.momentum (e.g. 0.9) or --config.optimizer.nesterov=false')


def _check_schedule(config: ml_collections.ConfigDict) -> None:
  """The schedule's name and keys: valid values, and left at their defaults where it does not read them."""
  schedule = config.schedule
  _one_of('schedule.name', schedule.name, SCHEDULES)
  _within('schedule', schedule, ('warmup_epochs', 'cooldown_epochs'), '>= 0')
  _within('schedule', schedule, ('final_lr_fraction', 'decay_rate'), '[0, 1]')
  _positive('schedule.factor', schedule.factor)
  _positive('schedule.timescale', schedule.timescale)
  _check_read('schedule', schedule, SCHEDULE_KEYS)
  milestones = schedule.milestones
  if isinstance(milestones, str) or not all(isinstance(m, (int, float)) for m in milestones) or any(
      not schedule.warmup_epochs < m < n for m, n in zip(milestones, [*milestones[1:], math.inf])):
    raise ConfigError(f'config.schedule.milestones={milestones!r} must be increasing epochs after the '
                      f'warmup ({schedule.warmup_epochs:g} epochs), e.g. --config.schedule.milestones='
                      '"(30, 60, 80)"')
  if schedule.name == 'step' and not milestones:
    raise ConfigError("config.schedule.name='step' needs the epochs where the rate drops; set "
                      '--config.schedule.milestones="(30, 60, 80)" (and schedule.factor, 0.1 by default)')
  if schedule.name == 'plateau':
    _positive('schedule.plateau_patience', schedule.plateau_patience)
    if schedule.plateau_cooldown < 0 or not schedule.factor < 1.0:
      raise ConfigError(f'config.schedule.plateau_cooldown={schedule.plateau_cooldown!r} must be >= 0 and '
                        f'config.schedule.factor={schedule.factor!r} < 1 for schedule.name=plateau')
    _check_eval_metric('schedule.plateau_metric', schedule.plateau_metric or 'eval_loss')
  if schedule.name == 'exponential' and not (schedule.decay_rate or schedule.final_lr_fraction):
    raise ConfigError("config.schedule.name='exponential' needs schedule.decay_rate (the factor per epoch, "
                      'e.g. 0.97) or schedule.final_lr_fraction > 0 (where the run ends)')


def _check_read(section: str, values: ml_collections.ConfigDict, readers: dict[str, tuple[str, ...]]) -> None:
  """The keys of `readers` that `values.name` (the chosen optimizer or schedule) does not read must
  keep their defaults, as model options do."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  name, default = values.name, defaults.get_config()[section]
  for key in dict.fromkeys(key for keys in readers.values() for key in keys):
    if key not in readers[name] and values[key] != default[key]:
      takers = [taker for taker, keys in readers.items() if key in keys]
      raise ConfigError(f'config.{section}.{key}={values[key]!r} has no effect on {section}.name={name!r}; '
                        f'leave it at {default[key]!r} or pick one that reads it: {", ".join(takers)}')


def _check_ema(config: ml_collections.ConfigDict) -> None:
  if not 0.0 <= config.ema.decay < 1.0:
    raise ConfigError(f'config.ema.decay={config.ema.decay!r} must be in [0, 1) (0 = off; e.g. 0.999)')


def _check_init_from(config: ml_collections.ConfigDict) -> None:
  check_patterns('init_from.skip', config.init_from.skip)
  if config.init_from.checkpoint:
    hub_names.check_spec('init_from.checkpoint', config.init_from.checkpoint)
  step = str(config.init_from.step)
  if step not in ('latest', 'best') and not step.isdigit():
    raise ConfigError(f'config.init_from.step={step!r} is not valid; choose latest, best or a step number')
  if not config.init_from.checkpoint and (config.init_from.skip or step != 'latest'):
    raise ConfigError('config.init_from.skip and config.init_from.step have no effect without '
                      'config.init_from.checkpoint; set it to a workdir (or WORKDIR/checkpoints/STEP)')


def _check_parallelism(config: ml_collections.ConfigDict) -> None:
  _one_of('parallelism', config.parallelism, PARALLELISMS)
  _positive('mesh.data', config.mesh.data, allow=(-1,))
  _positive('mesh.fsdp', config.mesh.fsdp, allow=(-1,))
  if config.mesh.data == -1 and config.mesh.fsdp == -1:
    raise ConfigError('config.mesh.data and config.mesh.fsdp are both -1; at most one can take '
                      'the remaining devices')
  if config.parallelism == 'pmap' and config.mesh.fsdp not in (1,):
    raise ConfigError(f'config.mesh.fsdp={config.mesh.fsdp} needs parallelism=jit; pmap only '
                      'replicates parameters (set --config.mesh.fsdp=1 or --config.parallelism=jit)')
  _one_of('require_platform', config.require_platform, PLATFORMS)
  if config.cpu_devices < 0:
    raise ConfigError(f'config.cpu_devices={config.cpu_devices} must be >= 0 (0 = XLA default)')
  _one_of('cpu_convolutions', config.cpu_convolutions, tuple(CPU_CONVOLUTION_FLAGS))


def _check_loop(config: ml_collections.ConfigDict) -> None:
  _positive('log_every_steps', config.log_every_steps)
  if config.profile_steps < 0 or config.log_every_secs < 0:
    raise ConfigError('config.profile_steps and config.log_every_secs must be >= 0 (0 = off)')
  _positive('eval_every_steps', config.eval_every_steps, allow=(-1,))
  _positive('checkpoint_every_steps', config.checkpoint_every_steps, allow=(-1,))


def _check_checkpoint(config: ml_collections.ConfigDict) -> None:
  checkpoint = config.checkpoint
  _positive('checkpoint.keep', checkpoint.keep)
  metrics = ('eval_accuracy', 'eval_loss', 'eval_balanced_accuracy', 'eval_map', 'eval_map_micro', 'eval_f1')
  _one_of('checkpoint.best_metric', checkpoint.best_metric,
          ('auto', '', *metrics, *(f'{metric}{suffix}' for metric in metrics for suffix in ('_ema', '_swa'))))
  _one_of('checkpoint.best_mode', checkpoint.best_mode, ('max', 'min'))
  if checkpoint.best_metric == 'auto' and checkpoint.best_mode != 'max':
    raise ConfigError("config.checkpoint.best_metric='auto' picks eval_accuracy or eval_map, both kept at "
                      'their maximum; set best_mode=max or name the metric')
  multilabel_only = ('eval_map', 'eval_map_micro', 'eval_f1')
  plain_metric = checkpoint.best_metric.removesuffix('_ema').removesuffix('_swa')
  if plain_metric in multilabel_only and config.task != 'multilabel':
    raise ConfigError(f'config.checkpoint.best_metric={checkpoint.best_metric!r} is a multilabel metric; '
                      'pick eval_accuracy (or auto) for task=multiclass')
  if plain_metric == 'eval_balanced_accuracy' and config.task == 'multilabel':
    raise ConfigError('config.checkpoint.best_metric=eval_balanced_accuracy is a multiclass metric; pick '
                      'eval_map (or auto) for task=multilabel')
  if checkpoint.best_metric.endswith('_ema') and not config.ema.decay:
    raise ConfigError(f'config.checkpoint.best_metric={checkpoint.best_metric!r} needs an EMA of the '
                      'weights; set --config.ema.decay (e.g. 0.999) or pick eval_accuracy')


def _check_eval_metric(key: str, metric: str) -> None:
  if not (isinstance(metric, str) and metric.startswith('eval_')):
    raise ConfigError(f'config.{key}={metric!r} is not an eval metric; name one that the evaluation logs, '
                      'e.g. eval_loss, eval_accuracy or eval_map')


def _check_early_stopping(config: ml_collections.ConfigDict) -> None:
  stopping = config.early_stopping
  _one_of('early_stopping.mode', stopping.mode, ('auto', 'max', 'min'))
  _positive('early_stopping.patience', stopping.patience)
  if not stopping.min_delta >= 0:
    raise ConfigError(f'config.early_stopping.min_delta={stopping.min_delta!r} must be >= 0')
  if stopping.metric == 'auto' and not config.checkpoint.best_metric:
    raise ConfigError("config.early_stopping.metric='auto' follows checkpoint.best_metric, which is '' "
                      '(none); name the metric, e.g. --config.early_stopping.metric=eval_loss')
  if stopping.metric:
    _check_eval_metric('early_stopping.metric', early_stopping_metric(config))


def _check_eval(config: ml_collections.ConfigDict) -> None:
  if config.eval.ema and not config.ema.decay:
    raise ConfigError('config.eval.ema=True needs an EMA of the weights (config.ema.decay > 0); set '
                      '--config.eval.ema=false or --config.ema.decay=0.999')
  if config.eval.translate_tta < 0:
    raise ConfigError(f'config.eval.translate_tta={config.eval.translate_tta!r} must be >= 0')
  if not 0.0 <= config.eval.threshold < 1.0:
    raise ConfigError(f'config.eval.threshold={config.eval.threshold!r} must be in [0, 1) (0 = chosen '
                      'per class on the eval split)')
  _check_fewshot(config)


def _check_fewshot(config: ml_collections.ConfigDict) -> None:
  fewshot = config.eval.fewshot
  if not fewshot.shots:
    if fewshot.datasets:
      raise ConfigError(f'config.eval.fewshot.datasets={tuple(fewshot.datasets)} needs shot counts: set '
                        '--config.eval.fewshot.shots=1,5,10')
    return
  if any(not isinstance(k, int) or k < 1 for k in fewshot.shots):
    raise ConfigError(f'config.eval.fewshot.shots={tuple(fewshot.shots)} must be positive whole numbers of '
                      'images per class, e.g. 1,5,10')
  _positive('eval.fewshot.seeds', fewshot.seeds)
  _positive('eval.fewshot.l2_reg', fewshot.l2_reg)
  if config.task == 'multilabel':
    raise ConfigError('config.eval.fewshot probes one class per image and this run is task=multilabel; '
                      'leave eval.fewshot.shots empty')


def _check_distill(config: ml_collections.ConfigDict) -> None:
  distill = config.distill
  if not distill.teacher:
    return
  hub_names.check_spec('distill.teacher', distill.teacher)
  _one_of('distill.loss', distill.loss, ('soft', 'hard', 'function_matching'))
  if not 0.0 <= distill.alpha <= 1.0:
    raise ConfigError(f'config.distill.alpha={distill.alpha!r} must be in [0, 1]: the teacher\'s share of '
                      'the loss (1 = the teacher alone)')
  if not distill.temperature > 0:
    raise ConfigError(f'config.distill.temperature={distill.temperature!r} must be > 0 (1 = the '
                      'teacher\'s own probabilities; Hinton et al. use 2-4)')
  if distill.loss == 'hard' and distill.temperature != 1.0:
    raise ConfigError(f'config.distill.loss=hard learns the teacher\'s top class, which no temperature '
                      f'changes; drop config.distill.temperature={distill.temperature!r} or use loss=soft')
  if not (distill.step in ('best', 'latest') or str(distill.step).isdigit()):
    raise ConfigError(f'config.distill.step={distill.step!r} must be best, latest or a step number')


def _check_predict(config: ml_collections.ConfigDict) -> None:
  _positive('predict.top_k', config.predict.top_k)


def _check_compilation_cache(config: ml_collections.ConfigDict) -> None:
  """A compilation_cache_dir the user named must take files: JAX would warn at every program it cannot
  keep, and compile each again next run. The default (~/.cache/flaxtpu/jax) is not asked. The start's
  other setting, the TPU runtime's transfer buffer, is a size."""
  folder = config.compilation_cache_dir
  if folder and folder != 'none' and (reason := files.creatable(folder)):
    raise ConfigError(f'config.compilation_cache_dir={folder!r} cannot be written ({reason}); choose a '
                      "directory you can write, '' (~/.cache/flaxtpu/jax) or none (no cache)")
  buffer = config.tpu_premapped_buffer_mib
  if not isinstance(buffer, int) or not 0 <= buffer < 1 << 20:
    raise ConfigError(f'config.tpu_premapped_buffer_mib={buffer!r} must be a whole number of MiB per chip '
                      "below 1 TiB (0 = the TPU runtime's default, 4096 a host)")


# The sections of defaults.py, in its order.
SECTION_CHECKS = (_check_dataset_source, _check_dataset, _check_input, _check_augment, _check_model,
                  _check_training, _check_optimizer, _check_schedule, _check_ema, _check_init_from,
                  _check_distill, _check_parallelism,
                  _check_loop, _check_checkpoint, _check_early_stopping, _check_eval, _check_predict,
                  optim_checks.check, _check_export, audit.check_config, calibration.check_config,
                  tracking.check_config, aug_checks.check, image_sizes.check, swa.check,
                  _check_compilation_cache)


def config_keys(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  """Every leaf key of a config as a dotted path."""
  keys = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      keys += config_keys(value, f'{prefix}{key}.')
    else:
      keys.append(f'{prefix}{key}')
  return keys


def did_you_mean(key: str, known_keys: Sequence[str]) -> str:
  """' (did you mean 'x'?)' for the closest known key; `lr` matches `learning_rate`."""
  parent, _, leaf = key.rpartition('.')
  abbreviated = [known for known in known_keys if known.rpartition('.')[0] == parent
                 and ''.join(word[0] for word in known.rpartition('.')[2].split('_')) == leaf]
  close = abbreviated or difflib.get_close_matches(key, known_keys, n=1)
  return f' (did you mean {close[0]!r}?)' if close else ''
