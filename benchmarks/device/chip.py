"""Every model family's train step on one accelerator chip, beside its peers, in one command (issue 51).

    python -m benchmarks.device.chip --only resnets                  # ResNet-50, remat=full, batch 512
    python -m benchmarks.device.chip --only modern                   # ViT-B/16, ConvNeXt-T, Swin-T
    python -m benchmarks.device.chip --only mobile --write-docs      # EfficientNet-B0, MobileNetV3-L; docs
    python -m benchmarks.device.chip                                 # all eight cases, one after another
    python -m benchmarks.device.chip --remat-table --only resnet50,mobilenetv3_l  # the remat table, in three
    python -m benchmarks.device.chip --remat-table --only vit_b16,efficientnet_b0 #   commands of two families
    python -m benchmarks.device.chip --remat-table --only convnext_t,swin_t --write-docs
    python -m benchmarks.device.chip --quick --any-platform --only resnet50          # a smoke run on a CPU

Fitting a device's 10-minute command: on a TPU v5e host (13 cores), where one
train step compiles in 50-90 s, a case costs about 2-3.5 minutes: the process
and the chip starting (~15 s), its contestants compiled at once (~60-110 s),
three interleaved rounds of ~3 s per contestant, and for a family a second
process that loads the step from the persistent cache (~30-40 s). So each of
the three `--only` groups above (estimated 7, 7 and 5 minutes; not yet
measured as groups) fits one 10-minute command, and the whole list (~19
minutes) does not. The remat table costs about 3 minutes a family: two
families a command. Every case prints its seconds and the run's as it goes;
the JSON is written after every case, and `--only` measures some cases
again and keeps the others from `--out` (when the device kind and `--quick`
match), so a run stopped by the command's limit is finished by a second
command naming what is missing. `--timeout-scale` stretches every limit.

The cases (`--only` takes these names, comma-separated, or the groups
resnets, accumulate, modern, mobile, tuned):

  resnet50         ResNet-50 (`resnet50`), beside the Flax ImageNet example's ResNet-50 and SGD
                   step (benchmarks/peers/flax_imagenet_resnet.py) and Keras' `ResNet50`
  resnet50_remat   ResNet-50 with model.remat=full                       (flaxtpu alone)
  resnet50_b512    ResNet-50 at twice the batch (512)                    (flaxtpu alone)
  resnet50_accum2  ResNet-50, 512 images an update as two batches of 256 (optimizer.accumulate_steps=2)
                                                                        (flaxtpu alone)
  vit_b16          ViT-B/16 (`vit_b`)                                    (flaxtpu alone)
  convnext_t       ConvNeXt-T (`convnext_t`), beside Keras' `ConvNeXtTiny`
  swin_t           Swin-T (`swin_t`)                                     (flaxtpu alone)
  swin_t_mlps      Swin-T with model.remat_mlps=1 (its first stage's MLP branches recomputed in the
                   backward pass)                                        (flaxtpu alone)
  efficientnet_b0  EfficientNet-B0 (`efficientnet_b0`), beside Keras' `EfficientNetB0`
  mobilenetv3_l    MobileNetV3-L (`mobilenetv3_l`), beside Keras' `MobileNetV3Large`

What a case measures, each contestant on one random batch that stays on the
chip, bfloat16, batch 256 at 224 px (`--quick`: batch 8 at 32 px, 2 steps):

  - flaxtpu's train step as the CLI builds it: `compile_plan.compile_on_zeros` on
    configs/imagenet_resnet50.py's recipe (SGD + Nesterov, label smoothing, weight decay,
    bfloat16) with `model.name` (and `model.remat`) set, 1000 classes;
  - images/s: after a warm-up, each contestant's steps dispatched back to back (as many as take
    about 3 s, the same count every round), medians of interleaved rounds whose order alternates;
  - MFU: the FLOPs of XLA's cost analysis of the compiled step, per second, over the chip's dense
    bf16 peak (`benchmarks.device.tpu.PEAK_BF16_FLOPS`; None, with the reason, where the peak is unknown:
    a CPU);
  - compile: the train step's trace, lowering and XLA compile (`compile_seconds`, what the CLI's
    log shows) with an empty persistent compilation cache; the peers compile in threads at the
    same time (XLA compiles outside the GIL; `--compile-alone` compiles flaxtpu's step first, on
    its own), then for the families a second process compiles the step again from that cache
    (`warm`: its seconds, the cache's hits and misses);
  - the memory plan: XLA's per-device plan of the compiled step (flaxtpu's compile_plan: argument,
    output, temporary, aliased and total bytes), for the peers too.

The peers: the Flax ImageNet example's step (float32 parameters, bfloat16 compute, SGD + Nesterov,
its L2 penalty) and Keras 3 on the JAX backend: `keras.applications.<Name>(weights=None,
classifier_activation=None)` under `mixed_bfloat16`, SGD + Nesterov momentum 0.9, sparse softmax
cross-entropy on float32 logits; ResNet50's caffe preprocessing in the step, the others' own
preprocessing layers. `--keras-loop stateless` (the default) is Keras' own recipe for a custom JAX
loop: one `jax.jit` of `model.stateless_call` + `jax.value_and_grad` +
`optimizer.stateless_apply`, the state donated, so steps are dispatched back to back as for flaxtpu;
`--keras-loop train_on_batch` (`compile(jit_compile=True)`) times Keras' built-in step instead, which
turns its logs into Python floats after every step (a host sync per step: it cannot run ahead) and
whose FLOPs and memory plan are not read.

`--remat-table`: for each family (resnet50, vit_b16, convnext_t, swin_t, efficientnet_b0,
mobilenetv3_l) the `model.remat` policies none, dots_with_no_batch_dims_saveable, dots_saveable and
full (`--remat-policies` for others of config.REMAT_POLICIES): each policy's step time and memory
plan at batch 256. flaxtpu wraps every block in jax.checkpoint under any policy but none, so `full`
is the issue's "per block" (each block recomputed whole; nothing_saveable compiles to the same);
flaxtpu has no whole-network remat. dots_saveable keeps the outputs of matmuls and convolutions,
dots_with_no_batch_dims_saveable only those of matmuls without batch dimensions. The policies of a
family compile at once in one process, then run one after another, smallest plan first, each freed
after its rounds (so the largest plan runs alone on the chip); a policy that does not fit says so.

Each case (and each family of the remat table) runs in its own process with a time limit, so one
that fails or hangs (a compile that never ends) costs only its case; the JSON (`--out`, default
benchmarks/results/chip.json) is written after every case and holds what a stopped case had
measured. Only one process at a time holds the chip. Without a TPU the cases are skipped, each
with the reason (`--any-platform` runs them anyway, slowly on a CPU, to check the script).
`--write-docs` replaces the "## Every family on a TPU chip" section of docs/performance.md (its
end) with the tables, naming the device, jax version, dates and commands; `--from-json FILE`
renders an earlier run's JSON without measuring.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import sys
import tempfile
import textwrap
import time
from typing import Callable, Optional

from benchmarks.device import tpu
from benchmarks.device.tpu import median, say, write_json  # the helpers of benchmarks/device/tpu.py's rows
from benchmarks.shared import harness

DOCS = harness.ROOT / 'docs' / 'performance.md'
DOCS_HEADING = '## Every family on a TPU chip'
NUM_CLASSES = 1000


@dataclasses.dataclass(frozen=True)
class Case:
  title: str
  model: str  # flaxtpu's model.name
  remat: str = 'none'
  batch_factor: int = 1  # times Sizes.batch
  flax_example: bool = False  # the Flax ImageNet example's ResNet-50 beside it
  keras: str = ''  # a keras.applications model beside it
  family: bool = True  # one of the families: its warm load is measured, it has a remat table
  goal: str = ''  # issue 51's, for the docs table
  overrides: tuple = ()  # (config key, value), e.g. ('model.remat_mlps', 1): an optimisation measured alone


CASES = {
    'resnet50': Case('ResNet-50', 'resnet50', flax_example=True, keras='ResNet50',
                     goal='MFU >= 40% (~1.25x the Flax example); >= 1.3x Keras'),
    'resnet50_remat': Case('ResNet-50, remat=full', 'resnet50', remat='full', family=False),
    'resnet50_b512': Case('ResNet-50, batch 512', 'resnet50', batch_factor=2, family=False,
                          goal='not slower per image than at batch 256'),
    'resnet50_accum2': Case('ResNet-50, 512 images an update in two batches of 256', 'resnet50', family=False,
                            overrides=(('optimizer.accumulate_steps', 2),),
                            goal='faster per image than batch 512 (the same images an update)'),
    'vit_b16': Case('ViT-B/16', 'vit_b', goal='MFU >= 55%'),
    'convnext_t': Case('ConvNeXt-T', 'convnext_t', keras='ConvNeXtTiny', goal='MFU >= 30%; >= 1.3x Keras'),
    'swin_t': Case('Swin-T', 'swin_t', goal='MFU >= 25%; plan < 8 GiB'),
    'swin_t_mlps': Case('Swin-T, first stage\'s MLPs recomputed', 'swin_t', family=False,
                        overrides=(('model.remat_mlps', 1),), goal='plan < 8 GiB at about swin_t\'s speed'),
    'efficientnet_b0': Case('EfficientNet-B0', 'efficientnet_b0', keras='EfficientNetB0',
                            goal='>= 1.3x Keras'),
    'mobilenetv3_l': Case('MobileNetV3-L', 'mobilenetv3_l', keras='MobileNetV3Large',
                          goal='>= 1.3x Keras'),
}
FAMILIES = tuple(name for name, case in CASES.items() if case.family)
# Each group fits one 10-minute command on a TPU v5e host (estimated; see the docstring).
GROUPS = {'resnets': ('resnet50', 'resnet50_remat', 'resnet50_b512'),
          'accumulate': ('resnet50_b512', 'resnet50_accum2'),
          'modern': ('vit_b16', 'convnext_t', 'swin_t'),
          'mobile': ('efficientnet_b0', 'mobilenetv3_l'),
          # An optimisation measured beside its base, in the same run.
          'tuned': ('swin_t', 'swin_t_mlps')}
REMAT_POLICIES = ('none', 'dots_with_no_batch_dims_saveable', 'dots_saveable', 'full')
KERAS_LOOPS = {
    'stateless': 'one jax.jit of model.stateless_call + jax.value_and_grad + optimizer.stateless_apply, '
                 'state donated',
    'train_on_batch': 'model.train_on_batch after compile(jit_compile=True): a host sync every step',
}
# keras.applications.resnet50.preprocess_input ('caffe'): RGB -> BGR, minus these means.
CAFFE_MEAN_BGR = (103.939, 116.779, 123.68)
PLAN_KEYS = ('argument_bytes', 'output_bytes', 'temp_bytes', 'alias_bytes', 'total_bytes')


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What each case measures; `--quick` shrinks everything (a smoke run, in CI on CPU)."""
  batch: int = 256
  image_size: int = 224
  rounds: int = 3  # interleaved rounds per case
  round_seconds: float = 3.0  # each contestant's timed steps per round take about this long
  min_steps: int = 10
  max_steps: int = 200
  warmup_steps: int = 2  # the first runs after a compile allocate; the last one sizes the rounds
  # Seconds each child process may take (times --timeout-scale).
  timeouts: tuple = (('probe', 180), ('cold', 360), ('warm', 150), ('remat', 420))


