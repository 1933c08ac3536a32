"""Faults an outside probe found (issue 28): config files that fail to load, orbax's asyncio noise,
evaluating a run that rotates its checkpoints, shared memory at the end of a streamed run, class
names in any script."""

import asyncio
import os
import subprocess
import sys
import threading
import time
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, cli_env
from flaxtpu.report import plots, writer
from flaxtpu.settings import defaults
from flaxtpu.weights import checkpoint


def _cli(*args):
  env = cli_env()
  return subprocess.run([sys.executable, '-m', 'flaxtpu.main', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


_RECIPE = ('from flaxtpu.settings import defaults\n\ndef get_config({arg}):\n  config = '
           'defaults.get_config()\n')


@pytest.mark.parametrize('text, suffix, message', [
    ('def get_config(:\n  pass\n', '', 'bad.py, line 1: SyntaxError: invalid syntax'),
    ('import no_such_module_xyz\n', '',
     "bad.py, line 1: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    (_RECIPE.format(arg='') + '  config.batch_size = 1 // 0\n  return config\n', '',
     'bad.py, line 5: ZeroDivisionError: integer division or modulo by zero'),
    (_RECIPE.format(arg='') + '  config.batch_size = 8\n', '',
     'bad.py, line 3: get_config() returned None (no return statement?), not an ml_collections ConfigDict'),
    ('def get_config():\n  return {"batch_size": 8}\n', '', 'bad.py, line 1: get_config() returned a dict'),
    ('import ml_collections\n\n'
     'def get_config():\n  return ml_collections.ConfigDict({"batch_size": 8})\n', '',
     'bad.py, line 3: get_config() returned a config without the keys'),
    ('CONFIG = None\n', '', 'bad.py defines no get_config()'),
    (_RECIPE.format(arg='') + '  return config\n', ':tiny',
     "get_config() cannot take the argument 'tiny' given after the colon"),
    (_RECIPE.format(arg='size') + '  return config\n', '', 'get_config(size) needs an argument'),
    (_RECIPE.format(arg='size') + '  raise ValueError(f"unknown size {size!r}")\n', ':huge',
     "bad.py, line 5: ValueError: unknown size 'huge'"),
], ids=['syntax', 'import', 'raises', 'returns_none', 'returns_dict', 'lacks_keys', 'no_get_config',
        'unexpected_arg', 'missing_arg', 'arg_raises'])
def test_a_config_file_that_fails_to_load_is_one_line(text, suffix, message, tmp_path):
  path = tmp_path / 'bad.py'
  path.write_text(text)
  result = _cli(f'--config={path}{suffix}', f'--workdir={tmp_path / "run"}')
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
  assert message in errors[0] and str(tmp_path) in errors[0], errors[0]
  assert 'Traceback' not in result.stderr and '--config is required' not in result.stderr
  assert not (tmp_path / 'run').exists()


def test_a_config_file_with_an_argument_loads(tmp_path):
  path = tmp_path / 'sized.py'
  path.write_text(_RECIPE.format(arg='size') + '  config.batch_size = int(size)\n  return config\n')
  result = _cli(f'--config={path}:7', f'--workdir={tmp_path / "run"}', '--config.num_epochs=0')
  assert result.returncode == 2  # loaded, then validated: the override is what is refused
  assert [line for line in result.stderr.splitlines() if line.startswith('error:')] == [
      'error: config.num_epochs=0.0 must be > 0'], result.stderr[-2000:]


def _state(value: float) -> dict:
  """Enough arrays that orbax still reads some when another fails."""
  return {f'layer{i}': {'kernel': jnp.full((128, 128), value + i), 'bias': jnp.full((128,), value)}
          for i in range(32)}


def _checkpoints(workdir, keep=3, read_only=False):
  config = defaults.get_config()
  config.checkpoint.keep = keep
  return checkpoint.Checkpoints(str(workdir), config, read_only=read_only)


def test_a_missing_manifest_falls_back_without_event_loop_noise(tmp_path, capfd, monkeypatch):
  unraisable = []  # in a plain process TensorStore's callbacks print these; under pytest they land here
  monkeypatch.setattr(sys, 'unraisablehook', lambda report: unraisable.append(str(report.exc_value)))
  writer = _checkpoints(tmp_path)
  for step in (1, 2):
    writer.save(step, _state(step), {'step': step})
  writer.wait()
  writer.close()
  os.remove(tmp_path / 'checkpoints' / '2' / 'state' / 'manifest.ocdbt')
  capfd.readouterr()
  reader = _checkpoints(tmp_path, read_only=True)
  step, state, _ = reader.restore_newest_readable(_state(0), {})
  reader.close()
  time.sleep(0.5)  # the reads still in flight when the first failed have completed by now
  assert step == 1 and float(state['layer3']['kernel'][0, 0]) == 4.0
  assert (capfd.readouterr().err + ''.join(unraisable)).count('Event loop is closed') == 0


def test_orbax_closes_its_event_loop_after_the_reads_in_flight(monkeypatch):
  """The mechanism of the noise, made certain: one read fails while others still run in TensorStore's
  threads, which hand their results to the loop with call_soon_threadsafe as TensorStore does."""
  checkpoint.orbax_checkpoint()  # orbax, as flaxtpu imports it: with its event loop drained
  from orbax.checkpoint._src import asyncio_utils
  thread_errors = []
  monkeypatch.setattr(threading, 'excepthook', lambda args: thread_errors.append(str(args.exc_value)))

  async def read_checkpoint():
    loop = asyncio.get_running_loop()

    async def read_array():
      done = loop.create_future()

      def tensorstore_read():
        time.sleep(0.2)
        loop.call_soon_threadsafe(done.set_result, None)

      threading.Thread(target=tensorstore_read).start()
      await done

    async def read_missing_manifest():
      raise FileNotFoundError('manifest.ocdbt')

    await asyncio.gather(read_missing_manifest(), *(read_array() for _ in range(4)))

  with pytest.raises(FileNotFoundError):
    asyncio_utils.run_sync(read_checkpoint())
  time.sleep(0.4)
  assert thread_errors.count('Event loop is closed') == 0


def test_evaluations_of_a_run_that_rotates_its_checkpoints_all_succeed(tmp_path):
  """keep=1 and a save every step: the trainer deletes the listed step while the evaluation reads it."""
  trainer = _checkpoints(tmp_path, keep=1)
  trainer.save(1, _state(1), {'step': 1})
  trainer.wait()
  steps_read = []
  for evaluation in range(5):
    reader = _checkpoints(tmp_path, keep=1, read_only=True)
    listed = reader.all_steps()
    real_read_record = reader.read_record

    def read_while_training(step, real_read_record=real_read_record):
      if step == max(listed) and not reader.__dict__.get('rotated'):
        reader.rotated = True  # the trainer saves the next step and rotates the listed one away
        trainer.save(step + 1, _state(step + 1), {'step': step + 1})
        trainer.wait()
      return real_read_record(step)

    reader.read_record = read_while_training
    step, state, record = reader.restore_newest_readable(_state(0), {})  # what eval.checkpoint=latest reads
    reader.close()
    assert step == record['step'] == listed[0] + 1 and float(state['layer0']['bias'][0]) == step
    steps_read.append(step)
  trainer.close()
  assert steps_read == [2, 3, 4, 5, 6]


def test_a_damaged_step_that_is_still_there_stays_an_error(tmp_path):
  writer = _checkpoints(tmp_path, keep=1)
  writer.save(1, _state(1), {'step': 1})
  writer.wait()
  writer.close()
  os.remove(tmp_path / 'checkpoints' / '1' / 'state' / 'manifest.ocdbt')
  reader = _checkpoints(tmp_path, keep=1, read_only=True)
  with pytest.raises(checkpoint.CheckpointError, match='restore the files or use another --workdir'):
    reader.restore_newest_readable(_state(0), {})
  with pytest.raises(checkpoint.UnreadableCheckpoint, match='cannot be restored'):
    reader.restore(1, _state(0), {})
  reader.close()


_STREAM = '''
import sys
import numpy as np
from flaxtpu.data import workers

def batch(i):
  return np.full((32, 32, 3), i, np.uint8)

if __name__ == '__main__':
  results = list(workers.run(batch, range(24), workers=2, buffer=4))
  assert [int(r[0, 0, 0]) for r in results] == list(range(24))
  print('streamed', len(results))
'''


def test_a_streamed_pass_leaves_no_shared_memory_behind(tmp_path):
  script = tmp_path / 'stream.py'
  script.write_text(_STREAM)
  result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, 'PYTHONPATH': ROOT})
  assert result.returncode == 0 and 'streamed 24' in result.stdout, result.stderr[-2000:]
  assert result.stderr.count('leaked shared_memory') == 0, result.stderr[-2000:]


