"""Input throughput: flaxtpu's streaming pipeline against tf.data doing the same work, side by side.

    python -m benchmarks.data.make_image_folder --out /data/gen1000           # once: 100,000 mixed-size JPEGs
    python -m benchmarks.input.input_pipeline --folder /data/gen1000 [--image-size 224] [--workers N] \
        [--seconds 10]
    python -m benchmarks.input.input_pipeline --folder /data/gen1000 --feed-devices  # consumed as in training
    FLAXTPU_CIFAR10=DIR python -m benchmarks.input.input_pipeline --mode cifar [--model cnn]

Folder mode (the default when --folder is given) times, on the same folder
and the same files in the same order:

- flaxtpu: `pipeline.load` with `dataset.cache=none` (a header scan, no pixels)
  and `loaders.train_batches` with --workers worker processes (default: every
  core). Each image is read, given an Inception-style random crop (area
  0.08-1, aspect 3/4-4/3), decoded only as finely as that crop needs (libjpeg-turbo
  DCT scaling, through simplejpeg for plain JPEGs), resized to --image-size
  (OpenCV bilinear, area when shrinking) into uint8 [B, N, N, 3] batches. No flip: flaxtpu flips on the device
  (`config.augment.flip`, `augment.random_flip`, one select per image inside the
  jitted step, cheap there), so its host pipeline has none to do.
- flaxtpu with threads: the same, with `Dataset.worker_threads` (--workers threads of this process,
  no shared-memory hand-over of the batches).
- tf.data: the classic TPU ResNet-50 input: `tf.io.read_file` ->
  `tf.image.sample_distorted_bounding_box` (the same ranges, min_object_covered
  0.1, 10 attempts) -> `tf.image.decode_and_crop_jpeg` -> random flip ->
  `tf.image.resize` (bilinear) -> uint8, `map(num_parallel_calls=AUTOTUNE)`,
  `batch`, `prefetch(AUTOTUNE)`, GPUs hidden from TensorFlow.

With --feed-devices, every contestant's batches are consumed as the trainer consumes them (put on
the devices in a prefetch thread, a jitted step that reads every pixel waited on in the main
thread; see `fed_to_devices`): what decides whether threads, which share the GIL with those two,
keep up inside a training run.

Last, one thread builds --gil-batches batches while the calls that release the GIL are timed: the
rest of its time holds the GIL, which caps what any number of input threads in one process can
build (`gil_held_per_image`).

Each round times both (which goes first alternates) on its own steps for at
least --seconds, after warm-up batches (worker start-up, AUTOTUNE ramp-up),
over a whole number of worker cycles (see `time_batches`); every file a round
reads is read once before any timing, so both find them in the page cache. Reports
the medians, flaxtpu / tf.data (the median of the per-round ratios; goal: >= 1), images/s per core
(os.cpu_count()) and per CPU-second the pipeline actually used, and what that
means in host cores per accelerator for ResNet-50 at published per-chip rates.

Cifar mode (the default without --folder; what `make bench` runs) is the
earlier measurement: is the in-memory CIFAR pipeline (index, slice, prefetch,
host -> device transfer, jitted crop + flip + normalise) ever what the train
step waits on? Its images/s against the step's on the same batches.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import os
import time

import numpy as np

from benchmarks.shared import harness

# ResNet-50 training rates per accelerator (images/s), to turn a host rate into host cores per
# accelerator. Approximations: the real rate depends on precision, batch size and software version.
RESNET50_IMAGES_PER_SEC = {
    # NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
    # performance: NVIDIA DGX A100 (8x A100 80GB)": 2,470 img/s on 1 GPU, mixed precision, DALI input
    # (16,621 on 8 GPUs, 2,078 each). MLPerf Training ResNet-50 submissions run at a similar per-GPU rate.
    'A100 GPU': 2500,
    # Google's MLPerf Training ResNet-50 results on TPU v4 pods work out to a few thousand img/s per
    # chip; v4 has ~2.2x the bf16 peak of v3 (275 vs 123 TFLOP/s), whose chips trained at ~2,000 img/s.
    'TPU v4 chip': 3000,
}


# --- folder mode: flaxtpu vs tf.data ------------------------------------------------------------


def time_batches(iterator, warmup: int, seconds: float, max_batches: int, period: int) -> dict:
  """Images/s after `warmup` untimed batches, over at least `seconds` (a multiple of `period` batches,
  at most `max_batches`); the CPU we used (with the worker processes; the main process's share is what
  receiving the batches costs flaxtpu) and the cores other processes kept busy meanwhile.

  Grain hands batch i to worker i mod W, and each worker builds one batch at a time (flaxtpu gives
  it no read threads), so a cycle is W batches. A window of whole cycles, from one batch's arrival
  to another's at the same place in the cycle, times the steady rate without counting batches that
  were already waiting.
  """
  for _ in range(warmup):
    next(iterator)
  images = count = 0
  with harness.cpu_load() as load:
    started = time.perf_counter()
    while count < max_batches:
      images += len(next(iterator)[0])
      count += 1
      if count % period == 0 and time.perf_counter() - started >= seconds:
        break
  return {'images_per_sec': images / load['seconds'], 'seconds': load['seconds'], 'batches': count,
          'cpu_seconds': load['cpu_seconds'], 'main_process_cpu_seconds': load['main_process_cpu_seconds'],
          'images_per_cpu_second': images / max(load['cpu_seconds'], 1e-9),
          'other_cpu_load': load['other_cpu_load']}


def fed_to_devices(iterator, sharding):
  """`iterator`'s batches as the trainer consumes them: put on the devices in a prefetch thread
  (train.py's `workers.prefetch(placement.put_train_batch(...))`), and a jitted step that reads
  every pixel dispatched and waited on in this thread, as the train loop's thread does. The
  threads that build batches then share the GIL with both, as they do in training."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import workers  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import parallel  # pylint: disable=g-import-not-at-top

  step = jax.jit(lambda images: jnp.mean(images, dtype=jnp.float32))
  with workers.prefetch(parallel.to_global(tuple(batch)[:2], sharding) for batch in iterator) as batches:
    for images, labels in batches:
      jax.block_until_ready(step(images))
      yield images, labels


def gil_held_per_image(dataset, batch_size: int, steps: range) -> dict:
  """Seconds per image that building `steps`' batches in one thread holds the GIL: the wall time
  minus the time inside the calls that release it (libjpeg-turbo's decode, OpenCV's resize). A
  process's input threads together build at most 1 / that many images per second, whatever the
  cores; the file reads and header parses count as held (a bound from above)."""
  import cv2  # pylint: disable=g-import-not-at-top
  import simplejpeg  # pylint: disable=g-import-not-at-top

  from flaxtpu.data import loaders  # pylint: disable=g-import-not-at-top
  released = [0.0]

  def timed(function):
    def call(*args, **kwargs):
      started = time.perf_counter()
      try:
        return function(*args, **kwargs)
      finally:
        released[0] += time.perf_counter() - started
    return call

  def batches(first_step, last_step):  # built by one background thread (workers=0)
    return loaders.train_batches(dataclasses.replace(dataset, workers=0), seed=0, batch_size=batch_size,
                                 first_step=first_step, last_step=last_step)

  originals = simplejpeg.decode_jpeg, cv2.resize
  simplejpeg.decode_jpeg, cv2.resize = timed(simplejpeg.decode_jpeg), timed(cv2.resize)
  try:
    for _ in batches(steps.start, steps.start + 1):  # warm-up
      pass
    released[0], images = 0.0, 0
    started = time.perf_counter()
    for batch in batches(steps.start, steps.stop):
      images += len(batch.images)
    wall = time.perf_counter() - started
  finally:
    simplejpeg.decode_jpeg, cv2.resize = originals
  return {'seconds_per_image': wall / images, 'gil_free_seconds_per_image': released[0] / images,
          'gil_held_seconds_per_image': (wall - released[0]) / images,
          'threads_ceiling_images_per_sec': images / (wall - released[0])}


def tf_batches(tf, paths: list[str], labels: list[int], batch_size: int, image_size: int,
               crop_area: tuple, crop_aspect: tuple):
  """The TPU ResNet-50 recipe's training input in tf.data, over `paths` in this order."""

  def parse(path, label):
    encoded = tf.io.read_file(path)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.image.extract_jpeg_shape(encoded),
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4]), min_object_covered=0.1,
        aspect_ratio_range=crop_aspect, area_range=crop_area, max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    offset_y, offset_x, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(size)
    image = tf.image.decode_and_crop_jpeg(encoded, tf.stack([offset_y, offset_x, height, width]), channels=3)
    image = tf.image.random_flip_left_right(image)
    image = tf.image.resize(image, [image_size, image_size], method='bilinear')
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8), label

  dataset = tf.data.Dataset.from_tensor_slices((paths, labels))
  dataset = dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
  dataset = dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
  return dataset.as_numpy_iterator()