QUICK = Sizes(batch=8, image_size=32, rounds=2, round_seconds=0.0, min_steps=2, max_steps=2, warmup_steps=1,
              timeouts=(('probe', 120), ('cold', 600), ('warm', 300), ('remat', 900)))


def limit(sizes: Sizes, key: str, scale: float) -> float:
  return scale * dict(sizes.timeouts)[key]


def case_sizes(case: Case, sizes: Sizes) -> Sizes:
  return dataclasses.replace(sizes, batch=sizes.batch * case.batch_factor)


# --- building the contestants (in a case's process) ---------------------------------------------------


def timed(build: Callable[[], dict]) -> dict:
  """`build()`'s entry with `build_seconds`: the whole of it (model, state, trace, lowering, compile)."""
  started = time.perf_counter()
  entry = build()
  entry['build_seconds'] = time.perf_counter() - started
  return entry


def memory_plan_of(compiled) -> dict:
  """XLA's per-device plan of a compiled step, counted as flaxtpu.step.steps counts its own."""
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # a backend without it
    analysis = None
  if analysis is None:
    return {}
  plan = {'argument_bytes': int(analysis.argument_size_in_bytes),
          'output_bytes': int(analysis.output_size_in_bytes),
          'temp_bytes': int(analysis.temp_size_in_bytes), 'alias_bytes': int(analysis.alias_size_in_bytes)}
  plan['total_bytes'] = (plan['argument_bytes'] + plan['output_bytes'] + plan['temp_bytes']
                         - plan['alias_bytes'])
  return plan


def flops_of(compiled) -> float:
  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  if not hasattr(compiled, 'cost_analysis'):  # flaxtpu's step as a closure (a distilling run's)
    return 0.0
  try:
    return flax_imagenet_resnet.flops_of(compiled)
  except Exception:  # pylint: disable=broad-except  # a backend without a cost analysis
    return 0.0


