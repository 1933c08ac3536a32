"""Resolution: every default a config leaves open, filled from its sources once, before `validate`.

`resolve` applies them in this order; each fills only what the user and the
steps before it left open:

  0. a run that already started in the workdir keeps the function its weights
     compute: model.padding and model.gelu from its config.json (legacy values
     where it predates them), refused where the config asks for another
     (`keep_saved_function`; for training, once the init_from source below has
     named the model);
  1. the saved run's config: eval/predict/export of a trained run start from
     its config.json (flaxtpu/validation/workdir_config.py -> `from_saved`, which
     fills options a run saved before they existed), read while the flags are
     parsed so that `--config.KEY=VALUE` overrides apply on top;
  2. published weights named by `init_from.checkpoint` (a run that starts from
     them, or eval/predict/export straight from them): their model, options,
     normalisation, image size and crop fraction (`pretrained.apply_defaults`);
  3. a flaxtpu run named by `init_from.checkpoint`: its model (where model.name
     is left at its default), normalisation numbers, image size and crop
     fraction (`apply_source_defaults`).

A run in a workdir that already started keeps what its config.json resolved,
without reading the source again. Then `config.validate` sees the config the
run uses, and nothing edits it afterwards. No JAX here: the CLI resolves and
validates before JAX starts; a flaxtpu source's record is read as the JSON
orbax keeps beside its arrays (flaxtpu/weights/saved.py).
"""

from __future__ import annotations

import logging
import os

import ml_collections

from flaxtpu.io import files
from flaxtpu.settings import hub_names
from flaxtpu.settings.errors import CheckpointError, ConfigError, UserError
from flaxtpu.settings.metric_names import best_metric
from flaxtpu.validation.workdir_config import CONFIG_FILE  # what a run resolved, written when it starts
from flaxtpu.weights import pretrained, saved

TRAINING_MODES = ('train', 'plan')  # a run that starts in the workdir (plan: what train would compile)


def restores_published(workdir: str, mode: str) -> bool:
  """Whether eval/predict/export may read published weights: no trained run in `workdir` to restore."""
  return mode in ('eval', 'predict', 'export') and not files.isfile(os.path.join(workdir or '', CONFIG_FILE))


def resolve(config: ml_collections.ConfigDict, workdir: str, mode: str) -> None:
  """Fills, in place and in the order above, what `config` leaves open for a run of `mode` in `workdir`."""
  if mode in TRAINING_MODES:
    apply_source_defaults(config, workdir)  # the model a config leaves open: the started run's is checked
    check_teacher(config)
    keep_saved_function(config, workdir)
    return
  keep_saved_function(config, workdir)
  if restores_published(workdir, mode) or not files.isdir(os.path.join(workdir or '', 'checkpoints')):
    # evaluate.restore reads published weights wherever the workdir has no checkpoints.
    pretrained.apply_defaults(config)


def keep_saved_function(config: ml_collections.ConfigDict, workdir: str) -> None:
  """A run that already started in `workdir` keeps the function its weights were trained to compute.

  The model options that change what the same weights compute (models.LEGACY_OPTIONS: padding, gelu)
  come from its config.json, where a run saved before an option existed has that option's legacy
  value (`workdir_config.from_saved`). A config that leaves one at its default (a new recipe resumed on an
  old run) gets the saved value, with a log line; one that asks for another value is refused.
  """
  started = files.read_json(os.path.join(workdir, CONFIG_FILE)) if workdir else None
  if not started or started.get('model', {}).get('name') != config.model.name:
    return  # a new run, or another model (the checkpoint's own checks name that)
  from flaxtpu import models  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  from flaxtpu.validation import workdir_config  # pylint: disable=g-import-not-at-top
  trained, default = workdir_config.from_saved(started).model, defaults.get_config().model
  for key in models.LEGACY_OPTIONS:
    if key not in trained or config.model[key] == trained[key]:
      continue
    how = ('' if key in started['model'] else
           f' (its config.json predates model.{key}: runs then computed {trained[key]!r})')
    if config.model[key] != default[key]:
      raise ConfigError(f'--workdir={workdir} was trained with model.{key}={trained[key]!r}{how}, but the '
                        f'config asks for {config.model[key]!r}, which computes another function with the '
                        f'same weights; drop model.{key} (the run\'s is kept) or use another --workdir')
    logging.warning('model.%s=%r: the run in %s was trained with it%s', key, trained[key], workdir, how)
    config.model[key] = trained[key]


