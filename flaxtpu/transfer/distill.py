"""Knowledge distillation: a frozen teacher's predictions as (part of) the student's targets.

`distill.teacher` names a flaxtpu workdir (its `distill.step`), one of its
checkpoint directories, or published weights (hf-hub:ORG/NAME, .safetensors,
.pth, .npz: whatever `init_from` accepts). The teacher runs inside the train
step in eval mode (BatchNorm on its running statistics), on the student's
mesh and shardings and in the student's `dtype`; its weights are an argument
of the step, never part of the train state, so checkpoints hold the student
alone. Per example the loss is

    (1 - alpha) * cross-entropy(labels) + alpha * T^2 * KL(teacher_T || student_T)

with `distill.loss`:

- `soft` (Hinton et al.): the teacher's softmax at temperature T of the
  augmented image; under mixup/CutMix its probabilities are mixed as the
  labels are.
- `hard` (DeiT's hard distillation): the teacher's top class (multilabel: its
  tags at 0.5) as a one-hot label, mixed as the labels are; T is 1.
- `function_matching` (Beyer et al., "Knowledge distillation: A good teacher
  is patient and consistent"): the teacher sees exactly the student's input,
  the mixed image included, and scores it at temperature T.

The teacher's images are the student's normalised pixels mapped onto the
teacher's own normalisation (an affine map, so erasing noise and mixing carry
over exactly). Multilabel teachers give per-tag sigmoids and the KL is the
per-tag binary one, summed over the tags.
"""

import dataclasses
import logging
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from clu import metrics as clu_metrics
from jax.scipy.special import xlogy

from flaxtpu.augmentation import image_sizes
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import UserError
from flaxtpu.step import placing, steps
from flaxtpu.transfer import finetune
from flaxtpu.validation import resolution
from flaxtpu.validation.workdir_config import from_saved
from flaxtpu.weights import checkpoint, pretrained


@clu_metrics.flax.struct.dataclass
class Metrics(clu_metrics.Collection):
  """A distilling train step's: the loss, accuracy, and the teacher term (T^2 x KL) on its own."""
  loss: clu_metrics.Average.from_output('loss')
  accuracy: clu_metrics.Average.from_output('accuracy')
  distill_kl: clu_metrics.Average.from_output('distill_kl')


@dataclasses.dataclass(frozen=True)
class Teacher:
  """The static half of distillation, closed over by the train step (its weights are an argument)."""
  model: nn.Module
  mean: Optional[np.ndarray]  # the teacher's normalisation (None: pixels in [0, 1])
  std: Optional[np.ndarray]
  order: Optional[np.ndarray]  # int32 [classes]: the teacher logit of each of the run's classes; None = same
  loss: str  # soft | hard | function_matching
  alpha: float
  temperature: float
  multilabel: bool
  source: str = ''  # distill.teacher as given
  step: int = 0  # the teacher checkpoint's step (0 for published weights)
  metric_collection = Metrics  # the train step's metrics (a class attribute, not a field)

  @property
  def sees_mixed_images(self) -> bool:
    """function_matching: the teacher scores the mixed image itself, not the images before mixing."""
    return self.loss == 'function_matching'

  def logits(self, variables, images: jax.Array, mean: Optional[np.ndarray],
             std: Optional[np.ndarray]) -> jax.Array:
    """float32 [batch, classes] teacher logits of the student's normalised `images` (normalised by
    `mean`/`std`), in the run's class order. No gradient flows into the teacher."""
    pixels = images if mean is None else images * std + mean  # back to [0, 1]
    inputs = pixels if self.mean is None else (pixels - self.mean) / self.std
    logits = self.model.apply({'params': variables.params, 'batch_stats': variables.batch_stats},
                              inputs, train=False)
    logits = jax.lax.stop_gradient(logits.astype(jnp.float32))
    return logits if self.order is None else logits[:, self.order]

  def targets(self, logits: jax.Array) -> jax.Array:
    """The teacher's targets from its logits: probabilities at the temperature, or hard labels."""
    if self.loss == 'hard':
      if self.multilabel:
        return (logits >= 0).astype(jnp.float32)
      return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1])
    scaled = logits / self.temperature
    return jax.nn.sigmoid(scaled) if self.multilabel else jax.nn.softmax(scaled)

  @property
  def kl_temperature(self) -> float:
    return 1.0 if self.loss == 'hard' else self.temperature

  def kl(self, student_logits: jax.Array, teacher_targets: jax.Array) -> jax.Array:
    """float32 [batch]: T^2 x KL(teacher targets || student at T) per example (`kl_per_example`)."""
    return kl_per_example(student_logits, teacher_targets, self.kl_temperature, self.multilabel)

  def combine(self, label_loss: jax.Array, kl: jax.Array) -> jax.Array:
    return (1.0 - self.alpha) * label_loss + self.alpha * kl