def flaxtpu_config(case: Case, sizes: Sizes, remat: Optional[str] = None):
  """configs/imagenet_resnet50.py at the case's batch and size (`sizes` is case_sizes' answer: scaled by the
  case's batch_factor already), with the case's model and remat."""
  from flaxtpu.validation import config as config_lib  # pylint: disable=g-import-not-at-top
  config = tpu.imagenet_config(sizes)
  config.model.name = case.model
  config.model.remat = remat or case.remat
  config.update_from_flattened_dict(dict(case.overrides))
  config_lib.validate(config)
  return config


def build_flaxtpu(config, sizes: Sizes, images, labels) -> dict:
  from flaxtpu.step import compile_plan  # pylint: disable=g-import-not-at-top
  placement, state, _, step, plan = compile_plan.compile_on_zeros(
      config, image_shape=(sizes.image_size, sizes.image_size, 3), num_classes=NUM_CLASSES)
  batch = placement.put_train_batch((images, labels))
  return {'call': lambda state: step(state, batch), 'state': state,
          'compile_seconds': plan.get('compile_seconds'), 'flops_per_step': flops_of(step),
          'memory_plan': {k: plan[k] for k in PLAN_KEYS if k in plan},
          'how': f'compile_plan.compile_on_zeros, configs/imagenet_resnet50.py, '
                 f'model.name={config.model.name}, model.remat={config.model.remat}'}


def build_flax_example(sizes: Sizes, images, labels) -> dict:
  """benchmarks/peers/flax_imagenet_resnet.py's model, state and step, the compile timed on its own."""
  import functools  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from benchmarks.peers import flax_imagenet_resnet as example  # pylint: disable=g-import-not-at-top
  model = example.ResNet(num_classes=NUM_CLASSES, dtype=jnp.bfloat16)
  state = example.create_state(model, sizes.image_size, sizes.batch)
  step = jax.jit(functools.partial(example.train_step, num_classes=NUM_CLASSES, dtype=jnp.bfloat16),
                 donate_argnums=0)
  images, labels = jax.device_put(images), jax.device_put(labels)
  started = time.perf_counter()
  compiled = step.lower(state, images, labels).compile()
  seconds = time.perf_counter() - started
  return {'call': lambda state: compiled(state, images, labels), 'state': state, 'compile_seconds': seconds,
          'flops_per_step': flops_of(compiled), 'memory_plan': memory_plan_of(compiled),
          'how': 'benchmarks/peers/flax_imagenet_resnet.py: the Flax ImageNet example\'s ResNet-50 and SGD '
                 'step'}


def import_keras():
  os.environ['KERAS_BACKEND'] = 'jax'
  import keras  # pylint: disable=g-import-not-at-top
  if keras.backend.backend() != 'jax':
    raise RuntimeError(f'Keras was imported with backend {keras.backend.backend()!r}, not jax')
  return keras


def build_keras(application: str, sizes: Sizes, images, labels, loop: str) -> dict:
  """keras.applications.<application> under mixed_bfloat16, SGD + Nesterov, in this thread (Keras keeps
  its global dtype policy per thread)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  keras = import_keras()
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  keras.utils.set_random_seed(0)
  model = getattr(keras.applications, application)(
      weights=None, input_shape=(sizes.image_size, sizes.image_size, 3), classes=NUM_CLASSES,
      classifier_activation=None)
  optimizer = keras.optimizers.SGD(learning_rate=0.1 * sizes.batch / 256, momentum=0.9, nesterov=True)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  caffe = application == 'ResNet50'  # the only one of the four without its own preprocessing layers
  common = {'application': application, 'loop': loop, 'keras_version': keras.__version__,
            'parameters': int(sum(np.prod(v.shape) for v in model.trainable_variables))}

  if loop == 'train_on_batch':
    model.compile(optimizer=optimizer, loss=loss_fn, jit_compile=True)
    x = images.astype(np.float32)
    if caffe:
      x = x[..., ::-1] - np.asarray(CAFFE_MEAN_BGR, np.float32)
    x, y = jax.device_put(x), jax.device_put(labels)
    started = time.perf_counter()
    model.train_on_batch(x, y)  # traces and compiles
    seconds = time.perf_counter() - started
    return {'call': lambda state: (state, model.train_on_batch(x, y)), 'state': None,
            'compile_seconds': seconds, 'compile_includes_first_step': True, 'flops_per_step': 0.0,
            'memory_plan': {}, 'flops_missing': 'train_on_batch: its compiled step is not read',
            'how': KERAS_LOOPS[loop], **common}

  optimizer.build(model.trainable_variables)
  mean = jnp.asarray(CAFFE_MEAN_BGR, jnp.float32)

  def train_step(state, images, labels):
    trainable, non_trainable, optimizer_variables = state
    x = images.astype(jnp.float32)
    if caffe:
      x = x[..., ::-1] - mean

    def loss_of(trainable):
      logits, updated = model.stateless_call(trainable, non_trainable, x, training=True)
      return loss_fn(labels, logits.astype(jnp.float32)), updated

    (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
    trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads, trainable)
    return (trainable, non_trainable, optimizer_variables), loss

  state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
           [v.value for v in optimizer.variables])
  images, labels = jax.device_put(images), jax.device_put(labels)
  started = time.perf_counter()
  compiled = jax.jit(train_step, donate_argnums=0).lower(state, images, labels).compile()
  seconds = time.perf_counter() - started
  return {'call': lambda state: compiled(state, images, labels), 'state': state, 'compile_seconds': seconds,
          'flops_per_step': flops_of(compiled), 'memory_plan': memory_plan_of(compiled),
          'how': KERAS_LOOPS[loop], **common}


# --- timing --------------------------------------------------------------------------------------------


def warm_up(entry: dict, sizes: Sizes) -> None:
  """The first steps after the compile; the last one's time sets the steps per round."""
  import jax  # pylint: disable=g-import-not-at-top
  state, seconds = entry['state'], None
  for _ in range(max(1, sizes.warmup_steps)):
    started = time.perf_counter()
    state, metrics = entry['call'](state)
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - started
  entry['state'] = state
  steps = math.ceil(sizes.round_seconds / max(seconds, 1e-6)) if sizes.round_seconds else sizes.min_steps
  entry['steps'] = min(sizes.max_steps, max(sizes.min_steps, steps))


def rate(entry: dict, batch: int) -> float:
  """Images/s of `steps` steps dispatched back to back, as the CLI runs them on an accelerator."""
  import jax  # pylint: disable=g-import-not-at-top
  state = entry['state']
  started = time.perf_counter()
  for _ in range(entry['steps']):
    state, metrics = entry['call'](state)
  jax.block_until_ready((state, metrics))
  entry['state'] = state
  return entry['steps'] * batch / (time.perf_counter() - started)