def read_files(paths: list[str]) -> int:
  """Reads every file once (into the page cache); returns the bytes read."""

  def size(path: str) -> int:
    with open(path, 'rb') as f:
      return len(f.read())

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    return sum(pool.map(size, paths))


def folder_mode(args) -> dict:
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  from configs import cifar10  # pylint: disable=g-import-not-at-top
  from flaxtpu.data import loaders, pipeline, sampling  # pylint: disable=g-import-not-at-top

  workers = args.workers if args.workers is not None else os.cpu_count() or 1
  period = workers  # batches per cycle (see time_batches)
  warmup = args.warmup if args.warmup is not None else max(16, 4 * period)
  config = cifar10.get_config()
  config.dataset.folder, config.dataset.image_size = args.folder, args.image_size
  config.dataset.cache, config.input.workers = 'none', workers
  started = time.perf_counter()
  dataset = pipeline.load(config)
  load_seconds = time.perf_counter() - started
  train = dataset.train
  print(f'{args.folder}: {len(train):,} train images, {dataset.num_classes} classes; '
        'pipeline.load (header scan, '
        f'{workers} workers) {load_seconds:.1f} s', flush=True)

  max_batches = -(-args.max_batches // period) * period  # whole cycles (see time_batches)
  per_round = warmup + max_batches
  rounds = []  # (steps, indices): the examples flaxtpu reads for those steps, in its order
  for round_index in range(args.rounds):
    steps = range(round_index * per_round, (round_index + 1) * per_round)
    rounds.append((steps, np.concatenate([sampling.train_indices(0, step, len(train), args.batch_size)
                                          for step in steps])))
  unique = [train.source.load(int(i))[0] for i in np.unique(np.concatenate([i for _, i in rounds]))]
  started = time.perf_counter()
  size = read_files(unique)
  print(f'read the {len(unique):,} files the rounds use ({size / 2**20:,.0f} MiB) once first, into the '
        f'page cache: {time.perf_counter() - started:.1f} s', flush=True)

  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], 'GPU')
  crop_area, crop_aspect = tuple(config.augment.crop_area), tuple(config.augment.crop_aspect)

  if args.feed_devices:
    from flaxtpu.step import parallel  # pylint: disable=g-import-not-at-top
    sharding = parallel.batch_sharding(parallel.make_mesh(config))
    consumed = functools.partial(fed_to_devices, sharding=sharding)
  else:
    consumed = iter

  def measure_flaxtpu(steps, indices, threads=False) -> dict:
    del indices  # flaxtpu finds them itself: the same ones
    batches_iter = consumed(loaders.train_batches(
        dataclasses.replace(dataset, worker_threads=threads), seed=0, batch_size=args.batch_size,
        first_step=steps.start, last_step=steps.stop, alternate_flip=config.augment.alternate_flip))
    try:
      return time_batches(batches_iter, warmup, args.seconds, max_batches, period)
    finally:
      batches_iter.close()  # stops the worker processes

  def measure_flaxtpu_threads(steps, indices) -> dict:
    return measure_flaxtpu(steps, indices, threads=True)

  def measure_tf(steps, indices) -> dict:
    del steps
    examples = [train.source.load(int(i)) for i in indices]
    iterator = consumed(tf_batches(tf, [path for path, _ in examples], [label for _, label in examples],
                                   args.batch_size, args.image_size, crop_area, crop_aspect))
    del examples
    try:
      return time_batches(iterator, warmup, args.seconds, max_batches, period)
    finally:
      if hasattr(iterator, 'close'):
        iterator.close()

  measured = {'flaxtpu': [], 'flaxtpu_threads': [], 'tf_data': []}
  order = [('flaxtpu', measure_flaxtpu), ('flaxtpu_threads', measure_flaxtpu_threads),
           ('tf_data', measure_tf)]
  for round_index, round_files in enumerate(rounds):
    for name, measure in (order if round_index % 2 == 0 else order[::-1]):
      measured[name].append(measure(*round_files))
      print(f'  round {round_index + 1}/{args.rounds} {name:15s} '
            f'{measured[name][-1]["images_per_sec"]:8,.0f} img/s'
            f'  (others kept {measured[name][-1]["other_cpu_load"]:.1f} cores busy)', flush=True)

  gil = gil_held_per_image(dataset, args.batch_size,
                           range(rounds[-1][0].stop, rounds[-1][0].stop + args.gil_batches))
  print(f'one thread holds the GIL {1e3 * gil["gil_held_seconds_per_image"]:.3f} ms of the '
        f'{1e3 * gil["seconds_per_image"]:.3f} ms an image takes: one process\'s threads build at most '
        f'{gil["threads_ceiling_images_per_sec"]:,.0f} img/s, on any number of cores', flush=True)

  cores = os.cpu_count() or 1
  result = {'mode': 'folder', 'gil': gil, 'folder': args.folder, 'train_images': len(train),
            'image_size': args.image_size, 'batch_size': args.batch_size, 'seconds': args.seconds,
            'max_batches': max_batches, 'warmup_batches': warmup, 'cycle_batches': period,
            'rounds': args.rounds, 'workers': workers, 'cpu_count': cores,
            'data_load_seconds': load_seconds, 'feed_devices': args.feed_devices,
            'host_flip': {'flaxtpu': False, 'tf_data': True}}
  for name, rows in measured.items():
    result[name] = {'images_per_sec': harness.median(rows, 'images_per_sec'),
                    'images_per_sec_per_core': harness.median(rows, 'images_per_sec') / cores,
                    'images_per_cpu_second': harness.median(rows, 'images_per_cpu_second'),
                    'other_cpu_load': harness.median(rows, 'other_cpu_load'), 'rounds': rows}
  for name, rows in measured.items():  # ratios per round (measured side by side), then their median
    result[name]['cpu_seconds_per_image'] = 1 / result[name]['images_per_cpu_second']
    if name != 'tf_data':
      ratios = [row['images_per_sec'] / tf_row['images_per_sec']
                for row, tf_row in zip(rows, measured['tf_data'])]
      result[name]['ratio_over_tf_data_per_round'] = ratios
      result[name]['ratio_over_tf_data'] = harness.median(ratios)
  flaxtpu, threads = result['flaxtpu'], result['flaxtpu_threads']
  result['ratio_flaxtpu_over_tf_data'] = flaxtpu['ratio_over_tf_data']
  result['ratio_flaxtpu_threads_over_tf_data'] = threads['ratio_over_tf_data']
  result['resnet50_images_per_sec_assumed'] = RESNET50_IMAGES_PER_SEC
  # Per CPU-second actually used: the machine is shared, so per wall-clock core undercounts.
  result['host_cores_per_accelerator'] = {
      name: {chip: rate * result[name]['cpu_seconds_per_image']
             for chip, rate in RESNET50_IMAGES_PER_SEC.items()}
      for name in measured}

  for name, label in (('flaxtpu', f'flaxtpu ({workers} processes)'),
                      ('flaxtpu_threads', f'flaxtpu ({workers} threads)'),
                      ('tf_data', 'tf.data (AUTOTUNE)')):
    row = result[name]
    print(f'{label:28s} {row["images_per_sec"]:8,.0f} img/s  '
          f'{row["images_per_sec_per_core"]:6,.0f} img/s per core ({cores} cores), '
          f'{row["images_per_cpu_second"]:5,.0f} per CPU-second used '
          f'({1e3 * row["cpu_seconds_per_image"]:.2f} CPU-ms per image)')
  print(f'flaxtpu / tf.data = {result["ratio_flaxtpu_over_tf_data"]:.2f}x with processes, '
        f'{result["ratio_flaxtpu_threads_over_tf_data"]:.2f}x with threads '
        f'(goal >= 1.0; medians of the per-round ratios, {args.rounds} interleaved rounds of '
        f'>= {args.seconds:g} s, '
        f'batches of {args.batch_size} at {args.image_size}x{args.image_size})')
  print('note: tf.data flips on the host; flaxtpu flips on the device (augment.flip, cheap there), so its '
        'host pipeline does not')
  for name in measured:
    needed = ', '.join(f'{chip} (~{rate:,} img/s): {result["host_cores_per_accelerator"][name][chip]:.1f}'
                       for chip, rate in RESNET50_IMAGES_PER_SEC.items())
    print(f'host cores per accelerator to feed ResNet-50, {name}: {needed}')
  print('(per CPU-second used; approximate per-chip training rates; these JPEGs are smaller than '
        'ImageNet\'s, so real photos need more)')
  return result


