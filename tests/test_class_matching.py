"""Bad data from an outside probe: classes matched by name across splits, folder links that loop,
predict over a folder with unreadable files and odd file names."""

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_data import _config

from conftest import ROOT, cli_env, make_image_folder
from flaxtpu.data import pipeline, predict_inputs
from flaxtpu.data.sources import DataError, base
from flaxtpu.data.sources import folder as folder_source
from flaxtpu.io import files
from flaxtpu.report import writer

CLASSES = ('cat', 'dog', 'frog')
TINY = ['--config.batch_size=16', '--config.num_train_steps=4', '--config.eval_every_steps=4',
        '--config.checkpoint_every_steps=4', '--config.compilation_cache_dir=none']


def run_cli(*args, check=True):
  env = cli_env()  # the CLI picks the devices
  result = subprocess.run([sys.executable, '-m', 'flaxtpu.main', *args], cwd=ROOT, env=env,
                          capture_output=True, timeout=300)
  # Output as the CLI wrote it, undecodable bytes kept visible.
  result.stdout, result.stderr = (out.decode('utf-8', 'backslashreplace')
                                  for out in (result.stdout, result.stderr))
  if check and result.returncode:
    raise AssertionError(result.stderr[-3000:])
  return result


def _folder_of(split: base.Split, index: int) -> str:
  """The class folder an example's file is in: what its label must name."""
  return os.path.basename(os.path.dirname(split.describe(index)))


def _assert_labels_name_their_folders(split: base.Split, class_names):
  for index in range(len(split)):
    assert class_names[split.labels[index]] == _folder_of(split, index)


def _move_class(root, split, name, new_name=None, from_root=None):
  """Moves (or renames) a class folder; from `from_root` when given (a class from elsewhere)."""
  source = os.path.join(from_root or root, split, name)
  shutil.move(source, os.path.join(root, split, new_name or name))


# --- 1. one class list, matched by name -----------------------------------------------------


def test_eval_split_with_a_class_training_never_saw_is_an_error_naming_it(tmp_path):
  folder = make_image_folder(tmp_path / 'd', train_per_class=4, test_per_class=3)
  make_image_folder(tmp_path / 'other', classes=('ant',), train_per_class=1, test_per_class=3)
  _move_class(folder, 'test', 'ant', from_root=tmp_path / 'other')  # sorts first: shifted every label
  with pytest.raises(DataError, match=r"split 'test' .* not trained on: ant \(3 images\).*"
                                      r'dataset.unknown_classes=drop'):
    pipeline.load(_config(folder))


@pytest.mark.parametrize('cache', ['memory', 'none'])
def test_dropped_unknown_class_leaves_the_training_labels(tmp_path, cache):
  folder = make_image_folder(tmp_path / 'd', train_per_class=4, test_per_class=3)
  make_image_folder(tmp_path / 'other', classes=('ant',), train_per_class=1, test_per_class=5)
  _move_class(folder, 'test', 'ant', from_root=tmp_path / 'other')
  dataset = pipeline.load(_config(folder, **{'dataset.unknown_classes': 'drop', 'dataset.cache': cache}))
  assert dataset.class_names == CLASSES and len(dataset.eval) == 9
  labels = dataset.eval.labels if dataset.eval.cached else dataset.eval.source.labels
  assert np.bincount(labels).tolist() == [3, 3, 3]
  if not dataset.eval.cached:
    _assert_labels_name_their_folders(dataset.eval.source, CLASSES)


def test_eval_split_lacking_a_class_keeps_the_training_labels(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=4, test_per_class=3)
  shutil.rmtree(os.path.join(folder, 'test', 'cat'))  # sorts first: dog was 0 and frog 1 before
  dataset = pipeline.load(_config(folder, **{'dataset.cache': 'none'}))
  assert dataset.class_names == CLASSES and dataset.num_classes == 3
  assert np.bincount(dataset.eval.source.labels, minlength=3).tolist() == [0, 3, 3]
  _assert_labels_name_their_folders(dataset.eval.source, CLASSES)
  assert base.missing_classes(dataset.eval.source.labels, CLASSES) == ['cat']


def test_eval_splits_entries_and_later_parts_of_a_spec_map_by_name(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=4, test_per_class=3)
  os.makedirs(os.path.join(folder, 'extra'))
  shutil.copytree(os.path.join(folder, 'test', 'frog'), os.path.join(folder, 'extra', 'frog'))
  config = _config(folder, **{'dataset.cache': 'none'})
  config.dataset.eval_splits = ('extra',)
  dataset = pipeline.load(config)
  [(name, other)] = pipeline.load_eval_splits(config, dataset)
  assert name == 'extra' and other.class_names == CLASSES
  assert other.eval.source.labels.tolist() == [2, 2, 2]  # frog, not class 0
  split, class_names = folder_source.folder_split(folder, 'train+extra')  # before: 'different class folders'
  assert class_names == CLASSES and np.bincount(split.labels).tolist() == [4, 4, 7]
  _assert_labels_name_their_folders(split, CLASSES)