def test_class_names_in_any_script_draw_without_missing_glyphs(tmp_path):
  rng = np.random.default_rng(0)
  names = ['猫', 'dog', 'ёж', 'چای']
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    writer.write_eval_report(str(tmp_path), rng.normal(size=(40, 4)), rng.integers(0, 4, 40), names,
                             images=np.zeros((40, 8, 8, 3), np.uint8))
  assert [str(w.message) for w in caught if 'Glyph' in str(w.message)] == []
  assert os.path.getsize(tmp_path / 'confusion.png') > 0
  # Drawn with a font that has it, or written as its escape: never an empty box.
  assert plots._short('猫') in ('猫', '\\u732b')
  assert plots._short('dog') == 'dog'


# --- issue 43, class 6: what a user's file or path can hold is one line, never '(a bug?)' -------------


def _png_bytes(value: int) -> bytes:
  import io

  from PIL import Image
  buffer = io.BytesIO()
  Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(buffer, format='PNG')
  return buffer.getvalue()


@pytest.fixture(scope='module')
def user_files(tmp_path_factory):
  """Data sources with one bad record each (6 examples a split, the first bad), and files of other keys."""
  import io
  import tarfile

  import pyarrow as pa
  import pyarrow.parquet as pq
  root = tmp_path_factory.mktemp('user_files')
  images, labels = [_png_bytes(80 * (i % 2)) for i in range(6)], ['cat', 'dog'] * 3
  for name, first in (('null_cell', None), ('empty_cell', b''), ('garbage_cell', b'garbage')):
    for split in ('train', 'test'):
      os.makedirs(root / name, exist_ok=True)
      pq.write_table(pa.table({'image': pa.array([first, *images[1:]], pa.binary()), 'label': labels}),
                     root / name / f'{split}.parquet')
  for split in ('train', 'test'):
    with tarfile.open(root / f'{split}-0.tar', 'w') as tar:
      for i, (data, label) in enumerate(zip([b'', *images[1:]], labels)):
        for member, content in ((f'k{i}.png', data), (f'k{i}.cls', label.encode())):
          info = tarfile.TarInfo(member)
          info.size = len(content)
          tar.addfile(info, io.BytesIO(content))
  (root / 'empty').mkdir()
  return root