def summary(entry: dict, rates: list, batch: int, peak: Optional[float], device_kind: str) -> dict:
  """What the JSON keeps of a contestant: its rounds, median, MFU, compile seconds, memory plan."""
  images_per_sec = median(rates)
  flops = entry.get('flops_per_step') or 0.0
  out = {key: entry[key] for key in ('how', 'application', 'loop', 'keras_version', 'parameters',
                                     'compile_includes_first_step') if key in entry}
  out.update(images_per_sec=images_per_sec, rounds=list(rates), steps_per_round=entry.get('steps'),
             step_ms=1e3 * batch / images_per_sec if images_per_sec else None,
             compile_seconds=entry.get('compile_seconds'), build_seconds=entry.get('build_seconds'),
             flops_per_step=flops, flops_per_image=flops / batch,
             tflops_per_sec=flops * images_per_sec / batch / 1e12 if images_per_sec else None,
             memory_plan=entry.get('memory_plan') or {})
  if peak and flops and images_per_sec:
    out['mfu'] = flops * images_per_sec / batch / peak
  else:
    out['mfu'] = None
    out['mfu_missing'] = (entry.get('flops_missing')
                          or ('XLA\'s cost analysis gave no FLOPs' if not flops else
                              f'no dense bf16 peak known for device kind {device_kind!r}' if not peak else
                              'not timed'))
  if entry.get('error'):
    out['error'] = entry['error']
  return out


# --- a case, in its own process -------------------------------------------------------------------------


def cache_dir(args, name: str) -> pathlib.Path:
  return args.workdir / 'jax_cache' / name


def case_cold(args, sizes: Sizes, name: str, report: Callable[[dict], None]) -> dict:
  """Every contestant of the case compiled with an empty compilation cache, then timed in rounds."""
  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  case = CASES[name]
  sizes = case_sizes(case, sizes)
  tpu.use_compilation_cache(cache_dir(args, name))
  facts = tpu.device_facts()
  row = {**facts, 'case': name, 'title': case.title, 'model': case.model, 'remat': case.remat,
         'dtype': 'bfloat16', 'batch': sizes.batch, 'image_size': sizes.image_size, 'rounds': sizes.rounds,
         'contestants': {}}
  say(f'  {case.title} ({case.model}, remat={case.remat}): batch {sizes.batch} at {sizes.image_size} px, '
      f'bfloat16, on {facts["device_kind"]} x{facts["device_count"]} ({facts["platform"]})')
  images, labels = flax_imagenet_resnet.random_batch(sizes.batch, sizes.image_size)
  config = flaxtpu_config(case, sizes)
  builders = {}
  if case.flax_example:
    builders['flax_example'] = lambda: build_flax_example(sizes, images, labels)
  if case.keras:
    builders['keras'] = lambda: build_keras(case.keras, sizes, images, labels, args.keras_loop)
  started = time.perf_counter()
  entries, errors = {}, {}

  def built(contestant: str, entry: dict) -> None:
    entries[contestant] = entry
    say(f'  {contestant} step compiled in {entry["compile_seconds"]:.1f} s (all of its build '
        f'{entry["build_seconds"]:.1f} s, {time.perf_counter() - started:.0f} s into the case)')

  # The peers compile in threads while flaxtpu's step compiles here (XLA compiles outside the GIL):
  # a cold cache costs one wait, not three. --compile-alone: flaxtpu's first, on its own.
  with concurrent.futures.ThreadPoolExecutor(max(1, len(builders))) as pool:

    def start() -> dict:
      return {peer: pool.submit(timed, build) for peer, build in builders.items()}

    futures = {} if args.compile_alone else start()
    built('flaxtpu', timed(lambda: build_flaxtpu(config, sizes, images, labels)))
    row['contestants']['flaxtpu'] = summary(entries['flaxtpu'], [], sizes.batch, facts['peak_bf16_flops'],
                                            facts['device_kind'])
    report(row)
    if args.compile_alone:
      futures = start()
    for peer, future in futures.items():
      try:
        built(peer, future.result())
      except Exception as error:  # pylint: disable=broad-except  # a peer's failure is its own
        errors[peer] = f'{type(error).__name__}: {str(error)[:600]}'
        say(f'  {peer} FAILED to build: {errors[peer]}')
  row['compile_wall_seconds'] = time.perf_counter() - started

  rates = {peer: [] for peer in entries}
  active = []  # the contestants still timed: a failure drops one, and says why
  for peer, entry in entries.items():
    try:
      warm_up(entry, sizes)
      active.append(peer)
    except Exception as error:  # pylint: disable=broad-except  # e.g. out of memory at run time
      errors[peer] = f'{type(error).__name__}: {str(error)[:600]}'
      say(f'  {peer} FAILED in its warm-up: {errors[peer]}')
  say('  steps per round: ' + ', '.join(f'{peer} {entries[peer]["steps"]}' for peer in active))

  def record() -> None:
    for peer in (*entries, *(peer for peer in errors if peer not in entries)):
      entry = {**entries.get(peer, {}), **({'error': errors[peer]} if peer in errors else {})}
      row['contestants'][peer] = summary(entry, rates.get(peer, []), sizes.batch, facts['peak_bf16_flops'],
                                         facts['device_kind'])
    mine = row['contestants']['flaxtpu'].get('images_per_sec')
    row['ratios'] = {peer: mine / measured['images_per_sec'] for peer, measured in row['contestants'].items()
                     if peer != 'flaxtpu' and mine and measured.get('images_per_sec')}
    report(row)

  for round_index in range(sizes.rounds):
    for peer in (list(active) if round_index % 2 == 0 else list(active)[::-1]):
      try:
        rates[peer].append(rate(entries[peer], sizes.batch))
      except Exception as error:  # pylint: disable=broad-except
        errors[peer] = f'{type(error).__name__}: {str(error)[:600]}'
        say(f'  {peer} FAILED in round {round_index + 1}: {errors[peer]}')
        active.remove(peer)
        continue
      say(f'  round {round_index + 1}/{sizes.rounds} {peer:13s} {rates[peer][-1]:9,.0f} img/s')
    record()
  record()
  if 'flaxtpu' in errors:
    raise RuntimeError(f'flaxtpu\'s step failed: {errors["flaxtpu"]}')
  return row