def apply_source_defaults(config: ml_collections.ConfigDict, workdir: str = '') -> None:
  """The init_from source's preprocessing (and, for published weights, model) as the run's defaults.

  Published weights: `pretrained.apply_defaults`. A flaxtpu run: its model
  and the model options that shape its weights (where model.name is left at
  its default, as for published weights: `configs/finetune.py` on a ResNet-50
  run fine-tunes a ResNet-50), its normalisation numbers (where
  dataset.normalize is auto), image size (0) and crop fraction (0), so a
  fine-tuned run sees images as its source did. A run in `workdir` that
  already started from the same source keeps what its config.json says,
  without reading the source again.
  """
  spec = config.init_from.checkpoint
  if not spec or pretrained.apply_defaults(config, workdir):
    return
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  default_model = defaults.get_config().model
  if (config.model.name != default_model.name and config.dataset.normalize != 'auto'
      and config.dataset.image_size and config.dataset.crop_fraction):
    return  # nothing left open
  started = files.read_json(os.path.join(workdir, CONFIG_FILE)) if workdir else None
  if started and started.get('init_from', {}).get('checkpoint') == spec:
    model, trained = started.get('model', {}), started['dataset']
    mean, std = trained.get('mean'), trained.get('std')
  else:
    record = source_record(config)
    from flaxtpu.validation import workdir_config  # pylint: disable=g-import-not-at-top
    saved_config = record.get('config', {})
    # A source saved before an option existed computed with its legacy value.
    model = {**workdir_config.legacy_options(saved_config), **saved_config.get('model', {})}
    trained = saved_config.get('dataset', {})
    mean, std = record['normalization']['mean'], record['normalization']['std']
  if config.model.name == default_model.name and model.get('name', config.model.name) != config.model.name:
    config.model.name = model['name']
    for key in pretrained.MODEL_OPTIONS:  # those left at their defaults: the source's
      if key in model and config.model[key] == default_model[key]:
        config.model[key] = model[key]
    logging.info('model.name=%s: the model of init_from.checkpoint=%s', config.model.name, spec)
  for key, value in source_dataset_defaults(config.dataset, trained, mean, std).items():
    config.dataset[key] = value


def check_teacher(config: ml_collections.ConfigDict) -> None:
  """That `distill.teacher` can be read, before the workdir is touched: published weights are found
  (fetched into huggingface_hub's cache, where the trainer reads them again) and described, a flaxtpu
  run is a run; what does not is the UserError the trainer would stop with, naming distill.teacher.
  Whether it suits the data (image size, classes) is known once the data is: `distill.load_teacher`."""
  teacher = config.distill.teacher
  if not teacher:
    return
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  try:
    if pretrained.is_published(teacher):
      pretrained.describe(teacher)
    else:
      source_location(defaults.derived(config, {'init_from.checkpoint': teacher,
                                                'init_from.step': config.distill.step}))
  except UserError as e:
    raise as_teacher_error(e) from None


def as_teacher_error(error: UserError) -> UserError:
  """An init_from error about the source the teacher names, about distill.teacher (and distill.step)."""
  return type(error)(str(error).replace('init_from.checkpoint', 'distill.teacher')
                     .replace('init_from.step', 'distill.step'))


def source_dataset_defaults(dataset: ml_collections.ConfigDict, trained: dict, mean, std) -> dict:
  """{dataset key: value} that a flaxtpu source (its `trained` dataset section and normalisation
  numbers) fills where `dataset` leaves it open; {} for a resolved config."""
  filled = {}
  if dataset.normalize == 'auto' and trained.get('normalize') in ('standardize', 'fixed'):
    filled.update(normalize='fixed', mean=tuple(mean), std=tuple(std))
  if dataset.image_size == 0 and trained.get('image_size'):
    filled['image_size'] = trained['image_size']
  if dataset.crop_fraction == 0 and trained.get('crop_fraction'):
    filled['crop_fraction'] = trained['crop_fraction']
  return filled


def source_location(config: ml_collections.ConfigDict) -> tuple[str, str]:
  """(workdir, latest | best | STEP) of the flaxtpu run `init_from.checkpoint` names: a workdir (with
  `init_from.step`) or one of its step directories, WORKDIR/checkpoints/STEP."""
  given = config.init_from.checkpoint
  path = os.path.abspath(os.path.expanduser(given))
  name, parent = os.path.basename(path), os.path.dirname(path)
  if os.path.isdir(os.path.join(path, 'checkpoints')):
    return path, str(config.init_from.step)
  if name.isdigit() and os.path.basename(parent) == 'checkpoints' and os.path.isdir(path):
    if str(config.init_from.step) not in ('latest', name):
      raise CheckpointError(f'config.init_from.checkpoint={given!r} is step {name} but '
                            f'config.init_from.step={config.init_from.step!r}; give the workdir with a '
                            'step, or the step directory alone')
    return os.path.dirname(parent), name
  prefix = hub_names.HUB_PREFIX
  if (repo := hub_names.other_spelling(given)) is not None:  # timm's hf_hub:, hf://, a huggingface.co address
    raise CheckpointError(f'config.init_from.checkpoint={given!r}: hub models are written {prefix}ORG/NAME; '
                          f'use init_from.checkpoint={prefix}{repo}')
  hub_hint = (f' (or, for the hub model {repo}, write {prefix}{repo})'
              if (repo := hub_names.bare_repo(given)) else '')
  raise CheckpointError(f'config.init_from.checkpoint={given!r} holds no flaxtpu checkpoint; point it at '
                        f'the --workdir of a finished run (or its WORKDIR/checkpoints/STEP){hub_hint}')


def source_record(config: ml_collections.ConfigDict) -> dict:
  """The checkpoint record of the step of the flaxtpu run `init_from.checkpoint` names, read without
  JAX; the step is the one `finetune.resolve_source` restores (orbax's best for `best`)."""
  workdir, which = source_location(config)
  directory = files.absolute(os.path.join(workdir, 'checkpoints'))
  steps = sorted(saved.complete_steps(directory))
  if not steps:
    raise no_checkpoint(config, directory)
  best = lambda: saved.best_step(directory, steps, best_metric(config), config.checkpoint.best_mode)
  return saved.read_record(directory, saved.pick_step(directory, which, 'init_from.step', steps, best))


def no_checkpoint(config: ml_collections.ConfigDict, directory: str) -> CheckpointError:
  return CheckpointError(f'config.init_from.checkpoint={config.init_from.checkpoint!r}: {directory} holds no '
                         'complete checkpoint; point it at a run that saved one')
