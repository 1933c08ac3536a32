"""An outside probe of the decoded-image disk cache (`dataset.decoded_cache_dir`, issue 70): a stored
split whose zip is intact but whose arrays are not this split decoded (another file copied over it,
an edit, a stale writer), and a cache folder that is a file. The run decodes afresh and says so in one
warning; it never trains on pixels cut to the wrong shapes, and never touches what is not its own.
"""

import glob
import hashlib
import logging
import os

import numpy as np
import pytest

from configs import cifar10
from conftest import make_mixed_folder
from flaxtpu.data import decoded_store, pipeline


@pytest.fixture(scope='module')
def mixed_folder(tmp_path_factory):
  """JPEG, PNG, grayscale, CMYK, palette, alpha and 16-bit images of 12-59 px, and a .DS_Store."""
  return make_mixed_folder(tmp_path_factory.mktemp('mixed'), train_per_class=6, test_per_class=3)


def _config(folder, store):
  config = cifar10.get_config()
  config.dataset.folder, config.dataset.decoded_cache_dir = folder, str(store)
  config.dataset.image_size = 16
  config.input.workers = 0
  return config


def _train_images(dataset):
  return [np.asarray(image) for image in dataset.train.images]


def _stored_train_split(store) -> str:
  """The train split's file: the larger of the two the load keeps."""
  return max(glob.glob(os.path.join(store, '*.npz')), key=os.path.getsize)


def _rewrite(path, **changed):
  with np.load(path) as stored:
    arrays = {**dict(stored), **changed}
  with open(path, 'wb') as f:
    np.savez(f, **arrays)


def _one_channel_shapes(path):
  """The same pixels cut as one-channel images of the same count: a consistent, wrong file."""
  with np.load(path) as stored:
    shapes, pixels = stored['shapes'].copy(), stored['pixels']
  shapes[:, 2] = 1
  return {'shapes': shapes, 'pixels': pixels[:int(np.prod(shapes, axis=1).sum())]}


def _listed_failure_out_of_range(path):
  return {'failure_positions': np.array([10_000]), 'failure_messages': np.array(['gone'])}


def _float_pixels(path):
  with np.load(path) as stored:
    return {'pixels': stored['pixels'].astype(np.float32)}


@pytest.mark.parametrize('damage', [_one_channel_shapes, _listed_failure_out_of_range, _float_pixels])
def test_a_stored_split_that_is_not_this_split_decoded_is_decoded_afresh(mixed_folder, tmp_path, caplog,
                                                                         damage):
  store = tmp_path / 'decoded'
  fresh = _train_images(pipeline.load(_config(mixed_folder, store)))
  path = _stored_train_split(store)
  _rewrite(path, **damage(path))
  with caplog.at_level(logging.WARNING):
    again = _train_images(pipeline.load(_config(mixed_folder, store)))
  warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
  assert len(warnings) == 1 and warnings[0].startswith(f'decoded cache {path} is unreadable (')
  assert warnings[0].endswith('); decoding the images again and rewriting it')
  assert len(again) == len(fresh) and all(np.array_equal(a, b) for a, b in zip(again, fresh))
  # Rewritten whole: the next run reads it back.
  assert decoded_store.load(str(store), os.path.basename(path)[:-4], len(fresh), channels=3) is not None


def test_a_cache_folder_that_is_a_file_is_left_alone_and_the_run_decodes(mixed_folder, tmp_path, caplog):
  store = tmp_path / 'decoded'
  store.write_bytes(b'my notes\n')
  with caplog.at_level(logging.WARNING):
    dataset = pipeline.load(_config(mixed_folder, store))
  assert len(dataset.train.images) == 18
  warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
  assert warnings == [f'cannot keep the decoded images in {store} (it is a file, not a folder); set '
                      '--config.dataset.decoded_cache_dir to a writable folder, or none'] * 2
  assert hashlib.sha256(store.read_bytes()).hexdigest() == hashlib.sha256(b'my notes\n').hexdigest()


def test_two_writers_of_one_split_at_once_leave_one_whole_file(mixed_folder, tmp_path, caplog):
  """Runs sharing a store (two hosts on one disk: their pids may be equal; here two threads of one
  process) wrote the same temporary file: one's rename then failed, or the file kept both's bytes."""
  import threading
  store = tmp_path / 'decoded'
  pipeline.load(_config(mixed_folder, store))
  path = _stored_train_split(store)
  key = os.path.basename(path)[:-4]
  with np.load(path) as stored:
    decoded = decoded_store.Decoded(stored['pixels'], stored['shapes'], {}, [])
  with caplog.at_level(logging.WARNING):
    writers = [threading.Thread(target=lambda: [decoded_store.save(str(store), key, decoded)
                                                for _ in range(20)]) for _ in range(2)]
    for writer in writers:
      writer.start()
    for writer in writers:
      writer.join()
  assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
  assert decoded_store.load(str(store), key, len(decoded.shapes), channels=3) is not None
  assert sorted(os.listdir(store)) == sorted(os.path.basename(p) for p in glob.glob(f'{store}/*.npz'))