def kl_per_example(student_logits: jax.Array, targets: jax.Array, temperature: float,
                   multilabel: bool) -> jax.Array:
  """float32 [batch]: temperature^2 x KL(targets || the student's distribution at the temperature).

  Multiclass: the softmax KL over the classes. Multilabel: the binary KL of each tag's sigmoid,
  summed over the tags. The T^2 factor keeps the gradients' scale as T changes (Hinton et al.).
  With one-hot targets this is the cross-entropy.
  """
  scaled = student_logits.astype(jnp.float32) / temperature
  if multilabel:
    entropy_terms = xlogy(targets, targets) + xlogy(1 - targets, 1 - targets)
    cross_terms = targets * jax.nn.log_sigmoid(scaled) + (1 - targets) * jax.nn.log_sigmoid(-scaled)
    return temperature ** 2 * jnp.sum(entropy_terms - cross_terms, axis=-1)
  return temperature ** 2 * jnp.sum(xlogy(targets, targets) - targets * jax.nn.log_softmax(scaled), axis=-1)


# --- loading the teacher ------------------------------------------------------------------------


def record_of(teacher: Optional[Teacher]) -> Optional[dict]:
  """What a checkpoint record keeps of the teacher, so that a resumed run reads the same step."""
  return {'teacher': teacher.source, 'step': teacher.step} if teacher else None


# The run's config as the teacher's placement needs it (`defaults.derived`): the run's devices, precision
# and batch sizes; no test-time augmentation, no EMA, no init_from, no remat.
INFERENCE = {'eval.flip_tta': False, 'eval.translate_tta': 0, 'eval.ema': False, 'init_from.checkpoint': '',
             'model.remat': 'none'}


def recorded_step(saved_record: dict, teacher: str) -> Optional[int]:
  """The teacher step a run started with (from its checkpoint record), so that `best` or `latest`
  does not move to a newer teacher checkpoint when it resumes."""
  saved = saved_record.get('distill') or {}
  return int(saved['step']) if saved.get('teacher') == teacher and saved.get('step') is not None else None


def load_teacher(config: ml_collections.ConfigDict, class_names, image_shape: tuple[int, ...],
                 mesh: jax.sharding.Mesh, started_step: Optional[int] = None
                 ) -> tuple[Teacher, Any]:
  """(the Teacher, its weights laid out on `mesh` for the run's parallelism).

  The teacher must predict the run's classes (by name, in any order) from images of the size it was
  trained at, which must be the run's (`image_shape`, and each of augment.train_sizes): flaxtpu never
  resizes a teacher's input, so a difference is one UserError line naming both, before any weights are
  read. Its normalisation may differ from the run's: it sees the run's pixels normalised its own way
  (`Teacher.logits`), and the log says so. `started_step`: the step a resumed run's teacher was read at.
  """
  spec = config.distill.teacher
  if pretrained.is_published(spec):  # its model, normalisation and classes, at the size it was trained at
    try:
      published = pretrained.describe(spec)
    except UserError as e:
      raise resolution.as_teacher_error(e) from None
    check_image_shape(config, spec, published.model,
                      (published.image_size, published.image_size, len(published.mean)), image_shape)
    teacher_config = defaults.derived(config, {
        **INFERENCE, 'init_from.checkpoint': spec, 'model.name': defaults.get_config().model.name,
        'dataset.normalize': 'auto', 'dataset.image_size': image_shape[0]})
    pretrained.apply_defaults(teacher_config)  # the teacher's config, resolved as the CLI resolves a run's
    check_task(spec, 'multiclass', config.task)
    order = class_order(list(pretrained.class_names(published)), list(class_names), spec)
    try:
      placement, variables, step, record = finetune.published_model(teacher_config)
    except UserError as e:
      raise resolution.as_teacher_error(e) from None
    source_config = teacher_config
  else:
    lookup = defaults.derived(config, {
        'init_from.checkpoint': spec,
        'init_from.step': str(started_step) if started_step is not None else config.distill.step})
    try:
      source, step = finetune.resolve_source(lookup)
    except checkpoint.CheckpointError as e:
      raise resolution.as_teacher_error(e) from None
    try:
      record = source.read_record(step)
      # The teacher's own model and data keys; the run's devices, precision and batch sizes.
      teacher_config = defaults.derived(config, INFERENCE)
      source_config = defaults.derived(from_saved(record.get('config', {})), {
          section: teacher_config[section]
          for section in ('parallelism', 'mesh', 'dtype', 'batch_size', 'eval_batch_size', 'cpu_devices',
                          'eval')})
      check_image_shape(config, spec, source_config.model.name, tuple(record['image_shape']), image_shape)
      check_task(spec, record.get('task', 'multiclass'), config.task)
      order = class_order(record.get('class_names') or [], list(class_names), spec)
      norm = record['normalization']
      task = steps.create_task(source_config, num_classes=record['num_classes'],
                               image_shape=tuple(record['image_shape']), mean=norm['mean'], std=norm['std'])
      placement = placing.place(task, mesh, source_config)
      saved, _ = source.restore(step, placement.abstract_state, {'model': source_config.model.name},
                                config=source_config, subset=True)
      variables = placement.from_saveable(saved)
    finally:
      source.close()
  mean, std = _normalization(source_config, record)
  model = steps.create_task(source_config, num_classes=record['num_classes'],
                            image_shape=tuple(record['image_shape']), mean=mean, std=std).model
  log_normalization(config, spec, mean, std)
  settings = config.distill
  teacher = Teacher(model=model, mean=mean, std=std, order=order, loss=settings.loss, alpha=settings.alpha,
                    temperature=settings.temperature, multilabel=config.task == 'multilabel', source=spec,
                    step=int(step))
  logging.info('distilling from %s (%s, step %d, %d classes): loss=%s alpha=%g temperature=%g', spec,
               source_config.model.name, step, record['num_classes'], settings.loss, settings.alpha,
               settings.temperature)
  return teacher, variables


