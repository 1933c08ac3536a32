"""The checks of what is trained and how: the model and its compute dtype, the run's length and task,
the optimizer and its schedule, EMA, the weights a run starts from, distillation. Each optimizer's and
schedule's keys are listed here: the ones it does not read must keep their defaults. No JAX at import."""

from __future__ import annotations

import math

import ml_collections

from flaxtpu import models  # no JAX at import
from flaxtpu.optimizers.param_patterns import check_patterns, parse_freeze_after, parse_lr_multipliers
from flaxtpu.settings import hub_names  # no JAX at import
from flaxtpu.settings.errors import ConfigError
from flaxtpu.validation.values import eval_metric, keeps_defaults, one_of, positive, within

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
REMAT_POLICIES = ('none', 'full', 'nothing_saveable', 'everything_saveable',
                  'dots_saveable', 'dots_with_no_batch_dims_saveable', 'auto')
DTYPES = ('float32', 'bfloat16', 'float16')
TASKS = ('multiclass', 'multilabel')


def check_model(config: ml_collections.ConfigDict) -> None:
  """The model's name and remat, and its ViT/ConvNeXt/ResNet options: valid values, left at their
  defaults for models that ignore them; the compute dtype."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  model = config.model
  one_of('model.name', model.name, models.NAMES)
  one_of('model.remat', model.remat, REMAT_POLICIES)
  if model.patch_size < 0:
    raise ConfigError(f'config.model.patch_size={model.patch_size} must be >= 0 (0 = the published size)')
  if model.remat_mlps < 0:
    raise ConfigError(f'config.model.remat_mlps={model.remat_mlps} must be >= 0 (0 = keep every MLP\'s '
                      'activations)')
  one_of('model.pool', model.pool, models.POOLS)
  one_of('model.padding', model.padding, models.PADDINGS)
  one_of('model.gelu', model.gelu, models.GELUS)
  one_of('model.downsample', model.downsample, models.DOWNSAMPLES)
  within('model', model, ('dropout', 'drop_path'), '[0, 1)')
  options = models.get_spec(model.name).options
  default = defaults.get_config().model
  for key in models.OPTIONS:
    if key not in options and model[key] != default[key]:
      takers = [name for name in models.NAMES if key in models.get_spec(name).options]
      raise ConfigError(f'config.model.{key}={model[key]!r} has no effect on model.name={model.name!r}; '
                        f'leave it at {default[key]!r} or pick a model that takes it: {", ".join(takers)}')
  one_of('dtype', config.dtype, DTYPES)


def check_training(config: ml_collections.ConfigDict) -> None:
  """The top-level keys of the optimization section: batch sizes, length, label smoothing."""
  positive('batch_size', config.batch_size)
  positive('eval_batch_size', config.eval_batch_size, allow=(-1,))
  positive('num_epochs', config.num_epochs)
  positive('num_train_steps', config.num_train_steps, allow=(-1,))
  if not 0.0 <= config.label_smoothing < 1.0:
    raise ConfigError(f'config.label_smoothing={config.label_smoothing!r} must be in [0, 1)')
  one_of('task', config.task, TASKS)
  from flaxtpu.data import sources  # pylint: disable=g-import-not-at-top  # the kinds that read tags
  if config.task == 'multilabel' and not sources.multilabel_named(config.dataset):
    raise ConfigError('config.task=multilabel needs images with any number of tags: set '
                      f'config.dataset.{sources.multilabel_keys_text()}')


def check_optimizer(config: ml_collections.ConfigDict) -> None:
  """The optimizer's name and keys: valid values, and left at their defaults where it does not read them."""
  optimizer = config.optimizer
  one_of('optimizer.name', optimizer.name, OPTIMIZERS)
  positive('optimizer.learning_rate', optimizer.learning_rate)
  within('optimizer', optimizer, ('momentum', 'b1', 'decay', 'lookahead_decay'), '[0, 1)')
  if optimizer.b2 != -1 and not 0.0 <= optimizer.b2 < 1.0:
    raise ConfigError(f'config.optimizer.b2={optimizer.b2!r} must be in [0, 1) (or -1 = the optimizer\'s '
                      'own: 0.999, lion 0.99)')
  within('optimizer', optimizer, ('weight_decay', 'bias_weight_decay', 'grad_clip_norm', 'lookahead_every',
                                   'lookahead_decay_power', 'eps', 'clipping_threshold'), '>= 0')
  within('optimizer', optimizer, ('decay_rate', 'layer_decay'), '[0, 1]')
  positive('optimizer.trust_coefficient', optimizer.trust_coefficient)
  positive('optimizer.min_dim_size_to_factor', optimizer.min_dim_size_to_factor)
  positive('optimizer.accumulate_steps', optimizer.accumulate_steps)
  check_patterns('optimizer.freeze', optimizer.freeze)
  parse_lr_multipliers(optimizer.lr_multipliers)
  parse_freeze_after(optimizer.freeze_after)
  keeps_defaults('optimizer', optimizer, OPTIMIZER_KEYS)
  if optimizer.nesterov and not optimizer.momentum:
    raise ConfigError('config.optimizer.nesterov=True has no effect with optimizer.momentum=0; set '
                      '--config.optimizer.momentum (e.g. 0.9) or --config.optimizer.nesterov=false')