def _run(config, workdir, mode='train'):
  from flaxtpu import main
  from flaxtpu.loop.signals import StopRequest
  if not main.FLAGS.is_parsed():  # main.run reads the cluster flags (their defaults here)
    main.FLAGS.mark_as_parsed()
  main.run(config, str(workdir), mode, StopRequest())


# (case, config overrides with {root} for the fixture's folder, the one line's pattern)
USER_PATH_CASES = [
    ('parquet null image cell', {'dataset.parquet': '{root}/null_cell'},
     r"cannot decode image row 0 of \S+/null_cell/train.parquet \(ValueError: its 'image' cell holds no "
     r'image\); remove or replace it, or set --config.dataset.skip_corrupt=true'),
    # skipped: 5 of 6 examples are left, fewer than a batch of 8 (so the test stops before training)
    ('parquet null image cell, skip_corrupt',
     {'dataset.parquet': '{root}/null_cell', 'dataset.skip_corrupt': True},
     r'config.batch_size=8 is larger than the train split \(5 examples\)'),
    ('parquet empty image cell', {'dataset.parquet': '{root}/empty_cell'},
     r'cannot decode image row 0 of \S+/empty_cell/train.parquet \(ValueError'),
    ('parquet garbage image cell', {'dataset.parquet': '{root}/garbage_cell'},
     r'cannot decode image row 0 of \S+/garbage_cell/train.parquet \(UnidentifiedImageError'),
    ('tar shard empty image member', {'dataset.shards': '{root}/{{split}}-0.tar'},
     r'cannot decode image k0.png in shard \S+/train-0.tar \(UnidentifiedImageError'),
    ('tar shard empty image member, skip_corrupt', {'dataset.shards': '{root}/{{split}}-0.tar',
                                                    'dataset.skip_corrupt': True},
     r'config.batch_size=8 is larger than the train split \(5 examples\)'),
    ('dataset.name that is a path', {'dataset.folder': '', 'dataset.name': '{root}/nope'},
     r"config.dataset.name='\S+/nope' is not a TFDS dataset \(nor a folder: it does not exist\)"),
    # Rows that held already: every file-valued key, missing or of the wrong type.
    ('label file missing', {'dataset.labels': '{root}/nope.csv'},
     r"config.dataset.labels='\S+' is not a file"),
    ('label file a folder', {'dataset.labels': '{root}/empty'}, r"config.dataset.labels='\S+' is not a file"),
    ('parquet missing', {'dataset.parquet': '{root}/nope.parquet'},
     r'nope.parquet \(from config.dataset.parquet'),
    ('parquet folder without files', {'dataset.parquet': '{root}/empty'}, r'holds no .parquet files'),
    ('shards missing', {'dataset.shards': '{root}/nope-{{split}}.tar'}, r'does not exist; fix the pattern'),
    ('class weights missing', {'dataset.class_weights': '{root}/nope.csv'}, r'cannot be read \(No such file'),
    ('class weights a folder', {'dataset.class_weights': '{root}/empty'},
     r'cannot be read \(Is a directory\)'),
    ('dataset.folder empty', {'dataset.folder': '{root}/empty'}, r'train does not exist; splits found'),
    ('init_from missing', {'init_from.checkpoint': '{root}/nope'}, r'holds no flaxtpu checkpoint'),
    ('init_from an empty folder', {'init_from.checkpoint': '{root}/empty'}, r'holds no flaxtpu checkpoint'),
    ('distill.teacher missing', {'distill.teacher': '{root}/nope'}, r'config.distill.teacher=\S+ holds no'),
]


