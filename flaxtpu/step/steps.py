"""The train state and the pure step functions.

Read top to bottom: what a task is (model, optimizer, preprocessing), the
state it trains, then the step functions (pure: state and batch in, state and
metrics out). How they run on the devices (`jax.jit` over a mesh or `jax.pmap`)
is `placing.py`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from flaxtpu import models
from flaxtpu.augmentation import augment
from flaxtpu.augmentation.image_sizes import resize_batch
from flaxtpu.io import metrics
from flaxtpu.loss import bce
from flaxtpu.loss.losses import batch_accuracy, label_targets, loss_per_example  # noqa: F401  (re-exported)
from flaxtpu.optimizers import loss_scale, optim, optim_contrib, step_inputs, swa
from flaxtpu.settings.lengths import RunLength
from flaxtpu.step import gradients, parallel
from flaxtpu.validation.config import check_against_data

# --- the task and its state ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
  """The static parts that the step functions close over."""
  model: nn.Module
  num_classes: int
  image_shape: tuple[int, int, int]
  augment: ml_collections.ConfigDict
  label_smoothing: float
  mean: Optional[np.ndarray]  # per-channel standardisation; None keeps [0, 1]
  std: Optional[np.ndarray]
  optimizer: Optional[optax.GradientTransformation] = None  # None: inference only
  schedule: Optional[optax.Schedule] = None
  # The run's numbers that the placed train step takes as an input (step_inputs.py), and the optimizer built
  # from them (the same chain as `optimizer`); None where a schedule replaces the config's (lr_find, a
  # time budget): those steps keep their numbers as constants.
  numbers: Optional[dict] = None
  optimizer_for: Optional[Callable[[Any], optax.GradientTransformation]] = None
  param_groups: optim.ParamGroups = optim.ParamGroups()  # frozen parameters keep their BatchNorm statistics
  ema_decay: float = 0.0  # 0: no EMA of the weights
  ema_warmup: bool = False
  accumulate_steps: int = 1  # batches per optimizer update
  flip_tta: bool = False  # inference averages the logits of each image and its mirror
  translate_tta: int = 0  # ... and of copies shifted this many pixels diagonally both ways (0 = none)
  multilabel: bool = False  # a sigmoid per class (any number of tags per image) instead of a softmax
  class_weights: Optional[np.ndarray] = None  # float32 [classes]: the train loss's weights (None = 1)
  teacher: Any = None  # distill.Teacher: a frozen teacher's predictions join the targets (None = no teacher)
  # normalised train images -> {parameter name: value} set before step 1 (the family's `data_fit`), or None
  data_fit: Optional[Callable[[np.ndarray], dict]] = None
  temperature: float = 1.0  # inference logits are divided by it (WORKDIR/calibration.json; 1 = as trained)
  sam_rho: float = 0.0  # > 0: SAM's gradient (sam.py), two passes per step
  sam_adaptive: bool = False  # ASAM
  loss_scaled: bool = False  # float16: a dynamic loss scale in the optimizer state (loss_scale.py)
  bce: Any = None  # loss=bce: a bce.Bce, the train loss a sigmoid per class (None = softmax)
  train_size: int = 0  # augment.train_sizes: the train step resizes batches to this side (0 = as given)
  swa_every: int = 0  # > 0: every this many steps from swa_start the weights join a running mean (swa.py)
  swa_start: int = 0


def _remat(config: ml_collections.ConfigDict) -> str:
  """model.remat as the model wraps its blocks: 'auto' is chosen before training
  (`remat_choice.resolve`); elsewhere (evaluation, export) nothing is differentiated, so none."""
  return 'none' if config.model.remat == 'auto' else config.model.remat


def create_task(config: ml_collections.ConfigDict, *, num_classes: int,
                image_shape: tuple[int, int, int], mean, std,
                length: Optional[RunLength] = None, class_weights: Optional[np.ndarray] = None,
                teacher=None, temperature: float = 1.0, schedule: Optional[optax.Schedule] = None) -> Task:
  """The model and preprocessing a config describes; with a run `length`, also its optimizer.
  `temperature`: calibration's (`flaxtpu.report.calibration`), applied by `logits_fn` for eval, predict and
  export.

  `class_weights` (the dataset's, float32 [classes]) weigh the train loss; evaluation is unweighted.
  `teacher` (a `distill.Teacher`) distils into the model. `schedule` replaces the config's (lr_find).
  """
  check_against_data(config, image_shape, num_classes)
  model = models.create(
      config.model.name, num_classes=num_classes, dtype=config.dtype, remat=_remat(config),
      bn_axis_name=parallel.PMAP_AXIS if config.parallelism == 'pmap' else None,
      **{key: config.model[key] for key in models.OPTIONS})
  numbers = step_inputs.of(config, length) if length and schedule is None else None
  optimizer, schedule = (optim.create_optimizer(config, length, schedule, numbers) if length
                         else (None, None))
  optimizer_for = ((lambda traced: optim.create_optimizer(config, length, numbers=traced)[0])
                   if numbers else None)
  standardize = config.dataset.normalize in ('standardize', 'fixed')
  return Task(model=model, num_classes=num_classes, image_shape=tuple(image_shape),
              augment=config.augment, label_smoothing=config.label_smoothing,
              mean=np.asarray(mean, np.float32) if standardize else None,
              std=np.asarray(std, np.float32) if standardize else None,
              optimizer=optimizer, schedule=schedule, numbers=numbers, optimizer_for=optimizer_for,
              param_groups=optim.ParamGroups.from_config(config),
              ema_decay=config.ema.decay, ema_warmup=config.ema.warmup,
              accumulate_steps=config.optimizer.accumulate_steps, flip_tta=config.eval.flip_tta,
              translate_tta=config.eval.translate_tta, multilabel=config.task == 'multilabel',
              class_weights=None if class_weights is None else np.asarray(class_weights, np.float32),
              teacher=teacher, data_fit=models.data_fit(config.model.name), temperature=float(temperature),
              sam_rho=config.optimizer.sam_rho, sam_adaptive=config.optimizer.sam_adaptive,
              loss_scaled=config.dtype == 'float16' and optimizer is not None, bce=bce.from_config(config),
              swa_every=config.swa.every if optimizer else 0,
              swa_start=swa.start_step(config, length.total_steps) if optimizer and config.swa.every else 0)


class TrainState(flax.struct.PyTreeNode):
  """Everything that changes during training; all of it goes into a checkpoint."""
  step: jax.Array
  params: Any
  batch_stats: Any  # BatchNorm running statistics ({} for models without BatchNorm)
  opt_state: Any
  rng: jax.Array  # base key: step `s` augments with fold_in(rng, s), so resuming replays it
  ema: Any  # {'params', 'batch_stats'}: exponential moving averages of both ({} without ema.decay)
  swa: Any = flax.struct.field(default_factory=dict)  # swa.py's running mean ({} without swa.every)


class ModelState(flax.struct.PyTreeNode):
  """What inference needs of a checkpoint: no optimizer, no step, no data key."""
  params: Any
  batch_stats: Any


def init_model(task: Task, seed: int) -> ModelState:
  params_key, _ = jax.random.split(jax.random.PRNGKey(seed))
  variables = task.model.init(params_key, jnp.zeros((1, *task.image_shape)), train=False)
  return ModelState(params=variables['params'], batch_stats=variables.get('batch_stats', {}))


DATA_FIT_IMAGES = 5_000  # train images that a data-fitted layer (the whitening stem) is estimated from


def fits_to_data(task: Task) -> bool:
  """Whether a fresh run sets some parameters from training images before step 1 (`fit_to_data`)."""
  return task.data_fit is not None


def fit_to_data(task: Task, images: np.ndarray) -> dict[str, np.ndarray]:
  """{parameter name: value} fitted to uint8 train `images` [N, H, W, C] by the family's `data_fit`.

  The images are normalised as the train step normalises them (augmentation aside).
  """
  pixels = augment.normalize(images, task.mean, task.std)  # on a numpy array it stays numpy, on the host
  return task.data_fit(pixels)


def init_state(task: Task, seed: int, fitted: Optional[dict] = None) -> TrainState:
  """A fresh state; `fitted` ({parameter name: value}, from `fit_to_data`) replaces initial values."""
  model = init_model(task, seed)
  if fitted:
    shapes = {name: leaf.shape for name, leaf in optim.named_leaves(model.params).items()}
    for name, value in fitted.items():  # a programming error, not a user's: fail loudly
      assert shapes.get(name) == value.shape, f'fitted {name} {value.shape} vs parameter {shapes.get(name)}'
    model = model.replace(params=jax.tree_util.tree_map_with_path(
        lambda path, leaf: fitted.get(optim.path_name(path), leaf), model.params))
  _, data_key = jax.random.split(jax.random.PRNGKey(seed))
  ema = {'params': model.params, 'batch_stats': model.batch_stats} if task.ema_decay else {}
  return TrainState(step=jnp.zeros((), jnp.int32), params=model.params,
                    batch_stats=model.batch_stats, opt_state=task.optimizer.init(model.params),
                    rng=data_key, ema=ema,
                    swa=swa.init(model.params, model.batch_stats) if task.swa_every else {})


def ema_view(state: TrainState) -> TrainState:
  """`state` with its EMA weights and statistics in place of the raw ones: what eval_step scores."""
  return state.replace(params=state.ema['params'], batch_stats=state.ema['batch_stats'])


def ema_decay(task: Task, updates_before: jax.Array) -> jax.Array:
  """The decay of the update after `updates_before` optimizer updates.

  With `ema.warmup` it is min(decay, (1 + n) / (10 + n)), as TensorFlow's
  ExponentialMovingAverage with num_updates: early averages follow the fast-
  moving weights instead of staying near the random initialisation.
  """
  decay = jnp.float32(task.ema_decay)
  if task.ema_warmup:
    updates = updates_before.astype(jnp.float32)
    decay = jnp.minimum(decay, (1.0 + updates) / (10.0 + updates))
  return decay


def update_ema(task: Task, state: TrainState, new_variables: dict, did_update: jax.Array) -> dict:
  """The EMA after one train step: moved toward the new weights only on steps that updated them."""
  decay = ema_decay(task, state.step // task.accumulate_steps)
  moved = jax.tree.map(lambda average, new: decay * average + (1.0 - decay) * new, state.ema, new_variables)
  return jax.tree.map(lambda m, old: jnp.where(did_update, m, old), moved, state.ema)


# --- pure steps ------------------------------------------------------------------


def _batch_positions(local_size: int, axis_name: Optional[str]) -> jax.Array:
  """Each example's row in the global batch (pmap shards see their offset)."""
  offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * local_size
  return offset + jnp.arange(local_size)


def _mean(x, axis_name: Optional[str]):
  return x if axis_name is None else jax.lax.pmean(x, axis_name)


# Augmentation folds example positions (< 2**31) into the step key; dropout's key is this tag beyond them.
_DROPOUT_STREAM = 2**32 - 1


def _dropout_key(step_key: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """Dropout/drop-path randomness, a function of (seed, step): resumed runs replay it bit for bit.

  Under pmap each device draws its own masks, as different rows of one global batch do under jit.
  """
  key = jax.random.fold_in(step_key, _DROPOUT_STREAM)
  return key if axis_name is None else jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def train_metrics_collection(task: Task):
  """The clu collection a train step returns: loss and accuracy (and the teacher's term when distilling)."""
  if task.loss_scaled:
    return loss_scale.Metrics
  return task.teacher.metric_collection if task.teacher else metrics.Metrics


@jax.jit
def merge_metrics(merged, more):
  """Two clu collections of one kind merged by one compiled program: an evaluation's batches, one
  dispatch each, not one per metric (the train loop's window: loop/window.py)."""
  return merged.merge(more)


def train_step(state: TrainState, batch, numbers: Optional[dict] = None,
               teacher_variables: Optional[ModelState] = None, *, task: Task,
               axis_name: Optional[str] = None):
  """One batch of (uint8 images, labels) -> (new state, clu metrics): an optimizer update, or
  one of `optimizer.accumulate_steps` batches whose mean gradient makes one.

  `numbers` (the task's `numbers` as arrays: learning rate, decay, momentum,
  run length, label smoothing...) are the optimizer's and the loss's; without
  them the task's are compiled in as constants.

  `axis_name` is None under jit (XLA sees the global batch); under pmap it
  names the device axis that gradients and metrics are averaged over. With a
  `task.teacher`, `teacher_variables` are its frozen weights (see distill.py).
  """
  images, labels = batch
  key = jax.random.fold_in(state.rng, state.step)
  positions = _batch_positions(len(images), axis_name)
  images = augment.augment_batch(key, images, positions, task.augment)
  images = resize_batch(images, task.train_size)  # progressive resizing (image_sizes.py)
  images = augment.normalize(images, task.mean, task.std)
  images = augment.erase_batch(key, images, positions, task.augment)  # timm: on normalised pixels
  # Smoothing is linear, so mixing first gives the same targets and keeps the mixed hard labels
  # that weigh each example by class. Multilabel smoothing is timm's BinaryCrossEntropy: a tag is
  # 1 - s + s / C, an absent one s / C (the same formula as optax.smooth_labels).
  teacher = task.teacher
  targets = label_targets(labels, task)
  if teacher and not teacher.sees_mixed_images:  # its targets for the images before mixing, mixed as labels
    teacher_logits = teacher.logits(teacher_variables, images, task.mean, task.std)
    targets = jnp.concatenate([targets, teacher.targets(teacher_logits)], axis=-1)
  images, targets = augment.mix_batch(key, images, targets, positions, task.augment)
  hard_targets, teacher_targets = targets[:, :task.num_classes], targets[:, task.num_classes:]
  if teacher and teacher.sees_mixed_images:  # function matching: it scores the very image the student sees
    teacher_targets = teacher.targets(teacher.logits(teacher_variables, images, task.mean, task.std))
  optimizer = task.optimizer_for(numbers) if numbers else task.optimizer
  targets = optax.smooth_labels(hard_targets, numbers['label_smoothing'] if numbers else task.label_smoothing)
  rngs = {'dropout': _dropout_key(key, axis_name)}  # unused (and compiled away) without dropout

  def loss_fn(params):
    logits, updates = task.model.apply({'params': params, 'batch_stats': state.batch_stats},
                                       images, train=True, mutable=['batch_stats'], rngs=rngs)
    losses = loss_per_example(logits, targets, hard_targets, multilabel=task.multilabel,
                              class_weights=task.class_weights, bce=task.bce)
    kl = teacher.kl(logits, teacher_targets) if teacher else jnp.zeros_like(losses)
    if teacher:
      losses = teacher.combine(losses, kl)
    return losses.mean(), (logits, updates.get('batch_stats', state.batch_stats), kl.mean())

  # Schedule-free keeps its averaged weights in params; its gradient is taken at another point.
  point = optim_contrib.gradient_point(state.opt_state, state.params)
  gradient = gradients.compute(loss_fn, point, state.opt_state, sam_rho=task.sam_rho,
                               sam_adaptive=task.sam_adaptive, param_groups=task.param_groups,
                               axis_name=axis_name)
  loss, (logits, batch_stats, kl) = gradient.loss, gradient.aux
  updates, opt_state = optimizer.update(gradient.grads, gradient.opt_state, point)
  params = optim_contrib.averaged(opt_state, optax.apply_updates(point, updates), state.params)
  if task.param_groups:  # frozen arrays and their modules' BatchNorm statistics carried over as they are
    params, batch_stats = task.param_groups.keep_frozen(state.params, params, state.batch_stats,
                                                        batch_stats)
  new_state = state.replace(step=state.step + 1, params=params, batch_stats=batch_stats,
                            opt_state=opt_state)
  if task.ema_decay:
    new_state = new_state.replace(ema=update_ema(
        task, state, {'params': params, 'batch_stats': batch_stats}, optim.updated(opt_state)))
  if task.swa_every:
    new_state = new_state.replace(swa=swa.update(task, state.swa, state.step + 1, params,
                                                 optim.updated(opt_state)))
  accuracy = _mean(jnp.mean(batch_accuracy(logits, labels, task.multilabel)), axis_name)
  loss, kl = _mean(loss, axis_name), _mean(kl, axis_name)
  if gradient.loss_scale is None:
    return new_state, train_metrics_collection(task).single_from_model_output(
        loss=loss, accuracy=accuracy, distill_kl=kl)
  # float16: an overflow keeps everything but the step count and the (halved) loss scale.
  kept = loss_scale.keep_if_finite(gradient.finite, new_state.replace(opt_state=opt_state),
                                   state.replace(step=state.step + 1, opt_state=gradient.opt_state))
  new_state = kept.replace(opt_state=loss_scale.put(kept.opt_state, loss_scale.get(gradient.opt_state)))
  step_metrics = loss_scale.Metrics.single_from_model_output(
      loss=loss, accuracy=accuracy, reported=gradient.reported, loss_scale=gradient.loss_scale,
      skipped=~gradient.finite)
  return new_state, step_metrics


AUGMENTED_SAMPLE_IMAGES = 16  # the first images of a run's first batch, augmented for TensorBoard


def augmented_sample(settings: ml_collections.ConfigDict, seed: int, step: int,
                     images: np.ndarray) -> np.ndarray:
  """The first images of step `step`'s batch as its train step augments them (`settings`:
  config.augment), before mixup/CutMix (for TensorBoard)."""
  _, data_key = jax.random.split(jax.random.PRNGKey(seed))  # TrainState.rng, as init_state draws it
  key = jax.random.fold_in(data_key, step)
  return np.asarray(augment.augment_batch(key, jnp.asarray(images), jnp.arange(len(images)), settings))


def logits_fn(state: TrainState | ModelState, images, *, task: Task):
  """Inference: uint8 images -> float32 logits (BatchNorm uses its running statistics).

  With `eval.flip_tta` the logits are the mean of the image's and its mirror's.
  With `eval.translate_tta` = t they are half the image's, plus a quarter each
  of the image shifted t pixels down-right and up-left (edges reflected), each
  view flip-averaged too with flip_tta: airbench's multi-crop TTA. A calibrated task's temperature
  divides them here, the one place eval, predict and export share (argmax unchanged).
  """
  logits = _tta_logits(state, images, task)
  return logits if task.temperature == 1.0 else logits / task.temperature


def _tta_logits(state: TrainState | ModelState, images, task: Task):
  """The model's logits of `images`, averaged over the test-time augmentation's views."""
  images = augment.normalize(images, task.mean, task.std)
  apply = lambda x: task.model.apply({'params': state.params, 'batch_stats': state.batch_stats}, x,
                                     train=False)
  view = (lambda x: 0.5 * (apply(x) + apply(x[:, :, ::-1]))) if task.flip_tta else apply
  t = task.translate_tta
  if not t:
    return view(images)
  height, width = images.shape[1:3]
  padded = jnp.pad(images, ((0, 0), (t, t), (t, t), (0, 0)), mode='reflect')
  down_right, up_left = padded[:, :height, :width], padded[:, 2 * t:, 2 * t:]
  return 0.5 * view(images) + 0.25 * (view(down_right) + view(up_left))


def eval_step(state: TrainState | ModelState, batch, *, task: Task, axis_name: Optional[str] = None):
  """Masked metrics of a (padded) eval batch, as clu metrics summed over devices; and its logits.

  The loss is unweighted and unsmoothed. Multiclass: loss, accuracy, balanced accuracy (and top-5
  accuracy above 5 classes). Multilabel: the loss only; its ranking metrics need every example's
  logits (`evaluate.evaluate`).
  """
  images, labels, mask = batch
  logits = logits_fn(state, images, task=task)
  hard_targets = label_targets(labels, task)
  outputs = dict(loss=loss_per_example(logits, hard_targets, hard_targets, multilabel=task.multilabel),
                 mask=mask)
  collection = metrics.LossMetrics
  if not task.multilabel:
    outputs.update(accuracy=batch_accuracy(logits, labels, multilabel=False), label_one_hot=hard_targets)
    collection = metrics.EvalMetrics
  if not task.multilabel and task.num_classes > 5:
    top5 = jax.lax.top_k(logits, 5)[1]
    outputs['top5_accuracy'] = jnp.any(top5 == labels[:, None], axis=-1).astype(jnp.float32)
    collection = metrics.EvalTop5Metrics
  if axis_name is None:
    return collection.single_from_model_output(**outputs), logits
  return collection.gather_from_model_output(axis_name=axis_name, **outputs), logits
