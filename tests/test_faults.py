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

from conftest import ROOT
from flaxtpu import checkpoint, defaults
from flaxtpu.report import plots, writer


def _cli(*args):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  return subprocess.run([sys.executable, '-m', 'flaxtpu.main', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


_RECIPE = 'from flaxtpu import defaults\n\ndef get_config({arg}):\n  config = defaults.get_config()\n'


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