def test_checkpoint_classes_map_an_eval_only_folder_by_name(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=4, test_per_class=3)
  shutil.rmtree(os.path.join(folder, 'train'))
  shutil.rmtree(os.path.join(folder, 'test', 'cat'))
  trained_on = ('ant', 'cat', 'dog', 'frog')
  dataset = pipeline.load(_config(folder, **{'dataset.cache': 'none'}), need_train=False,
                          class_names=trained_on)
  assert dataset.class_names == trained_on
  assert sorted(set(dataset.eval.source.labels.tolist())) == [2, 3]
  _assert_labels_name_their_folders(dataset.eval.source, trained_on)


def test_unknown_classes_takes_error_or_drop_only(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=2, test_per_class=1)
  with pytest.raises(DataError, match=r'config.dataset.unknown_classes=.skip. is not one of error, drop'):
    pipeline.load(_config(folder, **{'dataset.unknown_classes': 'skip'}))


def test_report_of_a_split_lacking_classes_says_so(tmp_path):
  logits = np.eye(3)[[1, 1, 2]] * 5
  summary = writer.write_eval_report(str(tmp_path), logits, np.array([1, 1, 2]), list(CLASSES))
  assert summary['classes_without_examples'] == ['cat']
  with open(tmp_path / 'per_class.csv', newline='') as f:
    rows = {row['class']: row for row in csv.DictReader(f)}
  assert [rows[name]['support'] for name in CLASSES] == ['0', '2', '1']
  assert rows['cat']['recall'] == ''


# --- 2. folder links that loop ----------------------------------------------------------------


def _loop(kind):
  """(link inside the dataset, its target) making a loop of one kind."""
  return {
      'parent': [('train/cat/loop', '..')],
      'root': [('train/cat/deep/loop', '../../..')],
      'class': [('train/cat/deep/back', '..')],  # back to its own class folder
      'filesystem_root': [('train/dog/slash', '/')],
      'siblings': [('train/cat/to_dog', '../dog'), ('train/dog/to_cat', '../cat')],
      'split_as_class': [('train/zzz', '.')],  # a "class folder" that is the split itself
      'outside_back_in': [('train/frog/out', '../../../outside'), ('../outside/in', '../data/train')],
  }[kind]


@pytest.mark.parametrize('kind', ['parent', 'root', 'class', 'filesystem_root', 'siblings',
                                  'split_as_class', 'outside_back_in'])
def test_folder_links_that_loop_add_no_examples(tmp_path, kind):
  folder = make_image_folder(tmp_path / 'data', train_per_class=4, test_per_class=2)
  os.makedirs(tmp_path / 'data' / 'train' / 'cat' / 'deep')
  os.makedirs(tmp_path / 'outside')
  expected, expected_classes = folder_source.folder_split(folder, 'train')
  for link, target in _loop(kind):
    os.symlink(target, os.path.join(folder, link))
  split, class_names = folder_source.folder_split(folder, 'train')
  assert class_names == expected_classes == CLASSES
  assert len(split) == len(expected) == 12
  assert np.bincount(split.labels).tolist() == [4, 4, 4]
  _assert_labels_name_their_folders(split, CLASSES)


def test_linked_files_and_class_folders_that_do_not_loop_still_count(tmp_path):
  folder = make_image_folder(tmp_path / 'data', train_per_class=4, test_per_class=2)
  pool = make_image_folder(tmp_path / 'pool', classes=('cat', 'dog', 'frog', 'bird'), train_per_class=3,
                           test_per_class=1)
  os.symlink(os.path.join(pool, 'train', 'bird'), os.path.join(folder, 'train', 'bird'))  # a linked class
  os.symlink(os.path.join(pool, 'train', 'cat', '000.png'), os.path.join(folder, 'train', 'cat', 'x.png'))
  os.symlink(os.path.join(pool, 'train', 'dog'), os.path.join(folder, 'train', 'dog', 'more'))
  os.symlink(os.path.join(pool, 'train', 'dog'), os.path.join(folder, 'train', 'dog', 'again'))  # read once
  split, class_names = folder_source.folder_split(folder, 'train')
  assert class_names == ('bird', 'cat', 'dog', 'frog')
  assert np.bincount(split.labels).tolist() == [3, 5, 7, 4]


# --- 8. predict over a folder with unreadable files and odd names ------------------------------

ODD_NAMES = ['=cmd|calc.png', 'comma,"quote".png', 'new\nline.png', os.fsdecode(b'bad\xffbyte.png'),
             '+plus.png', 'été.png']


def _predict_folder(tmp_path, source_image):
  folder = tmp_path / 'to_predict'
  folder.mkdir()
  for name in ['good.png', *ODD_NAMES]:
    shutil.copy(source_image, os.path.join(folder, name))
  (folder / 'broken.png').write_bytes(b'not an image')
  return str(folder)


