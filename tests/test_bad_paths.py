"""Folders and files a user names that cannot be written: one line each, before any work (issue 52 part 3).

`/proc/...` stands for a folder that cannot be written: /proc exists and takes no new files, for root
as for anyone (chmod does not stop root, who runs these tests on some machines).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flaxtpu import average
from flaxtpu.io import files
from flaxtpu.modes import predict
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import ConfigError, UserError
from flaxtpu.sweep import __main__ as sweep_cli
from flaxtpu.validation import config as config_lib

ROOT = Path(__file__).resolve().parents[1]
UNWRITABLE = '/proc/flaxtpu-test'
WHY = '/proc takes no new files'


def test_creatable_says_why_without_making_anything(tmp_path):
  assert files.creatable(str(tmp_path / 'new' / 'deeper')) is None
  assert not (tmp_path / 'new').exists()
  assert files.creatable(UNWRITABLE + '/deeper') == WHY
  (tmp_path / 'file').write_text('')
  assert files.creatable(str(tmp_path / 'file' / 'below')) == f'{tmp_path / "file"} is a file, not a folder'
  assert files.creatable('gs://bucket/run') is None  # a store is asked when it is written
  assert os.listdir(tmp_path) == ['file']  # no probe left behind


def test_an_unwritable_compilation_cache_is_one_config_line():
  config = defaults.get_config()
  config.dataset.name = 'digits'
  config.compilation_cache_dir = UNWRITABLE
  with pytest.raises(ConfigError) as raised:
    config_lib.validate(config)
  assert str(raised.value) == (f"config.compilation_cache_dir='{UNWRITABLE}' cannot be written ({WHY}); "
                               "choose a directory you can write, '' (~/.cache/flaxtpu/jax) or none "
                               '(no cache)')
  config.compilation_cache_dir = 'none'
  config_lib.validate(config)


EXPERIMENT = '''
from flaxtpu import sweep
from flaxtpu.settings import defaults

def get_config():
  config = defaults.get_config()
  config.dataset.name = 'digits'
  return config

def get_sweep():
  return sweep.sweep('seed', [0, 1])

def get_search(trial):
  return {'seed': trial.suggest_categorical('seed', [0, 1])}
'''


@pytest.mark.parametrize('study', [(), ('--trials=1',)], ids=['grid', 'study'])
def test_a_sweep_folder_that_cannot_be_written_is_one_line_and_nothing_is_made(tmp_path, capsys, study):
  experiment = tmp_path / 'experiment.py'
  experiment.write_text(textwrap.dedent(EXPERIMENT))
  assert sweep_cli.main([str(experiment), f'--workdir={UNWRITABLE}', *study]) == 2
  assert capsys.readouterr().err == (f'error: --workdir={UNWRITABLE} cannot hold the sweep ({WHY}); choose a '
                                     'directory you can write\n')
  workdir = tmp_path / 'sweep'
  assert sweep_cli.main([str(experiment), f'--workdir={workdir}', f'--log-dir={UNWRITABLE}', *study]) == 2
  assert capsys.readouterr().err == (f"error: --log-dir={UNWRITABLE} cannot hold the runs' logs ({WHY}); "
                                     'choose a directory you can write\n')
  assert not workdir.exists()  # no lock, record or study database


def test_a_soup_that_cannot_be_written_is_one_line(tmp_path):
  with pytest.raises(UserError) as raised:
    average.make_soup([str(tmp_path / 'a_run')], f'{UNWRITABLE}/soup')
  assert str(raised.value) == (f'--workdir={UNWRITABLE}/soup cannot be written ({WHY}); choose a directory '
                               'you can write (nothing was averaged)')
  result = subprocess.run([sys.executable, '-m', 'flaxtpu.average', f'--workdir={UNWRITABLE}/soup',
                           str(tmp_path / 'a_run')], capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert (result.returncode, result.stderr.splitlines()[-1]) == (2, f'error: {raised.value}')
  assert 'Traceback' not in result.stderr


@pytest.mark.parametrize('overrides, message', [
    ({'predict.output_csv': 'TMP/no_folder/predictions.csv'},
     'cannot write TMP/no_folder/predictions.csv: its folder TMP/no_folder does not exist; choose another '
     '--config.predict.output_csv'),
    ({'predict.output_csv': 'TMP'},
     'cannot write TMP: it is a folder; choose another --config.predict.output_csv'),
    ({'predict.output_csv': f'{UNWRITABLE}.csv'},
     f'cannot write {UNWRITABLE}.csv: {WHY}; choose another --config.predict.output_csv'),
    ({'predict.explain': True, 'predict.explain_dir': UNWRITABLE},
     f'config.predict.explain_dir={UNWRITABLE} cannot hold the heatmaps ({WHY}); choose a directory you can '
     'write'),
])
def test_predict_outputs_that_cannot_be_written_are_one_line_before_anything_is_read(tmp_path, overrides,
                                                                                       message):
  config = defaults.get_config()
  config.predict.input = str(tmp_path / 'images')
  config.update_from_flattened_dict({key: value.replace('TMP', str(tmp_path)) if isinstance(value, str)
                                     else value for key, value in overrides.items()})
  with pytest.raises(UserError) as raised:
    predict.predict(config, str(tmp_path / 'no_run'))  # fails before the (missing) run is read
  assert str(raised.value) == message.replace('TMP', str(tmp_path))
  config.predict.output_csv, config.predict.explain_dir = str(tmp_path / 'out.csv'), str(tmp_path / 'explain')
  predict.check_outputs(config, str(tmp_path))  # writable: no error
  assert not (tmp_path / 'explain').exists()


@pytest.fixture(scope='module')
def trained_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('run')
  result = subprocess.run([sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py',
                           f'--workdir={workdir}', '--config.num_train_steps=2',
                           '--config.compilation_cache_dir=none'], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


def test_predict_explain_dir_that_cannot_be_written_stops_the_command_in_one_line(trained_run, tmp_path):
  photo = str(trained_run / 'curves.png')  # a picture the run drew
  result = subprocess.run([sys.executable, '-m', 'flaxtpu.main', '--mode=predict', f'--workdir={trained_run}',
                           f'--config.predict.input={photo}', '--config.predict.explain=true',
                           f'--config.predict.explain_dir={UNWRITABLE}'], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
  assert result.returncode == 2, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert errors == [f'error: config.predict.explain_dir={UNWRITABLE} cannot hold the heatmaps ({WHY}); '
                    'choose a directory you can write']
  assert 'Traceback' not in result.stderr and result.stdout == ''  # nothing predicted in vain
