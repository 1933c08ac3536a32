"""The checks of how a run runs and what it leaves: devices and the mesh, the loop's intervals, checkpoints
and the best one, early stopping, evaluation and its few-shot probes, predict, the compilation cache.
No JAX at import."""

from __future__ import annotations

import ml_collections

from flaxtpu.io import files  # no JAX at import
from flaxtpu.settings.errors import ConfigError
from flaxtpu.settings.metric_names import early_stopping_metric
from flaxtpu.validation.values import eval_metric, one_of, positive

PARALLELISMS = ('jit', 'pmap')
PLATFORMS = ('', 'cpu', 'gpu', 'tpu')
# config.cpu_convolutions -> the XLA flag that selects it (set by main before JAX starts). XLA:CPU (jaxlib
# >= 0.9) runs convolutions through YNNPACK by default; without it, Eigen's kernels (2 cores, median images/s
# of a bare train step: FastNet at batch 1024 132 against 97, the Keras CNN 1,975 against 1,604, ResNet-20
# 172 against 182).
YNN_FUSION_FLAG = '--xla_cpu_experimental_ynn_fusion_type'
CPU_CONVOLUTION_FLAGS = {'xla': '', 'eigen': f'{YNN_FUSION_FLAG}=-individual_convolution'}


def check_parallelism(config: ml_collections.ConfigDict) -> None:
  one_of('parallelism', config.parallelism, PARALLELISMS)
  positive('mesh.data', config.mesh.data, allow=(-1,))
  positive('mesh.fsdp', config.mesh.fsdp, allow=(-1,))
  if config.mesh.data == -1 and config.mesh.fsdp == -1:
    raise ConfigError('config.mesh.data and config.mesh.fsdp are both -1; at most one can take '
                      'the remaining devices')
  if config.parallelism == 'pmap' and config.mesh.fsdp not in (1,):
    raise ConfigError(f'config.mesh.fsdp={config.mesh.fsdp} needs parallelism=jit; pmap only '
                      'replicates parameters (set --config.mesh.fsdp=1 or --config.parallelism=jit)')
  one_of('require_platform', config.require_platform, PLATFORMS)
  if config.cpu_devices < 0:
    raise ConfigError(f'config.cpu_devices={config.cpu_devices} must be >= 0 (0 = XLA default)')
  one_of('cpu_convolutions', config.cpu_convolutions, tuple(CPU_CONVOLUTION_FLAGS))


def check_loop(config: ml_collections.ConfigDict) -> None:
  positive('log_every_steps', config.log_every_steps)
  if config.profile_steps < 0 or config.log_every_secs < 0:
    raise ConfigError('config.profile_steps and config.log_every_secs must be >= 0 (0 = off)')
  positive('eval_every_steps', config.eval_every_steps, allow=(-1,))
  positive('checkpoint_every_steps', config.checkpoint_every_steps, allow=(-1,))


def check_checkpoint(config: ml_collections.ConfigDict) -> None:
  checkpoint = config.checkpoint
  positive('checkpoint.keep', checkpoint.keep)
  metrics = ('eval_accuracy', 'eval_loss', 'eval_balanced_accuracy', 'eval_map', 'eval_map_micro', 'eval_f1')
  one_of('checkpoint.best_metric', checkpoint.best_metric,
          ('auto', '', *metrics, *(f'{metric}{suffix}' for metric in metrics for suffix in ('_ema', '_swa'))))
  one_of('checkpoint.best_mode', checkpoint.best_mode, ('max', 'min'))
  if checkpoint.min_interval_secs < 0:
    raise ConfigError(f'config.checkpoint.min_interval_secs={checkpoint.min_interval_secs} must be >= 0 '
                      '(0 = a checkpoint every epoch)')
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


def check_early_stopping(config: ml_collections.ConfigDict) -> None:
  stopping = config.early_stopping
  one_of('early_stopping.mode', stopping.mode, ('auto', 'max', 'min'))
  positive('early_stopping.patience', stopping.patience)
  if not stopping.min_delta >= 0:
    raise ConfigError(f'config.early_stopping.min_delta={stopping.min_delta!r} must be >= 0')
  if stopping.metric == 'auto' and not config.checkpoint.best_metric:
    raise ConfigError("config.early_stopping.metric='auto' follows checkpoint.best_metric, which is '' "
                      '(none); name the metric, e.g. --config.early_stopping.metric=eval_loss')
  if stopping.metric:
    eval_metric('early_stopping.metric', early_stopping_metric(config))


def check_eval(config: ml_collections.ConfigDict) -> None:
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
  positive('eval.fewshot.seeds', fewshot.seeds)
  positive('eval.fewshot.l2_reg', fewshot.l2_reg)
  if config.task == 'multilabel':
    raise ConfigError('config.eval.fewshot probes one class per image and this run is task=multilabel; '
                      'leave eval.fewshot.shots empty')


def check_predict(config: ml_collections.ConfigDict) -> None:
  positive('predict.top_k', config.predict.top_k)


def check_compilation_cache(config: ml_collections.ConfigDict) -> None:
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