def test_read_images_names_an_unreadable_file_or_skips_it(tmp_path, image_folder, capsys):
  folder = _predict_folder(tmp_path, os.path.join(image_folder, 'test', 'cat', '000.png'))
  transform = pipeline.Transform()
  with pytest.raises(DataError, match=r'broken.png \(UnidentifiedImageError: cannot identify image file .*\)'
                                      r'.*skip_corrupt=true') as raised:
    predict_inputs.read_images(folder, (8, 8, 3), transform)
  assert '\n' not in str(raised.value)
  paths, images = predict_inputs.read_images(folder, (8, 8, 3), transform, skip_corrupt=True)
  assert len(paths) == len(images) == 1 + len(ODD_NAMES)
  assert sorted(os.path.basename(p) for p in paths) == sorted(['good.png', *ODD_NAMES])
  assert 'broken.png' in capsys.readouterr().err


def test_predictions_csv_is_valid_utf8_for_any_file_name(tmp_path, image_folder, monkeypatch):
  folder = _predict_folder(tmp_path, os.path.join(image_folder, 'test', 'cat', '000.png'))
  monkeypatch.chdir(folder)  # relative paths: a name starting with '=' begins the cell
  paths = sorted(name for name in os.listdir('.') if name != 'broken.png')
  out = str(tmp_path / 'predictions.csv')
  files.write_csv(out, [{'path': files.csv_path(p), 'class_1': 'cat'} for p in paths], 'predict.output_csv')
  with open(out, encoding='utf-8', newline='') as f:  # strict UTF-8
    cells = [row['path'] for row in csv.DictReader(f)]
  assert len(cells) == len(paths)
  for path, cell in zip(paths, cells):
    assert not cell.startswith(('=', '+', '-', '@'))
    if path == os.fsdecode(b'bad\xffbyte.png'):
      assert cell == 'bad\\xffbyte.png'
    else:
      assert os.path.samefile(cell, path)  # commas, quotes, newlines, accents: the same file


# --- end to end: the CLI ---------------------------------------------------------------------


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  folder = make_image_folder(tmp_path_factory.mktemp('classes'), train_per_class=8, test_per_class=4)
  workdir = str(tmp_path_factory.mktemp('run'))
  run_cli('--config=configs/cifar10.py', f'--workdir={workdir}', f'--config.dataset.folder={folder}', *TINY)
  return workdir, folder


def test_eval_mode_maps_the_eval_folders_by_the_checkpoints_classes(trained, tmp_path):
  workdir, folder = trained
  other = str(tmp_path / 'other')
  shutil.copytree(os.path.join(folder, 'test'), os.path.join(other, 'test'))
  shutil.rmtree(os.path.join(other, 'test', 'frog'))
  make_image_folder(tmp_path / 'birds', classes=('bird',), train_per_class=1, test_per_class=2)
  _move_class(other, 'test', 'bird', from_root=tmp_path / 'birds')  # 3 folders, as trained: bird, cat, dog
  args = ['--config=configs/cifar10.py', f'--workdir={workdir}', '--mode=eval',
          f'--config.dataset.folder={other}']
  result = run_cli(*args, check=False)
  assert result.returncode == 2
  [line] = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert 'bird (2 images)' in line and 'unknown_classes=drop' in line
  run_cli(*args, '--config.dataset.unknown_classes=drop')
  with open(os.path.join(workdir, 'eval.json')) as f:
    evaluation = json.load(f)
  assert evaluation['num_examples'] == 8 and evaluation['classes_without_examples'] == ['frog']
  suffix = [name for name in evaluation['report_files'] if name.startswith('per_class')][0]
  with open(os.path.join(workdir, suffix), newline='') as f:
    support = {row['class']: int(row['support']) for row in csv.DictReader(f)}
  assert support == {'cat': 4, 'dog': 4, 'frog': 0}  # before: bird counted as cat, cat as dog, dog as frog


def test_predict_mode_skips_unreadable_files_and_writes_any_name(trained, tmp_path):
  workdir, folder = trained
  inputs = _predict_folder(tmp_path, os.path.join(folder, 'test', 'dog', '000.png'))
  out = str(tmp_path / 'predictions.csv')
  args = ['--config=configs/cifar10.py', f'--workdir={workdir}', '--mode=predict',
          f'--config.predict.input={inputs}', f'--config.predict.output_csv={out}']
  result = run_cli(*args, check=False)
  assert result.returncode == 2 and not os.path.exists(out)
  [line] = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert 'broken.png (UnidentifiedImageError: cannot identify image file' in line
  result = run_cli(*args, '--config.dataset.skip_corrupt=true')
  assert 'broken.png' in result.stderr and 'skipped' in result.stderr
  with open(out, encoding='utf-8', newline='') as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 1 + len(ODD_NAMES)
  assert all(row['class_1'] in CLASSES for row in rows)
  names = {os.path.basename(row['path']) for row in rows}
  assert names == {'good.png', 'bad\\xffbyte.png', *(n for n in ODD_NAMES if 'bad' not in n)}