@pytest.mark.parametrize('case, overrides, message', USER_PATH_CASES, ids=[c[0] for c in USER_PATH_CASES])
def test_a_users_file_or_path_is_one_line(case, overrides, message, user_files, image_folder, tmp_path):
  from flaxtpu.settings.errors import UserError
  config = defaults.get_config()
  config.model.name = 'cnn'
  config.dataset.folder = image_folder
  for key in ('dataset.parquet', 'dataset.shards', 'dataset.labels'):
    if key in overrides:
      config.dataset.folder = ''
  config.update_from_flattened_dict({'num_train_steps': 1, 'batch_size': 8, 'compilation_cache_dir': 'none',
                                     'cpu_devices': 1})
  rooted = lambda value: value.format(root=user_files) if isinstance(value, str) else value
  config.update_from_flattened_dict({key: tuple(map(rooted, value)) if isinstance(value, tuple)
                                     else rooted(value) for key, value in overrides.items()})
  with pytest.raises(UserError) as raised:
    _run(config, tmp_path / 'run')
  assert len(str(raised.value).splitlines()) == 1 and __import__('re').search(message, str(raised.value)), (
      case, str(raised.value))


def test_output_paths_and_hand_edited_json_are_one_line(tmp_path):
  """predict.output_csv in a folder that does not exist, or naming a folder; JSON files read back that
  hold a list (eval.json, results.json, sweep.json: read as absent), a weights' config.json that does."""
  from flaxtpu.evaluation import fewshot
  from flaxtpu.io import files
  from flaxtpu.settings.errors import UserError
  from flaxtpu.weights import pretrained
  rows = [{'path': 'a.png', 'class_1': 'cat'}]
  with pytest.raises(UserError, match=rf'^cannot write {tmp_path}/nope/p.csv: its folder {tmp_path}/nope '
                                      r'does not exist; choose another --config.predict.output_csv$'):
    files.write_csv(str(tmp_path / 'nope' / 'p.csv'), rows, 'predict.output_csv')
  with pytest.raises(UserError, match=rf'^cannot write {tmp_path}: it is a folder; choose another'):
    files.write_csv(str(tmp_path), rows, 'predict.output_csv')
  (tmp_path / 'list.json').write_text('[1, 2]')
  assert files.read_json(str(tmp_path / 'list.json')) is None
  (tmp_path / 'timm').mkdir()
  (tmp_path / 'timm' / 'model.safetensors').write_bytes(b'')
  (tmp_path / 'timm' / 'config.json').write_text('[1, 2]')
  with pytest.raises(UserError, match=r"config.json \(the weights' config\) holds a JSON list, not an "):
    pretrained.locate(str(tmp_path / 'timm'))
  # A few-shot dataset that is a path to nothing is not looked up as a TFDS name (a ValueError there).
  config = defaults.get_config()
  with pytest.raises(UserError, match=rf"entry '{tmp_path}/nope': {tmp_path}/nope is not a folder; give an"):
    fewshot._other_dataset(config, str(tmp_path / 'nope'), None)  # pylint: disable=protected-access