def case_warm(args, sizes: Sizes, name: str, report: Callable[[dict], None]) -> dict:
  """flaxtpu's step compiled again in a new process, from the cache the cold process filled."""
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  case = CASES[name]
  sizes = case_sizes(case, sizes)
  tpu.use_compilation_cache(cache_dir(args, name))
  counts, durations = collections.Counter(), collections.defaultdict(float)
  monitoring.register_event_listener(lambda event, **kwargs: counts.update([event]))
  monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **kwargs: durations.__setitem__(event, durations[event] + seconds))
  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  images, labels = flax_imagenet_resnet.random_batch(sizes.batch, sizes.image_size)
  entry = timed(lambda: build_flaxtpu(flaxtpu_config(case, sizes), sizes, images, labels))
  row = {'compile_seconds': entry['compile_seconds'], 'build_seconds': entry['build_seconds'],
         'cache_hits': counts['/jax/compilation_cache/cache_hits'],
         'cache_misses': counts['/jax/compilation_cache/cache_misses'],
         'cache_retrieval_seconds': durations['/jax/compilation_cache/cache_retrieval_time_sec'],
         'memory_plan': entry['memory_plan']}
  say(f'  flaxtpu step compiled again from the cache in {row["compile_seconds"]:.1f} s (all of its build '
      f'{row["build_seconds"]:.1f} s; cache hits {row["cache_hits"]}, misses {row["cache_misses"]})')
  report(row)
  return row


def remat_family(args, sizes: Sizes, name: str, report: Callable[[dict], None]) -> dict:
  """The family's step under each remat policy: compiled at once, timed one after another."""
  from benchmarks.peers import flax_imagenet_resnet  # pylint: disable=g-import-not-at-top
  case = CASES[name]
  sizes = case_sizes(case, sizes)  # as the cold and warm cases: flaxtpu_config takes the case's sizes
  # Not emptied: a rerun (after a stopped one) loads what was compiled; compile seconds are not its subject.
  tpu.use_compilation_cache(args.workdir / 'jax_cache' / f'remat_{name}')
  facts = tpu.device_facts()
  policies = args.remat_policies
  row = {**facts, 'case': name, 'title': case.title, 'model': case.model, 'batch': sizes.batch,
         'image_size': sizes.image_size, 'rounds': sizes.rounds, 'policies': {}}
  say(f'  {case.title} ({case.model}): remat {", ".join(policies)}, batch {sizes.batch} at '
      f'{sizes.image_size} px')
  images, labels = flax_imagenet_resnet.random_batch(sizes.batch, sizes.image_size)
  started = time.perf_counter()
  entries = {}
  with concurrent.futures.ThreadPoolExecutor(len(policies)) as pool:
    def build(policy: str) -> dict:
      return timed(lambda: build_flaxtpu(flaxtpu_config(case, sizes, policy), sizes, images, labels))

    futures = {policy: pool.submit(build, policy) for policy in policies}
    for policy, future in futures.items():
      try:
        entries[policy] = future.result()
        plan = entries[policy]['memory_plan']
        row['policies'][policy] = {'compile_seconds': entries[policy]['compile_seconds'],
                                   'memory_plan': plan}
        say(f'  {policy}: compiled in {entries[policy]["compile_seconds"]:.1f} s, plan '
            f'{plan.get("total_bytes", 0) / 2**30:.2f} GiB ({time.perf_counter() - started:.0f} s into '
            'the family)')
      except Exception as error:  # pylint: disable=broad-except  # a plan larger than the chip, say
        row['policies'][policy] = {'error': f'{type(error).__name__}: {str(error)[:600]}'}
        say(f'  {policy}: FAILED to compile: {row["policies"][policy]["error"]}')
      report(row)
    del futures  # they hold the states too: each is freed once timed
  order = sorted(entries, key=lambda policy: entries[policy]['memory_plan'].get('total_bytes', 0))
  for policy in order:
    entry = entries.pop(policy)
    try:
      warm_up(entry, sizes)
      rates = [rate(entry, sizes.batch) for _ in range(sizes.rounds)]
      measured = summary(entry, rates, sizes.batch, facts['peak_bf16_flops'], facts['device_kind'])
      row['policies'][policy].update({key: measured[key] for key in (
          'images_per_sec', 'rounds', 'steps_per_round', 'step_ms', 'flops_per_step', 'mfu')})
      say(f'  {policy}: {measured["step_ms"]:.1f} ms/step, {measured["images_per_sec"]:,.0f} img/s')
    except Exception as error:  # pylint: disable=broad-except  # out of memory at run time
      row['policies'][policy]['error'] = f'{type(error).__name__}: {str(error)[:600]}'
      say(f'  {policy}: FAILED to run: {row["policies"][policy]["error"]}')
    del entry  # its state and step: the next policy runs with this one's memory free
    report(row)
  return row


def child(args, sizes: Sizes) -> None:
  """A case's phase (or a remat family) in this process: writes what it measured to --case-out as it goes."""
  out = args.case_out

  def report(row: dict) -> None:
    write_json(out, row)

  try:
    if args.remat_family:
      row = remat_family(args, sizes, args.remat_family, report)
    elif args.phase == 'warm':
      row = case_warm(args, sizes, args.case, report)
    else:
      row = case_cold(args, sizes, args.case, report)
  except Exception as error:  # the case's error goes into the JSON: the driver carries on
    partial = json.loads(out.read_text(encoding='utf-8')) if out.exists() else {}
    partial['error'] = f'{type(error).__name__}: {str(error)[:1000]}'
    write_json(out, partial)
    raise
  report(row)


# --- the driver: a process per case --------------------------------------------------------------------


def child_env() -> dict:
  return {**tpu.chip_env(), 'KERAS_BACKEND': 'jax'}


def common_flags(args) -> list[str]:
  flags = ['--workdir', str(args.workdir), '--keras-loop', args.keras_loop,
           '--remat-policies', ','.join(args.remat_policies)]
  if args.quick:
    flags.append('--quick')
  if args.compile_alone:
    flags.append('--compile-alone')
  return flags


def run_child(args, flags: list[str], out: pathlib.Path, timeout: float) -> dict:
  """A child process with a time limit; what it reported survives a failure, with the error."""
  out.unlink(missing_ok=True)
  command = [sys.executable, '-m', 'benchmarks.device.chip', *flags, '--case-out', str(out),
             *common_flags(args)]
  started = time.perf_counter()
  error = None
  try:
    status = tpu.run_process(command, env=child_env(), timeout=timeout)
    if status:
      error = f'exit status {status}'
  except TimeoutError:
    error = f'timed out after {timeout:.0f} s (its limit)'
  try:
    row = json.loads(out.read_text(encoding='utf-8'))
  except (OSError, ValueError):
    row = {}
  if error:
    row['error'] = f'{row["error"]}; {error}' if row.get('error') else error
  row['process_seconds'] = time.perf_counter() - started
  return row


