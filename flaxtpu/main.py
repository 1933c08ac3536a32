"""The command line: parse flags, validate the config, start JAX, run one mode.

    python -m flaxtpu.main --config=configs/cifar10.py --workdir=runs/cifar10 [--config.KEY=VALUE ...]
    python -m flaxtpu.main --config=configs/cifar10.py --workdir=runs/cifar10 --mode=eval

Nothing here imports JAX at module level: XLA reads its flags (such as the
CPU device count) when JAX starts, so the config decides them first.
"""

import concurrent.futures
import contextlib
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import threading
import time
import traceback
from typing import NamedTuple

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from flaxtpu.data import memory  # no JAX inside either
from flaxtpu.io import files, storage  # no JAX inside either
from flaxtpu.io import workdir as workdir_checks
from flaxtpu.loop.signals import StopRequest
from flaxtpu.settings.errors import UserError
from flaxtpu.settings.lengths import resolved_eval_batch_size
from flaxtpu.validation import config as config_lib  # no JAX inside: safe before XLA's flags are set
from flaxtpu.validation.config import CPU_CONVOLUTION_FLAGS, YNN_FUSION_FLAG

IMPORTED_AT = time.time()  # the command's start where the process's cannot be read (not Linux)
FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py or experiments/*.py).',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Run directory: config.json, metrics.jsonl, TensorBoard '
                    'events, checkpoints/, results.json.')
flags.DEFINE_enum('mode', 'train',
                  ['train', 'eval', 'predict', 'export', 'plan', 'audit', 'calibrate', 'lr_find'],
                  'train (resumes from the workdir); eval, predict, export or calibrate (restore a '
                  'checkpoint of --workdir; --config defaults to the one it trained with); plan (compile the '
                  'train step and report its memory); audit (duplicates, leaks, unreadable files and '
                  'suspected wrong labels of the dataset -> WORKDIR/audit.json); lr_find (a learning-rate '
                  'range test: lr_find.json, lr_find.png).')
RESTORING_MODES = ('eval', 'predict', 'export', 'audit', 'calibrate')
flags.DEFINE_string('coordinator_address', None, 'Many hosts: HOST:PORT of process 0.')
flags.DEFINE_integer('num_processes', None, 'Many hosts: the number of processes.')
flags.DEFINE_integer('process_id', None, 'Many hosts: this process\'s index.')


def _parse_flags(argv):
  """absl's parser, but a bad flag, config file or config override becomes one `error:` line."""
  storage.configure()  # before any library reads a gs:// workdir (its config.json is read below)
  if (spec := _flag_value(argv, 'config')) is not None:
    path = spec.split(':', 1)[0]  # FILE:ARG passes ARG to get_config
    _check_config_path(path)
    # Experiments build on recipes (`from configs import ...`): make their project root importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(path))))
  argv = _with_workdir_config(argv)
  try:
    return FLAGS(argv)
  except ConfigFileError as e:
    _exit_with_error(str(e))
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError) as e:
    _exit_with_error(_flag_error(e, argv))


class ConfigFileError(Exception):
  """A config file that gives no config; the message names the file, the line and the reason.

  Not a ValueError: absl would rewrap that as a flag error around a traceback.
  """


class ConfigFileParser(flags.ArgumentParser):
  """--config=FILE[:ARG] -> FILE's get_config(ARG), locked, as ml_collections' own parser does.

  Its parser lets a syntax error or an exception in get_config escape as a
  traceback, defers a failed import until the config is first read, and
  passes on a get_config that returns None or a dict; here each is one line.
  """

  def parse(self, argument):
    path, *args = argument.split(':', 1)
    try:
      loader = importlib.machinery.SourceFileLoader('config_config', path)  # ml_collections' module name
      module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
      sys.modules[loader.name] = module
      loader.exec_module(module)
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigFileError(_config_file_error(path, e)) from e
    get_config = getattr(module, 'get_config', None)
    if not callable(get_config):
      raise ConfigFileError(f'config file {path} defines no get_config(); define one that returns the '
                            'config (see configs/cifar10.py)')
    where = f'config file {path}' + (f', line {get_config.__code__.co_firstlineno}'
                                     if hasattr(get_config, '__code__') else '')
    try:
      inspect.signature(get_config).bind(*args)
    except TypeError as e:
      problem = (f'cannot take the argument {args[0]!r} given after the colon; pass --config={path}'
                 if args else f'needs an argument; pass one after a colon: --config={path}:VALUE')
      raise ConfigFileError(f'{where}: get_config{inspect.signature(get_config)} {problem}') from e
    try:
      config = get_config(*args)
    except Exception as e:  # pylint: disable=broad-except
      from flaxtpu.validation import workdir_config  # pylint: disable=g-import-not-at-top
      if os.path.abspath(path) == os.path.abspath(workdir_config.__file__):  # the run's config.json
        raise ConfigFileError(f'--workdir={args[0]}: {_first_line(e)}; point --workdir at a trained run, '
                              'or pass its --config') from e
      raise ConfigFileError(_config_file_error(path, e)) from e
    if not isinstance(config, ml_collections.ConfigDict):
      returned = 'None (no return statement?)' if config is None else f'a {type(config).__name__}'
      raise ConfigFileError(f'{where}: get_config() returned {returned}, not an ml_collections ConfigDict; '
                            'return flaxtpu.settings.defaults.get_config() with your changes')
    _check_config_keys(where, config)
    config.lock()
    return config

  def flag_type(self):
    return 'config object'


FLAGS['config'].parser = ConfigFileParser()  # DEFINE_config_file keeps the --config.KEY overrides


def _config_file_error(path: str, error: Exception) -> str:
  """'FILE, line N: reason; fix' for an exception raised while loading a config file."""
  if isinstance(error, SyntaxError) and error.filename:
    where, reason = f'{error.filename}, line {error.lineno}', f'{type(error).__name__}: {error.msg}'
  else:
    frames = traceback.extract_tb(error.__traceback__)
    # The config file's own line that failed, also when the error comes from what it calls.
    in_file = [frame for frame in frames if os.path.abspath(frame.filename) == os.path.abspath(path)]
    frame = (in_file or frames)[-1]
    where = f'{frame.filename}, line {frame.lineno}'
    text = str(error.args[0] if isinstance(error, KeyError) and error.args else error).strip()
    if (locked := re.search(r'Key "(\w+)" does not exist and cannot be added', text)):
      suggestion = re.search(r'Did you mean "(\w+)"', text)
      hint = f' (did you mean {suggestion.group(1)!r}?)' if suggestion else ''
      return (f'{where}: sets config key {locked.group(1)!r}, which does not exist{hint}; '
              'every key is listed in flaxtpu/settings/defaults.py')
    reason = _first_line(error)
  return f'config file {where}: {reason}; fix the file or pass another --config'


def _first_line(error: Exception) -> str:
  text = str(error.args[0] if isinstance(error, KeyError) and error.args else error).strip()
  return f'{type(error).__name__}: {text.splitlines()[0]}' if text else type(error).__name__


def _check_config_keys(where: str, config: ml_collections.ConfigDict) -> None:
  """A ConfigDict built without flaxtpu's defaults would fail at its first missing key, as a bug."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  present = set(config_lib.config_keys(config))
  missing = [key for key in config_lib.config_keys(defaults.get_config()) if key not in present]
  if missing:
    shown = ', '.join(missing[:3]) + (f' and {len(missing) - 3} more' if len(missing) > 3 else '')
    raise ConfigFileError(f'{where}: get_config() returned a config without the keys {shown}; build it '
                          'on flaxtpu.settings.defaults.get_config()')


def _flag_value(argv, name: str):
  """The value of --NAME=V or --NAME V in argv, before absl has parsed it (None if absent)."""
  for index, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and index + 1 < len(argv):
      return argv[index + 1]
  return None


def _with_workdir_config(argv):
  """Without --config, eval/predict/export use the config the run in --workdir trained with."""
  if _flag_value(argv, 'config') is not None or _flag_value(argv, 'mode') not in RESTORING_MODES:
    return argv
  workdir = _flag_value(argv, 'workdir')
  from flaxtpu.validation import workdir_config  # pylint: disable=g-import-not-at-top
  if _flag_value(argv, 'config.init_from.checkpoint') and not files.isfile(
      os.path.join(workdir or '', workdir_config.CONFIG_FILE)):
    # Published weights with no trained run: every key at its default, the model from the weights.
    from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
    return [argv[0], f'--config={defaults.__file__}', *argv[1:]]
  if not workdir:
    _exit_with_error('--workdir is required: the trained run to restore')
  if not files.isfile(os.path.join(workdir, workdir_config.CONFIG_FILE)):
    _exit_with_error(f'--workdir={workdir} holds no {workdir_config.CONFIG_FILE} of a training run; '
                     'point --workdir at a trained run, or pass its --config')
  return [argv[0], f'--config={workdir_config.__file__}:{workdir}', *argv[1:]]


def _check_config_path(path: str) -> None:
  if os.path.isfile(path):
    return
  is_folder = os.path.isdir(path)  # --config=configs: the recipes in it
  folder = path if is_folder else os.path.dirname(path) or '.'
  problem = 'is a folder, not a config file' if is_folder else 'does not exist'
  _exit_with_error(f'--config={path} {problem}; config files in {folder}: {files.python_files(folder)}')


def _flag_error(error: Exception, argv) -> str:
  """One line for a failed parse: an unknown config key gets a did-you-mean."""
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  known_keys = config_lib.config_keys(defaults.get_config())
  for arg in argv:
    key = arg[len('--config.'):].split('=', 1)[0] if arg.startswith('--config.') else None
    if key and key not in known_keys:
      return (f'--config.{key}: not a config key{config_lib.did_you_mean(key, known_keys)} '
              '(every key is listed in flaxtpu/settings/defaults.py)')
  # KeyError's str() is its repr; its message is the argument.
  text = str(error.args[0] if isinstance(error, KeyError) and error.args else error).strip()
  message = text.splitlines()[0] if text else type(error).__name__
  return f'{message} (see --helpfull; every key is listed in flaxtpu/settings/defaults.py)'


def _exit_with_error(message: str):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def cpu_xla_flags(config, mode: str, xla_flags: str) -> tuple[str, str]:
  """(XLA_FLAGS for this run, a log line or ''): the CPU device count and convolution kernels.

  Flags the user set in XLA_FLAGS win over the config.
  """
  note = ''
  if config.cpu_devices and '--xla_force_host_platform_device_count' not in xla_flags:
    # As many CPU devices as asked for that the batches still divide over.
    eval_batch_size = resolved_eval_batch_size(config)
    if mode == 'predict':  # latency-bound: one device answered a batch of 64 in 5.3 ms, eight in 7.1
      cpu_devices, reason = 1, 'prediction is faster on one'
    else:
      cpu_devices = math.gcd(config.cpu_devices, config.batch_size, eval_batch_size)
      reason = f'batch sizes {config.batch_size}/{eval_batch_size} must divide over them'
    if cpu_devices != config.cpu_devices:
      note = f'using {cpu_devices} CPU devices, not config.cpu_devices={config.cpu_devices}: {reason}'
    xla_flags = f'{xla_flags} --xla_force_host_platform_device_count={cpu_devices}'
  if (flag := CPU_CONVOLUTION_FLAGS[config.cpu_convolutions]) and YNN_FUSION_FLAG not in xla_flags:
    xla_flags = f'{xla_flags} {flag}'
  return xla_flags.strip(), note


def _set_xla_flags(config, mode: str) -> None:
  """XLA's CPU device count and kernels, read when JAX starts: set before anything imports it."""
  os.environ['XLA_FLAGS'], note = cpu_xla_flags(config, mode, os.environ.get('XLA_FLAGS', ''))
  if note:
    logging.info(note)
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def _size_tpu_transfer_buffer(config) -> None:
  """The host buffer a TPU runtime maps as it starts, for transfers to and from its chips:
  `tpu_premapped_buffer_mib` per chip of this host (read before the runtime starts).

  The runtime's default, 4 GiB whatever the chips, took 6.8 s of a 7.2 s start on a TPU v5e host;
  256 MiB started in 1.4 s and moved batches as fast (docs/configuration.md). Transfers up to the
  buffer's size go through it: the runtime's default threshold is its default size, which a
  smaller buffer could not serve.
  """
  if not config.tpu_premapped_buffer_mib or 'TPU_PREMAPPED_BUFFER_SIZE' in os.environ:
    return
  try:  # the chips on this host's PCI bus, as JAX counts them before it starts the runtime
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
  except (ImportError, AttributeError, OSError):
    chips = 0
  if chips:
    size = str(config.tpu_premapped_buffer_mib * chips << 20)
    os.environ['TPU_PREMAPPED_BUFFER_SIZE'] = size
    os.environ.setdefault('TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES', size)


def _start_jax(config):
  """Joins the cluster, turns on the compilation cache, starts the devices in the background."""
  import jax  # pylint: disable=g-import-not-at-top
  _size_tpu_transfer_buffer(config)
  if FLAGS.coordinator_address or (FLAGS.num_processes or 1) > 1 or _in_detectable_cluster():
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    # Arguments left None: JAX reads them from the SLURM, MPI or TPU environment itself.
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  cache_dir = config.compilation_cache_dir or os.path.expanduser('~/.cache/flaxtpu/jax')
  if not config.compilation_cache_dir and (reason := files.creatable(cache_dir)):
    # The default, unusable (a file in its place, a read-only home): JAX would warn at every program.
    logging.warning('the compilation cache %s cannot be written (%s); compiling without it: set '
                    '--config.compilation_cache_dir to a writable folder, or none', cache_dir, reason)
    cache_dir = 'none'
  if cache_dir != 'none':
    jax.config.update('jax_compilation_cache_dir', cache_dir)
    # Every program, however quick to compile or small: JAX's defaults skip those under 1 s, and a run's
    # dozens of small ones (init, schedule, metrics) each took ~120 ms to compile on a TPU v5e, 4 ms to read.
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  # The accelerator's runtime starts in the background (6.1 s on a TPU v5e host) while this thread
  # imports the trainer and reads the data, which needs no device; the first call that needs the
  # devices waits for it (JAX starts a backend once, under a lock).
  threading.Thread(target=_start_backend, args=(jax,), name='flaxtpu-backend-start', daemon=True).start()
  return jax


class _Reading(NamedTuple):
  listed: concurrent.futures.Future  # the dataset as listed, before decoding (None where not given)
  read: concurrent.futures.Future  # (dataset, when the read started, how long it took)


def _read_in_background(config) -> _Reading:
  """The training data, read in a thread: the dataset as listed as soon as it is (`pipeline.load`'s
  `on_listed`), then as read.

  Reading needs no device, and its file reads, stat calls and decoding processes leave the GIL to
  the main thread's imports (JAX's, the trainer's) and to the devices' start. A daemon thread: a
  run stopped before it is done does not wait for it.
  """
  from flaxtpu.data import pipeline  # pylint: disable=g-import-not-at-top  # no JAX inside
  reading = _Reading(concurrent.futures.Future(), concurrent.futures.Future())

  def read() -> None:
    started = time.time()
    try:
      dataset = pipeline.load(config, on_listed=reading.listed.set_result)
      reading.read.set_result((dataset, started, time.time() - started))
    except BaseException as e:  # pylint: disable=broad-except  # re-raised in the main thread
      reading.read.set_exception(e)
    if not reading.listed.done():
      reading.listed.set_result(None)
  threading.Thread(target=read, name='flaxtpu-data-read', daemon=True).start()
  return reading


def _compile_ahead_in_background(config, reading: _Reading, compile_plan) -> concurrent.futures.Future:
  """`compile_plan.compile_ahead` in a thread, from the data as listed, where the data is still being
  read then (where the listing says all the step is built from). XLA compiles without the GIL: the
  main thread imports the rest of the trainer meanwhile."""
  done = concurrent.futures.Future()

  def compile_ahead() -> None:
    try:
      if (listed := reading.listed.result()) is not None and not reading.read.done():
        compile_plan.compile_ahead(config, listed)
      done.set_result(None)
    except BaseException as e:  # pylint: disable=broad-except  # re-raised in the main thread
      done.set_exception(e)
  threading.Thread(target=compile_ahead, name='flaxtpu-compile-ahead', daemon=True).start()
  return done


_devices_ready_at: list[float] = []  # when the background start of the devices ended (time.time())


def _start_backend(jax) -> None:
  try:
    jax.devices()
    _devices_ready_at.append(time.time())
  except Exception:  # pylint: disable=broad-except  # the main thread's own call raises it, in context
    pass


def _in_detectable_cluster() -> bool:
  """TPU pods and SLURM/MPI jobs, which jax.distributed.initialize() configures by itself."""
  env = os.environ
  # SLURM_STEP_NUM_TASKS is set inside an srun step only: a many-task job's batch script is one process.
  return (int(env.get('SLURM_STEP_NUM_TASKS', '1')) > 1 or int(env.get('OMPI_COMM_WORLD_SIZE', '1')) > 1
          or len(env.get('TPU_WORKER_HOSTNAMES', '').split(',')) > 1)


def _check_workdir(workdir: str) -> None:
  if storage.is_remote(workdir):
    if reason := files.unwritable(workdir):
      raise UserError(f'--workdir={workdir} cannot be written ({reason}); check the bucket\'s name and '
                      'permissions (and STORAGE_EMULATOR_HOST for an emulator), or use a local directory')
    return
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise UserError(f'--workdir={workdir} cannot be created ({e.strerror}); choose a writable '
                    'directory') from e
  if not os.access(workdir, os.W_OK):
    raise UserError(f'--workdir={workdir} is not writable; choose a writable directory')


def run(config, workdir: str, mode: str, stop: StopRequest) -> None:
  from flaxtpu.validation import resolution  # pylint: disable=g-import-not-at-top
  if workdir and (reason := storage.check_workdir_scheme(workdir)):  # before anything reads the workdir
    raise UserError(f'--workdir={workdir} cannot hold a run ({reason})')
  from_published = resolution.restores_published(workdir, mode)
  resolution.resolve(config, workdir, mode)  # every default from its source, before validation
  config_lib.validate(config, mode)  # after it, nothing edits the config
  memory.check_before_start(config, mode)  # a run that cannot fit stops before the workdir is touched
  if not workdir and from_published and mode == 'predict':  # nothing to restore: write beside the CSV
    workdir = os.path.dirname(os.path.abspath(config.predict.output_csv or 'predictions.csv'))
  if not workdir:
    raise UserError('--workdir is required: where this run writes (or a trained run to restore)')
  if mode in ('train', 'plan'):
    _check_workdir(workdir)
  if not storage.is_remote(workdir):
    workdir_checks.check_before_run(workdir, mode)
  _set_xla_flags(config, mode)
  # The data is read while JAX imports and the devices start, unless a required platform must be
  # checked first.
  reading = _read_in_background(config) if mode == 'train' and not config.require_platform else None
  jax = _start_jax(config)
  # Imported after JAX has started with the right flags.
  # pylint: disable=g-import-not-at-top
  from flaxtpu.step import compile_plan
  # While the images are decoded and the rest of the trainer imports, the programs the first step needs
  # compile into the persistent cache.
  ahead = _compile_ahead_in_background(config, reading, compile_plan) if reading is not None else None
  from flaxtpu.data import pipeline
  from flaxtpu.loop import progress, train
  from flaxtpu.step import parallel, remat_choice
  command_started = progress.process_start_time(IMPORTED_AT)
  imported = time.time() - command_started
  dataset = None
  if reading is not None:
    ahead.result()
    dataset, started, took = reading.read.result()
    logging.info('data read in %.1f s, from %.1f s after the command on', took, started - command_started)
  parallel.check_platform(config.require_platform)
  devices = parallel.describe_devices()
  # What the first step waited for: the last of these three.
  logging.info('JAX %s on %s (after the command: trainer imported %.1f s, devices ready %.1f s%s)',
               jax.__version__, devices, imported,
               (_devices_ready_at or [time.time()])[0] - command_started,
               f', data read {started + took - command_started:.1f} s' if reading is not None else '')
  if mode == 'train':
    train.train_and_evaluate(config, workdir, stop, command_started=command_started, dataset=dataset)
  elif mode == 'plan':
    dataset = pipeline.load(config, need_train=False)  # only the image shape and class count
    shape = {'image_shape': dataset.image_shape, 'num_classes': dataset.num_classes}
    chosen, tried = remat_choice.resolve(config, **shape)  # model.remat=auto: each policy's plan
    plan = ({**tried[-1], 'remat_auto': remat_choice.summary(tried)} if tried
            else compile_plan.plan_memory(chosen, **shape))
    if jax.process_index() == 0:
      files.write_json(os.path.join(workdir, 'plan.json'), plan)
    print(json.dumps(plan, indent=2))
  elif mode == 'lr_find':  # a range test: lr_find.json + lr_find.png, no checkpoint touched
    from flaxtpu.modes import lr_find  # pylint: disable=g-import-not-at-top
    lr_find.lr_find(config, workdir)
  elif mode == 'eval':
    from flaxtpu.modes import eval as eval_mode  # pylint: disable=g-import-not-at-top
    eval_mode.evaluate_checkpoint(config, workdir)
  elif mode == 'predict':
    from flaxtpu.modes import predict  # pylint: disable=g-import-not-at-top
    predict.predict(config, workdir)
  elif mode == 'audit':
    from flaxtpu.modes import audit  # pylint: disable=g-import-not-at-top
    audit.run_audit(config, workdir)
  elif mode == 'calibrate':
    from flaxtpu.modes import calibrate  # pylint: disable=g-import-not-at-top
    calibrate.calibrate(config, workdir)
  else:
    from flaxtpu.exporters import export  # pylint: disable=g-import-not-at-top
    export.export_checkpoint(config, workdir)


def _quiet_libraries() -> None:
  """orbax logs every save through absl, and a failed save with tracebacks from its threads;
  flaxtpu reports each checkpoint failure itself in one line, so orbax's own records are dropped."""
  logging.get_absl_handler().addFilter(lambda record: 'orbax' not in record.pathname)
  import logging as python_logging  # pylint: disable=g-import-not-at-top
  # A line per object it reads, and a traceback per request out of retries: flaxtpu reports the
  # failure itself, in one line (a failed save, a lease it cannot renew).
  python_logging.getLogger('gcsfs').setLevel(python_logging.CRITICAL)


def main(argv):
  storage.configure()
  _quiet_libraries()
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  if FLAGS.config is None:
    _exit_with_error('--config is required, e.g. --config=configs/cifar10.py')
  # Training listens before JAX starts: a SIGTERM while it starts, loads data or compiles stops
  # cleanly. Other modes have nothing to save and stop at once.
  stop = StopRequest()
  try:
    with stop if FLAGS.mode == 'train' else contextlib.nullcontext():
      run(FLAGS.config, FLAGS.workdir, FLAGS.mode, stop)
  except UserError as e:
    stop.reported = True
    _exit_with_error(str(e))
  except KeyboardInterrupt:
    _exit_with_error('interrupted twice: stopped without saving; the latest complete checkpoint '
                     'is intact')
  except Exception as e:  # pylint: disable=broad-except
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ''
    print(f'error: {type(e).__name__}: {first_line} (a bug? the traceback follows)', file=sys.stderr)
    traceback.print_exc()
    sys.exit(1)


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
