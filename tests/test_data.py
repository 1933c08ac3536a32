import os

import numpy as np
import pytest
from PIL import Image

from configs import cifar10
from conftest import make_image_folder
from flaxtpu import data


def _config(folder):
  config = cifar10.get_config()
  config.dataset.folder = folder
  return config


def test_image_folder_loads_sorted_uint8_arrays(image_folder):
  dataset = data.load(_config(image_folder))
  assert dataset.class_names == ('cat', 'dog', 'frog')
  assert dataset.train.images.shape == (48, 8, 8, 3) and dataset.train.images.dtype == np.uint8
  assert len(dataset.eval) == 21
  # Files sorted by path: class 0's sixteen images come first.
  np.testing.assert_array_equal(dataset.train.labels, np.repeat([0, 1, 2], 16))
  expected = np.asarray(Image.open(os.path.join(image_folder, 'train', 'dog', '003.png')))
  np.testing.assert_array_equal(dataset.train.images[16 + 3], expected)
  assert dataset.mean.shape == (3,) and np.all(dataset.std > 0)


def test_grayscale_folder_decodes_to_three_equal_channels(tmp_path):
  folder = make_image_folder(tmp_path, classes=('a', 'b'), mode='L', train_per_class=4, test_per_class=2)
  images = data.load(_config(folder)).train.images
  assert images.shape == (8, 8, 8, 3)
  np.testing.assert_array_equal(images[..., 0], images[..., 2])


def test_same_seed_same_batches_and_steps_differ():
  first = data.train_indices(seed=3, step=5, num_examples=1000, batch_size=32)
  np.testing.assert_array_equal(first, data.train_indices(3, 5, 1000, 32))
  assert not np.array_equal(first, data.train_indices(3, 6, 1000, 32))
  assert not np.array_equal(first, data.train_indices(4, 5, 1000, 32))


def test_an_epoch_visits_each_example_at_most_once():
  indices = np.concatenate([data.train_indices(0, step, 100, 32) for step in range(3)])
  assert len(np.unique(indices)) == 96  # 3 full batches; the remainder of 4 is dropped
  # The next epoch reshuffles.
  assert not np.array_equal(data.train_indices(0, 3, 100, 32), data.train_indices(0, 0, 100, 32))


def test_processes_take_disjoint_slices_of_the_global_batch():
  split = data.Split(np.arange(100, dtype=np.uint8).reshape(100, 1, 1, 1), np.arange(100, dtype=np.int32))
  whole = next(data.train_batches(split, seed=1, batch_size=16, first_step=7, last_step=8))
  parts = [next(data.train_batches(split, seed=1, batch_size=16, first_step=7, last_step=8,
                                   process_index=p, process_count=4)) for p in range(4)]
  np.testing.assert_array_equal(np.concatenate([p.labels for p in parts]), whole.labels)


def test_eval_batches_count_every_example_once_with_a_padded_remainder():
  split = data.Split(np.zeros((21, 2, 2, 3), np.uint8), np.arange(21, dtype=np.int32))
  batches = list(data.eval_batches(split, batch_size=8))
  assert len(batches) == 3
  assert all(len(b.labels) == 8 for b in batches)
  assert [int(b.mask.sum()) for b in batches] == [8, 8, 5]
  counted = np.concatenate([b.labels[b.mask] for b in batches])
  np.testing.assert_array_equal(counted, np.arange(21))
  # Two processes: the same examples, split by rows.
  rows = [list(data.eval_batches(split, batch_size=8, process_index=p, process_count=2)) for p in range(2)]
  counted = np.concatenate([np.concatenate([r[i].labels[r[i].mask] for r in rows]) for i in range(3)])
  np.testing.assert_array_equal(counted, np.arange(21))


def test_prefetch_yields_in_order_and_reraises():
  assert list(data.prefetch(iter(range(10)))) == list(range(10))

  def broken():
    yield 1
    raise RuntimeError('boom')

  with pytest.raises(RuntimeError, match='boom'):
    list(data.prefetch(broken()))


# --- bad folders: one error naming the file or folder ----------------------


def test_missing_folder(tmp_path):
  with pytest.raises(data.DataError, match='is not a directory'):
    data.load(_config(str(tmp_path / 'nope')))


def test_missing_split_lists_the_splits_found(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=2, test_per_class=1)
  config = _config(folder)
  config.dataset.eval_split = 'validation'
  with pytest.raises(data.DataError, match=r'validation does not exist; splits found in .*: test, train'):
    data.load(config)


def test_empty_class_folder(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=2, test_per_class=1)
  os.makedirs(tmp_path / 'train' / 'empty')
  with pytest.raises(data.DataError, match=r'class folder .*train/empty has no images'):
    data.load(_config(folder))


def test_split_without_class_folders(tmp_path):
  os.makedirs(tmp_path / 'train')
  os.makedirs(tmp_path / 'test')
  with pytest.raises(data.DataError, match='has no class folders'):
    data.load(_config(str(tmp_path)))


def test_corrupt_image_is_named(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=3, test_per_class=1)
  bad = tmp_path / 'train' / 'dog' / '001.png'
  bad.write_bytes(b'not a png at all')
  with pytest.raises(data.DataError, match=f'cannot decode image {bad}'):
    data.load(_config(folder))


def test_mixed_image_sizes_are_named(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=3, test_per_class=1)
  odd = tmp_path / 'train' / 'frog' / '002.png'
  Image.new('RGB', (9, 8)).save(odd)
  with pytest.raises(data.DataError, match=f'image {odd} is 9x8 but .* is 8x8'):
    data.load(_config(folder))


def test_read_images_for_predict(tmp_path, image_folder):
  paths, images = data.read_images(os.path.join(image_folder, 'test', 'cat'), (8, 8, 3))
  assert len(paths) == 7 and images.shape == (7, 8, 8, 3)
  Image.new('RGB', (16, 16), (255, 0, 0)).save(tmp_path / 'big.png')
  _, resized = data.read_images(str(tmp_path / 'big.png'), (8, 8, 3))
  assert resized.shape == (1, 8, 8, 3) and resized[0, 0, 0].tolist() == [255, 0, 0]
  with pytest.raises(data.DataError, match='does not exist'):
    data.read_images(str(tmp_path / 'missing.png'), (8, 8, 3))