def run_case(args, sizes: Sizes, name: str) -> dict:
  case = CASES[name]
  tpu.fresh_dir(cache_dir(args, name))  # the cold compile starts from an empty persistent cache
  out = args.workdir / f'case_{name}.json'
  row = run_child(args, ['--case', name, '--phase', 'cold'], out, limit(sizes, 'cold', args.timeout_scale))
  row['cold_process_seconds'] = row.pop('process_seconds')
  compiled = ((row.get('contestants') or {}).get('flaxtpu') or {}).get('compile_seconds')
  if case.family and compiled:
    tpu.chip_pause()
    warm = run_child(args, ['--case', name, '--phase', 'warm'], args.workdir / f'case_{name}_warm.json',
                     limit(sizes, 'warm', args.timeout_scale))
    row['warm'] = warm
  elif case.family:
    row['warm'] = {'skipped': 'the cold process compiled no flaxtpu step'}
  return row


def selected_cases(only: str, remat_table: bool) -> list[str]:
  pool = FAMILIES if remat_table else tuple(CASES)
  if not only:
    return list(pool)
  names = []
  for word in only.replace(' ', '').split(','):
    expanded = GROUPS.get(word, (word,))
    for name in expanded:
      if name not in CASES:
        raise SystemExit(f'error: --only {word!r}: cases are {", ".join(CASES)}; groups {", ".join(GROUPS)}')
      if remat_table and name not in FAMILIES:
        if word == name:
          raise SystemExit(f'error: --remat-table --only {name!r}: the families are {", ".join(FAMILIES)}')
        continue
      names.append(name)
  return [name for name in pool if name in names]