def check_task(spec: str, teacher_task: str, task: str) -> None:
  if teacher_task != task:
    raise UserError(f'config.distill.teacher={spec!r} is a {teacher_task} model and this run is '
                    f'task={task}; distill from a teacher of the same task')


def _size(shape: tuple[int, ...]) -> str:
  return f'{shape[0]}x{shape[1]}'


def check_image_shape(config: ml_collections.ConfigDict, spec: str, model: str,
                      teacher_shape: tuple[int, ...], image_shape: tuple[int, ...]) -> None:
  """The teacher's input (H, W, C), as it was trained, against the run's images (and each size that
  augment.train_sizes resizes them to): any difference is one UserError line naming both and the fix.
  flaxtpu has no option to resize a teacher's input on purpose: a teacher scored off its size (a
  ConvNet's receptive fields against other object scales) teaches what it did not learn."""
  teacher_shape, image_shape = tuple(teacher_shape), tuple(image_shape)
  if teacher_shape[-1] != image_shape[-1]:
    raise UserError(f'config.distill.teacher={spec!r} ({model}) reads {teacher_shape} images and the data '
                    f'gives {image_shape}; distill from a teacher trained on images of {image_shape[-1]} '
                    'channels')
  side = teacher_shape[0] if teacher_shape[0] == teacher_shape[1] else 0
  at_size = (f'train the student at the teacher\'s size (config.dataset.image_size={side}) or distill from '
             'a teacher trained at the student\'s' if side else
             'distill from a teacher trained at the student\'s size')
  if teacher_shape[:2] != image_shape[:2]:
    raise UserError(f'config.distill.teacher={spec!r} ({model}) was trained on {_size(teacher_shape)} images '
                    f'and the student\'s data gives {_size(image_shape)}; {at_size} (a teacher\'s input is '
                    'never resized)')
  if other := [size for size in image_sizes.sizes_of(config) if (size, size) != teacher_shape[:2]]:
    raise UserError(f'config.distill.teacher={spec!r} ({model}) was trained on {_size(teacher_shape)} images '
                    f'and config.augment.train_sizes resizes the student\'s (and so the teacher\'s) to '
                    f'{", ".join(f"{size}x{size}" for size in other)}; drop augment.train_sizes (or distill '
                    'without it: a teacher\'s input is never resized)')


def log_normalization(config: ml_collections.ConfigDict, spec: str, mean: Optional[np.ndarray],
                      std: Optional[np.ndarray]) -> None:
  """One log line where the teacher normalises images otherwise than the run: it is fed the run's
  pixels normalised its own way (exact: both are per-channel affine maps of the same pixels)."""
  rounded = lambda values: tuple(round(float(value), 4) for value in values)
  teacher = 'pixels in [0, 1]' if mean is None else f'mean {rounded(mean)} std {rounded(std)}'
  normalize = config.dataset.normalize
  student = (f'mean {rounded(config.dataset.mean)} std {rounded(config.dataset.std)}' if normalize == 'fixed'
             else 'its train split\'s mean and std' if normalize == 'standardize' else 'pixels in [0, 1]')
  if teacher != student:
    logging.info('distill.teacher=%s normalises images with %s and the student with %s: the teacher is fed '
                 'the student\'s pixels normalised its own way', spec, teacher, student)


def _normalization(source_config: ml_collections.ConfigDict, record: dict):
  """The teacher's (mean, std) as its train step applied them; None when it saw pixels in [0, 1]."""
  if source_config.dataset.normalize not in ('standardize', 'fixed'):
    return None, None
  norm = record['normalization']
  return np.asarray(norm['mean'], np.float32), np.asarray(norm['std'], np.float32)


def class_order(teacher_names: list[str], run_names: list[str], spec: str) -> Optional[np.ndarray]:
  """Where each of the run's classes is among the teacher's (None when the lists are equal)."""
  if teacher_names == run_names:
    return None
  missing = [name for name in run_names if name not in teacher_names]
  if missing or len(teacher_names) != len(run_names):
    extra = [name for name in teacher_names if name not in run_names]
    raise UserError(f'config.distill.teacher={spec!r} predicts {len(teacher_names)} classes and the data '
                    f'has {len(run_names)}' + (f' (the teacher lacks {missing[:3]})' if missing else '')
                    + (f' (the data lacks {extra[:3]})' if extra else '') + '; distill from a teacher of '
                    'these classes (fine-tune one first with init_from)')
  position = {name: index for index, name in enumerate(teacher_names)}
  return np.asarray([position[name] for name in run_names], np.int32)