# --- cifar mode: the in-memory pipeline vs the train step it feeds -----------------------------


def cifar_mode(args) -> dict:
  harness.cpu_devices(args.cpu_devices)
  import jax  # pylint: disable=g-import-not-at-top

  from configs import cifar10_resnet  # pylint: disable=g-import-not-at-top
  from flaxtpu.augmentation import augment  # pylint: disable=g-import-not-at-top
  from flaxtpu.data import loaders, pipeline, workers  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings.lengths import run_length  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import parallel, placing, steps  # pylint: disable=g-import-not-at-top

  batches = args.batches
  config = cifar10_resnet.get_config()  # crop + flip + standardise: the heaviest recipe
  config.dataset.folder, config.model.name, config.batch_size = args.data, args.model, args.batch_size
  dataset = pipeline.load(config)
  length = run_length(config, len(dataset.train))
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length)
  placement = placing.place(task, parallel.make_mesh(config), config)
  state = placing.create_state(task, placement, config.seed)

  @jax.jit
  def augment_on_device(key, images):
    positions = jax.numpy.arange(images.shape[0])
    return augment.normalize(augment.augment_batch(key, images, positions, task.augment), task.mean, task.std)

  def device_batches(first_step, count):
    return workers.prefetch(placement.put_train_batch(tuple(batch)[:2]) for batch in loaders.train_batches(
        dataset, seed=0, batch_size=args.batch_size, first_step=first_step, last_step=first_step + count,
        alternate_flip=config.augment.alternate_flip))

  def pipeline_rate(first_step):
    key = jax.random.PRNGKey(0)
    started = time.perf_counter()
    with device_batches(first_step, batches) as device_iter:
      for images, _ in device_iter:
        out = augment_on_device(key, images)
    jax.block_until_ready(out)
    return batches * args.batch_size / (time.perf_counter() - started)

  with device_batches(0, 1) as first:
    step_fn, _ = placement.compile_train_step(state, next(first))

  def step_rate(state, first_step):
    with device_batches(first_step, args.steps) as device_iter:
      step_batches = list(device_iter)  # already on device: time the step only
    jax.block_until_ready(step_batches)
    started = time.perf_counter()
    for batch in step_batches:
      state, _ = step_fn(state, batch)
      jax.block_until_ready(state)
    return state, args.steps * args.batch_size / (time.perf_counter() - started)

  pipeline_rate(0)  # warm-up: compile the augmentation, fill caches
  state, _ = step_rate(state, 0)
  pipeline, step = [], []
  for repeat in range(args.rounds):
    pipeline.append(pipeline_rate(1000 * (repeat + 1)))
    state, rate = step_rate(state, 1000 * (repeat + 1))
    step.append(rate)
  result = {'mode': 'cifar', 'model': args.model, 'batch_size': args.batch_size,
            'devices': jax.device_count(), 'pipeline_images_per_sec': harness.median(pipeline),
            'step_images_per_sec': harness.median(step),
            'pipeline_repeats': pipeline, 'step_repeats': step}
  result['ratio'] = result['pipeline_images_per_sec'] / result['step_images_per_sec']
  print(f'input pipeline {result["pipeline_images_per_sec"]:9.0f} img/s   train step ({args.model}) '
        f'{result["step_images_per_sec"]:7.0f} img/s   pipeline / step = {result["ratio"]:.1f}x')
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--mode', choices=('folder', 'cifar'), default=None,
                      help='folder (flaxtpu vs tf.data; the default with --folder) or cifar (the default '
                      'without: the in-memory CIFAR pipeline vs the train step)')
  parser.add_argument('--folder', help='folder mode: an image folder (split/class/image), e.g. one made by '
                      'python -m benchmarks.data.make_image_folder')
  parser.add_argument('--image-size', type=int, default=224, help='folder mode')
  parser.add_argument('--workers', type=int, default=None,
                      help='folder mode: flaxtpu\'s input worker processes (default: one per core)')
  parser.add_argument('--warmup', type=int, default=None,
                      help='folder mode: untimed batches first (default: 4 cycles, at least 16)')
  parser.add_argument('--feed-devices', action='store_true',
                      help='folder mode: consume each batch as the trainer does (onto the devices in a '
                      'prefetch thread, then a jitted step waited on), not just take it')
  parser.add_argument('--gil-batches', type=int, default=20,
                      help='folder mode: batches built in one thread to time how long it holds the GIL')
  parser.add_argument('--batch-size', type=int, default=128)
  parser.add_argument('--seconds', type=float, default=10.0,
                      help='folder mode: time each pipeline at least this long per round')
  parser.add_argument('--max-batches', type=int, default=4000,
                      help='folder mode: ... but for at most this many batches')
  parser.add_argument('--batches', type=int, default=40, help='cifar mode: pipeline batches per round')
  parser.add_argument('--rounds', type=int, default=3, help='interleaved rounds; medians are reported')
  parser.add_argument('--data', default=os.environ.get('FLAXTPU_CIFAR10', ''),
                      help='cifar mode: the CIFAR-10 image folder (default: $FLAXTPU_CIFAR10)')
  parser.add_argument('--model', default='resnet20', help='cifar mode: the model whose train step is timed')
  parser.add_argument('--steps', type=int, default=10, help='cifar mode: train steps per round')
  parser.add_argument('--cpu-devices', type=int, default=8, help='cifar mode')
  parser.add_argument('--out', default=None, help='default: benchmarks/results/local/input_pipeline.json '
                      '(folder mode) or input_pipeline_cifar_MODEL.json (cifar mode)')
  args = parser.parse_args()
  mode = args.mode or ('folder' if args.folder else 'cifar')
  if mode == 'folder' and not args.folder:
    parser.error('folder mode needs --folder (make one with python -m benchmarks.data.make_image_folder)')
  if mode == 'cifar' and not os.path.isdir(args.data):
    parser.error('cifar mode needs the CIFAR-10 image folder: --data DIR or FLAXTPU_CIFAR10=DIR')
  result = folder_mode(args) if mode == 'folder' else cifar_mode(args)
  name = 'input_pipeline.json' if mode == 'folder' else f'input_pipeline_cifar_{args.model}.json'
  harness.write_results(args.out or harness.RESULTS / name, result)


if __name__ == '__main__':
  main()