def previous_results(out: pathlib.Path, device: dict, quick: bool) -> dict:
  """An earlier run's cases and remat rows on the same kind of device at the same sizes: kept, so a long
  run can be split over several commands (each entry says which command measured it)."""
  try:
    previous = json.loads(out.read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return {}
  if ((previous.get('device') or {}).get('device_kind') != device.get('device_kind')
      or bool(previous.get('quick')) != quick):
    return {}
  return {'cases': {k: v for k, v in (previous.get('cases') or {}).items() if k in CASES},
          'remat': {k: v for k, v in (previous.get('remat') or {}).items() if k in FAMILIES}}


def drive(args, sizes: Sizes) -> dict:
  command = 'python -m benchmarks.device.chip ' + shlex.join(sys.argv[1:])
  today = datetime.date.today().isoformat()
  run_started = time.perf_counter()
  results = {'command': command, 'date': today, 'quick': args.quick,
             'host': {'cpu_count': os.cpu_count(), 'machine': platform.machine(),
                      'python': platform.python_version()},
             'sizes': {'batch': sizes.batch, 'image_size': sizes.image_size, 'rounds': sizes.rounds,
                       'round_seconds': sizes.round_seconds, 'keras_loop': args.keras_loop,
                       'compile_alone': args.compile_alone},
             'cases': {}, 'remat': {}}
  say(f'== {command}')
  selected = selected_cases(args.only, args.remat_table)
  device = tpu.probe_device(limit(sizes, 'probe', args.timeout_scale))
  results['device'] = device
  reason = '' if device.get('platform') == 'tpu' or args.any_platform else (
      f'no TPU: jax sees {device.get("platform")}' + (f' ({device["error"]})' if device.get('error') else ''))
  say(f'== device: {device.get("device_kind", "?")} x{device.get("device_count", "?")} '
      f'({device.get("platform")}), jax {device.get("jax_version", "?")}; {os.cpu_count()} host cores'
      + (f'; cases skipped: {reason}' if reason else ''))
  kept = previous_results(args.out, device, args.quick)
  section = 'remat' if args.remat_table else 'cases'
  for key in ('cases', 'remat'):
    results[key] = {k: v for k, v in kept.get(key, {}).items() if not (key == section and k in selected)}
  if results['cases'] or results['remat']:
    kept_names = [*results['cases'], *(f'remat {name}' for name in results['remat'])]
    say(f'== keeping from {args.out}: {", ".join(kept_names)}')
  write_json(args.out, results)

  for index, name in enumerate(selected):
    label = f'{"remat table: " if args.remat_table else ""}{name} ({CASES[name].title})'
    if reason:
      say(f'== {label}: skipped ({reason})')
      results[section][name] = {'skipped': reason, 'command': command, 'date': today}
      write_json(args.out, results)
      continue
    say(f'== [{index + 1}/{len(selected)}] {label}, {time.perf_counter() - run_started:.0f} s into the run')
    started = time.perf_counter()
    tpu.chip_pause()  # the probe's (or the previous case's) process has just let go of the chip
    try:
      if args.remat_table:
        row = run_child(args, ['--remat-family', name], args.workdir / f'remat_{name}.json',
                        limit(sizes, 'remat', args.timeout_scale))
      else:
        row = run_case(args, sizes, name)
    except (KeyboardInterrupt, SystemExit):
      partial = args.workdir / (f'remat_{name}.json' if args.remat_table else f'case_{name}.json')
      try:
        row = json.loads(partial.read_text(encoding='utf-8'))
      except (OSError, ValueError):
        row = {}
      results[section][name] = {**row, 'error': 'stopped before the case ended (SIGTERM or Ctrl-C)',
                                'command': command, 'date': today}
      write_json(args.out, results)
      raise
    row['case_seconds'] = time.perf_counter() - started
    results[section][name] = {**row, 'command': command, 'date': today}
    write_json(args.out, results)
    say(f'== {label}: ' + (f'FAILED: {row["error"]}' if row.get('error') else 'done')
        + f' in {row["case_seconds"]:.0f} s; {time.perf_counter() - run_started:.0f} s into the run')
  results['run_seconds'] = time.perf_counter() - run_started
  write_json(args.out, results)
  return results


# --- the tables ------------------------------------------------------------------------------------------


def _gib(plan: dict, key: str = 'total_bytes') -> str:
  return f'{plan[key] / 2**30:.2f}' if plan and plan.get(key) is not None else '-'


def _rate(value: Optional[float]) -> str:
  return f'{value:,.0f} img/s' if value else '-'


def _pct(value: Optional[float]) -> str:
  return f'{100 * value:.1f}%' if value else '-'


def _seconds(value: Optional[float]) -> str:
  return f'{value:.1f} s' if value is not None else '-'


def peer_name(peer: str, entry: dict) -> str:
  if peer == 'flax_example':
    return 'Flax ImageNet example'
  if peer == 'keras':
    return f'Keras-JAX `{entry.get("application", "?")}`'
  return peer


def case_rows(results: dict) -> list[tuple[str, ...]]:
  """(model, flaxtpu img/s, MFU, compile cold / warm, memory plan, peers, flaxtpu / peer, goal) per case."""
  lines = []
  for name, case in CASES.items():
    row = (results.get('cases') or {}).get(name)
    if row is None:
      continue
    label = f'{case.title} (`{case.model}`)'
    if row.get('skipped'):
      lines.append((label, f'skipped: {row["skipped"]}', '', '', '', '', '', case.goal))
      continue
    mine = (row.get('contestants') or {}).get('flaxtpu') or {}
    if not mine.get('images_per_sec'):
      lines.append((label, f'failed: {row.get("error", "no numbers")}', '', '', '', '', '', case.goal))
      continue
    label += f', batch {row["batch"]} at {row["image_size"]} px'
    warm = row.get('warm') or {}
    compile_cell = _seconds(mine.get('compile_seconds'))
    if warm.get('compile_seconds') is not None:
      compile_cell += f' / {_seconds(warm["compile_seconds"])}'
      if not warm.get('cache_hits'):
        compile_cell += ' (no cache hit)'
    elif warm.get('error') or warm.get('skipped'):
      compile_cell += f' / warm failed: {warm.get("error") or warm.get("skipped")}'
    plan = mine.get('memory_plan') or {}
    plan_cell = f'{_gib(plan)} GiB (temporaries {_gib(plan, "temp_bytes")})' if plan else '-'
    peers, ratios = [], []
    for peer, entry in (row.get('contestants') or {}).items():
      if peer == 'flaxtpu':
        continue
      if not entry.get('images_per_sec'):
        peers.append(f'{peer_name(peer, entry)}: failed: {entry.get("error", "not timed")}')
        continue
      peer_plan = entry.get('memory_plan') or {}
      peers.append(f'{peer_name(peer, entry)}: {_rate(entry["images_per_sec"])}'
                   + (f', MFU {_pct(entry["mfu"])}' if entry.get('mfu') else '')
                   + (f', {_gib(peer_plan)} GiB' if peer_plan else '')
                   + f', compile {_seconds(entry.get("compile_seconds"))}')
      ratio = (row.get('ratios') or {}).get(peer)
      ratios.append(f'{ratio:.2f}x' if ratio else '-')
    if row.get('error'):
      peers.append(f'(stopped: {row["error"]})')
    lines.append((label, _rate(mine['images_per_sec']), _pct(mine.get('mfu')), compile_cell, plan_cell,
                  '; '.join(peers) or '-', '; '.join(ratios) or '-', case.goal))
  return lines


def remat_policies_of(results: dict) -> list[str]:
  seen = [policy for row in (results.get('remat') or {}).values() for policy in (row.get('policies') or {})]
  ordered = [policy for policy in REMAT_POLICIES if policy in seen]
  return ordered + [policy for policy in dict.fromkeys(seen) if policy not in ordered]


def remat_rows(results: dict) -> list[tuple[str, ...]]:
  policies = remat_policies_of(results)
  lines = []
  for name in FAMILIES:
    row = (results.get('remat') or {}).get(name)
    if row is None:
      continue
    label = f'{CASES[name].title} (`{CASES[name].model}`)'
    if row.get('skipped'):
      lines.append((label, f'skipped: {row["skipped"]}', *([''] * (len(policies) - 1))))
      continue
    if row.get('batch'):
      label += f', batch {row["batch"]}'
    cells = []
    for policy in policies:
      entry = (row.get('policies') or {}).get(policy) or {}
      if entry.get('step_ms'):
        cells.append(f'{entry["step_ms"]:.1f} ms ({_rate(entry["images_per_sec"])}), '
                     f'{_gib(entry.get("memory_plan") or {})} GiB')
      elif entry.get('error'):
        cells.append(f'failed: {entry["error"][:160]}')
      elif entry.get('memory_plan'):
        cells.append(f'not timed, {_gib(entry["memory_plan"])} GiB')
      else:
        cells.append(f'failed: {row.get("error", "not measured")}' if row.get('error') else '-')
    lines.append((label, *cells))
  return lines


def provenance(results: dict, key: str) -> list[str]:
  """The distinct commands (or dates) that measured the entries: one unless --only split the run."""
  entries = [*(results.get('cases') or {}).values(), *(results.get('remat') or {}).values()]
  values = [entry.get(key) for entry in entries if not entry.get('skipped')] or [results.get(key)]
  return list(dict.fromkeys(value for value in values if value)) or ['?']


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
  lines = ['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join('---' for _ in header) + ' |']
  # A cell stays on its row: an error's newlines (XLA's argument mismatches, say) become spaces.
  cell = lambda text: ' '.join(text.replace('|', '/').split())
  return lines + ['| ' + ' | '.join(cell(text) for text in row) + ' |' for row in rows]


def paragraph(text: str) -> list[str]:
  """`text` wrapped for the docs, never inside a `code span`."""
  parts = ' '.join(text.split()).split('`')
  kept = '`'.join(part.replace(' ', '\0') if index % 2 else part for index, part in enumerate(parts))
  wrapped = textwrap.wrap(kept, 104, break_on_hyphens=False, break_long_words=False)
  return [line.replace('\0', ' ') for line in wrapped] + ['']


def render_section(results: dict) -> str:
  device = results.get('device') or {}
  host = results.get('host') or {}
  sizes = results.get('sizes') or {}
  peak = device.get('peak_bf16_flops')
  loop = sizes.get('keras_loop', 'stateless')
  lines = [DOCS_HEADING, '', *paragraph(
      '`python -m benchmarks.device.chip` (its docstring has the details) times flaxtpu\'s own compiled '
      'train step, as the CLI builds it (`compile_plan.compile_on_zeros` on configs/imagenet_resnet50.py\'s '
      'recipe with '
      '`model.name` set), for every family of issue 51, bfloat16, on one random batch that stays on the '
      'chip, steps dispatched back to back, medians of interleaved rounds; each case in its own process with '
      'a time limit, beside its peers in that process: the Flax ImageNet example\'s ResNet-50 and SGD step '
      '(`benchmarks/peers/flax_imagenet_resnet.py`) and Keras 3 on the JAX backend (`keras.applications`, '
      '`weights=None`, `mixed_bfloat16`, SGD + Nesterov momentum 0.9; its step: '
      f'{KERAS_LOOPS.get(loop, loop)}). MFU: the FLOPs of XLA\'s cost analysis of each compiled step, per '
      'second, over the chip\'s dense bf16 peak'
      + (f' ({peak / 1e12:.0f} TFLOP/s).' if peak else ' (unknown here: no MFU).' if device else '.')
      + ' Compile: the train step\'s trace, lowering and XLA compile with an empty persistent compilation '
      'cache (cold: alone where the command has `--compile-alone`, otherwise while the peers compile '
      'in threads of the same process), then in a second process from '
      'that cache (warm). Memory plan: XLA\'s per-device plan of the step, arguments + outputs + '
      'temporaries - donated buffers, in GiB. flaxtpu / peer above 1: flaxtpu is faster. The goals are '
      'issue 51\'s (and for every family: compiled cold in <= 45 s, warm from the cache). Without a TPU '
      'the cases are skipped, saying why; `--only` measures some cases again and keeps the others, and '
      'every command that measured one is listed.')]
  if not (results.get('cases') or results.get('remat')):
    lines += paragraph(
        'Not measured on a chip yet: run `python -m benchmarks.device.chip --only resnets`, then '
        '`--only modern` '
        'and `--only mobile` (each estimated to fit one 10-minute command on a TPU v5e host), and the remat '
        'table in `--remat-table --only resnet50,mobilenetv3_l`, `--only vit_b16,efficientnet_b0` and '
        '`--only convnext_t,swin_t`, the last with `--write-docs`.')
    return '\n'.join(lines)
  lines += [f'Measured on {device.get("device_kind", "?")} x{device.get("device_count", "?")} '
            f'({device.get("platform", "?")}, jax {device.get("jax_version", "?")}), '
            f'{host.get("cpu_count", "?")} host cores, {", ".join(provenance(results, "date"))}'
            + (', `--quick` sizes' if results.get('quick') else '') + ':', '',
            *(f'    {command}' for command in provenance(results, 'command')), '']
  if results.get('cases'):
    header = ('model', 'flaxtpu', 'MFU', 'compile cold / warm', 'memory plan', 'peers, same chip and run',
              'flaxtpu / peer', 'goal')
    lines += _table(header, case_rows(results)) + ['']
  if results.get('remat'):
    policies = remat_policies_of(results)
    lines += paragraph(
        'remat (`--remat-table`): step time and memory plan of each `model.remat` policy. flaxtpu '
        'wraps every block in `jax.checkpoint` under any policy but none, so `full` is "per block" '
        '(each block recomputed whole; `nothing_saveable` compiles to the same; flaxtpu has no '
        'whole-network remat); `dots_saveable` keeps the outputs of matmuls and convolutions, '
        '`dots_with_no_batch_dims_saveable` only those of matmuls without batch dimensions (no '
        'convolutions, no attention scores).')
    lines += _table(('model', *policies), remat_rows(results)) + ['']
  lines += ['Numbers, per round, in the run\'s JSON (`benchmarks/results/chip.json` by default).', '']
  return '\n'.join(lines)


def write_docs(results: dict, docs: pathlib.Path) -> None:
  """Replaces the section (to the next `## ` heading or the end) or appends it."""
  text = docs.read_text(encoding='utf-8') if docs.exists() else ''
  section = render_section(results)
  start = text.find('\n' + DOCS_HEADING + '\n')
  if start < 0:
    text = text.rstrip('\n') + '\n\n' + section
  else:
    end = text.find('\n## ', start + 1)
    text = text[:start + 1] + section + (text[end + 1:] if end >= 0 else '')
  docs.write_text(text.rstrip('\n') + '\n', encoding='utf-8')
  say(f'wrote the "{DOCS_HEADING}" section of {docs}')


def print_table(results: dict) -> None:
  say('')
  for model, rate_cell, mfu, compile_cell, plan, peers, ratios, _ in case_rows(results):
    details = f', MFU {mfu}, compile cold / warm {compile_cell}, plan {plan}' if compile_cell else ''
    say(f'{model}\n    flaxtpu: {rate_cell}{details}'
        + (f'\n    peers: {peers}\n    flaxtpu / peer: {ratios}' if peers and peers != '-' else ''))
  policies = remat_policies_of(results)
  for model, *cells in remat_rows(results):
    say(f'remat, {model}\n' + '\n'.join(f'    {policy}: {cell}' for policy, cell in zip(policies, cells)))


def main() -> None:
  tpu.exit_on_sigterm()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  groups = '; '.join(f'{name} = {",".join(cases)}' for name, cases in GROUPS.items())
  parser.add_argument('--only', default='', help=f'cases, comma-separated: {", ".join(CASES)}; or groups: '
                      f'{groups}')
  parser.add_argument('--out', type=pathlib.Path, help='the JSON, written after every case',
                      default=harness.ROOT / 'benchmarks' / 'results' / 'chip.json')
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes (batch 8, 32 px, 2 steps): a smoke run')
  parser.add_argument('--remat-table', action='store_true',
                      help='the remat policies of each family (--only: families) instead of the cases')
  parser.add_argument('--remat-policies', type=lambda text: text.split(','), default=list(REMAT_POLICIES),
                      help='comma-separated model.remat values for --remat-table (default '
                      f'{",".join(REMAT_POLICIES)})')
  parser.add_argument('--keras-loop', choices=tuple(KERAS_LOOPS), default='stateless',
                      help='the Keras peers\' step: '
                      + '; '.join(f'{name}: {how}' for name, how in KERAS_LOOPS.items()))
  parser.add_argument('--compile-alone', action='store_true',
                      help='compile flaxtpu\'s step before the peers\' (a clean cold compile; a longer run)')
  parser.add_argument('--write-docs', action='store_true',
                      help=f'replace the "{DOCS_HEADING}" section of docs/performance.md with the tables')
  parser.add_argument('--docs', type=pathlib.Path, default=DOCS, help='the page --write-docs writes')
  parser.add_argument('--from-json', type=pathlib.Path,
                      help='print (and with --write-docs, write) an earlier run\'s JSON; measures nothing')
  parser.add_argument('--workdir', type=pathlib.Path,
                      default=pathlib.Path(tempfile.gettempdir()) / 'flaxtpu_bench_chip',
                      help='scratch: compilation caches, the cases\' partial JSON')
  parser.add_argument('--timeout-scale', type=float, default=1.0,
                      help='multiplies every process\'s time limit')
  parser.add_argument('--any-platform', action='store_true',
                      help='run the cases without a TPU too (slow on a CPU; checks the script)')
  parser.add_argument('--case', choices=tuple(CASES), help=argparse.SUPPRESS)
  parser.add_argument('--phase', choices=('cold', 'warm'), default='cold', help=argparse.SUPPRESS)
  parser.add_argument('--remat-family', choices=FAMILIES, help=argparse.SUPPRESS)
  parser.add_argument('--case-out', type=pathlib.Path, help=argparse.SUPPRESS)
  args = parser.parse_args()
  from flaxtpu.validation.config import REMAT_POLICIES as accepted  # pylint: disable=g-import-not-at-top
  unknown = [policy for policy in args.remat_policies if policy not in accepted]
  if unknown:
    parser.error(f'--remat-policies {",".join(unknown)}: model.remat takes {", ".join(accepted)}')
  args.workdir = args.workdir.resolve()
  sizes = QUICK if args.quick else Sizes()
  if args.case or args.remat_family:
    child(args, sizes)
    return
  if args.from_json:
    results = json.loads(args.from_json.read_text(encoding='utf-8'))
  else:
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = drive(args, sizes)  # writes --out after every case
    say(f'wrote {args.out}')
  print_table(results)
  if args.write_docs:
    write_docs(results, args.docs)


if __name__ == '__main__':
  main()