def check_schedule(config: ml_collections.ConfigDict) -> None:
  """The schedule's name and keys: valid values, and left at their defaults where it does not read them."""
  schedule = config.schedule
  one_of('schedule.name', schedule.name, SCHEDULES)
  within('schedule', schedule, ('warmup_epochs', 'cooldown_epochs'), '>= 0')
  within('schedule', schedule, ('final_lr_fraction', 'decay_rate'), '[0, 1]')
  positive('schedule.factor', schedule.factor)
  positive('schedule.timescale', schedule.timescale)
  keeps_defaults('schedule', schedule, SCHEDULE_KEYS)
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
    positive('schedule.plateau_patience', schedule.plateau_patience)
    if schedule.plateau_cooldown < 0 or not schedule.factor < 1.0:
      raise ConfigError(f'config.schedule.plateau_cooldown={schedule.plateau_cooldown!r} must be >= 0 and '
                        f'config.schedule.factor={schedule.factor!r} < 1 for schedule.name=plateau')
    eval_metric('schedule.plateau_metric', schedule.plateau_metric or 'eval_loss')
  if schedule.name == 'exponential' and not (schedule.decay_rate or schedule.final_lr_fraction):
    raise ConfigError("config.schedule.name='exponential' needs schedule.decay_rate (the factor per epoch, "
                      'e.g. 0.97) or schedule.final_lr_fraction > 0 (where the run ends)')


def check_ema(config: ml_collections.ConfigDict) -> None:
  if not 0.0 <= config.ema.decay < 1.0:
    raise ConfigError(f'config.ema.decay={config.ema.decay!r} must be in [0, 1) (0 = off; e.g. 0.999)')


def check_init_from(config: ml_collections.ConfigDict) -> None:
  check_patterns('init_from.skip', config.init_from.skip)
  if config.init_from.checkpoint:
    hub_names.check_spec('init_from.checkpoint', config.init_from.checkpoint)
  step = str(config.init_from.step)
  if step not in ('latest', 'best') and not step.isdigit():
    raise ConfigError(f'config.init_from.step={step!r} is not valid; choose latest, best or a step number')
  if not config.init_from.checkpoint and (config.init_from.skip or step != 'latest'):
    raise ConfigError('config.init_from.skip and config.init_from.step have no effect without '
                      'config.init_from.checkpoint; set it to a workdir (or WORKDIR/checkpoints/STEP)')


def check_distill(config: ml_collections.ConfigDict) -> None:
  distill = config.distill
  if not distill.teacher:
    return
  hub_names.check_spec('distill.teacher', distill.teacher)
  one_of('distill.loss', distill.loss, ('soft', 'hard', 'function_matching'))
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
