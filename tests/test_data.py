"""The input pipeline: folders of any size and format, slices, batches by (seed, step), bad data."""

import dataclasses
import os
import re
import time

import numpy as np
import pytest
from PIL import Image

from configs import cifar10
from conftest import make_image_folder, make_mixed_folder
from flaxtpu.data import loaders, pipeline, predict_inputs, preprocess, sampling, sources, workers
from flaxtpu.data.sources import DataError, base, embedded
from flaxtpu.data.sources import folder as folder_source
from flaxtpu.settings import defaults


def _config(folder, **overrides):
  config = cifar10.get_config()
  config.dataset.folder = folder
  config.input.workers = 0
  config.update_from_flattened_dict(overrides)
  return config


def _batches(dataset, steps=range(3), batch_size=8, **kwargs):
  return list(loaders.train_batches(dataset, seed=1, batch_size=batch_size, first_step=steps[0],
                                    last_step=steps[-1] + 1, **kwargs))


def test_uniform_folder_is_cached_as_one_uint8_array(image_folder):
  dataset = pipeline.load(_config(image_folder))
  assert dataset.class_names == ('cat', 'dog', 'frog')
  assert dataset.train.cached and dataset.train.images.shape == (48, 8, 8, 3)
  assert dataset.train.images.dtype == np.uint8 and len(dataset.eval) == 21
  assert np.bincount(dataset.train.labels).tolist() == [16, 16, 16]
  # Example i is file i of the folder's fixed order; its pixels are the file's.
  split, _ = folder_source.folder_split(image_folder, 'train')
  path, label = split.load(5)
  np.testing.assert_array_equal(dataset.train.images[5], np.asarray(Image.open(path)))
  assert dataset.train.labels[5] == label
  assert dataset.image_shape == (8, 8, 3)


def test_a_split_of_files_that_are_not_images_is_one_line_naming_one(tmp_path):
  """Every sampled header unreadable: no image size to train at. One DataError names a file (it was a
  StopIteration traceback); a few bad files among images stay the decoder's to name or skip."""
  for split in ('train', 'test'):
    os.makedirs(tmp_path / split / 'a')
    for i in range(40):
      (tmp_path / split / 'a' / f'{i:02d}.jpg').write_bytes(b'not a jpeg')
  with pytest.raises(DataError) as raised:
    pipeline.load(_config(str(tmp_path)))
  assert re.fullmatch(rf"none of the 32 files sampled across 'train' can be read as an image, e.g. cannot "
                      rf"decode image {tmp_path}/train/a/\d\d\.jpg \(UnidentifiedImageError: .*\); point the "
                      'dataset at images, or remove what is not one', str(raised.value)), raised.value
  first = tmp_path / 'train' / 'a' / '00.jpg'
  for i in range(1, 40):  # one bad file among images: the sample skips it, the decoder names it
    Image.new('RGB', (8, 8)).save(tmp_path / 'train' / 'a' / f'{i:02d}.jpg')
    Image.new('RGB', (8, 8)).save(tmp_path / 'test' / 'a' / f'{i:02d}.jpg')
  with pytest.raises(DataError, match=rf'cannot decode image {first} .*skip_corrupt=true'):
    pipeline.load(_config(str(tmp_path)))


def test_the_dataset_as_listed_comes_before_any_image_is_decoded(image_folder, monkeypatch):
  events = []
  decode = pipeline.cache.examples
  monkeypatch.setattr(pipeline.cache, 'examples', lambda *a, **k: events.append('decode') or decode(*a, **k))
  dataset = pipeline.load(_config(image_folder, **{'dataset.decoded_cache_dir': 'none'}),
                          on_listed=lambda listed: events.append(listed))
  listed = events[0]
  assert events[1:] == ['decode', 'decode'] and dataset.train.cached
  # What the train step is built from, as the read dataset has it; the splits not yet decoded.
  assert not listed.train.cached and not listed.eval.cached
  assert (listed.class_names, listed.image_shape, len(listed.train), len(listed.eval)) == (
      dataset.class_names, dataset.image_shape, len(dataset.train), len(dataset.eval))
  assert sampling.examples_per_epoch(listed, 16) == sampling.examples_per_epoch(dataset, 16) == 48
  np.testing.assert_array_equal(listed.train.listed_labels, dataset.train.labels)
  # Not where the step's numbers come from the pixels or the labels.
  for overrides in ({'dataset.normalize': 'standardize'}, {'dataset.class_weights': 'balanced'}):
    listed = []
    pipeline.load(_config(image_folder, **overrides), on_listed=listed.append)
    assert listed == [], overrides


def test_grayscale_folder_decodes_to_three_equal_channels(tmp_path):
  folder = make_image_folder(tmp_path, classes=('a', 'b'), mode='L', train_per_class=4, test_per_class=2)
  images = pipeline.load(_config(folder)).train.images
  assert images.shape == (8, 8, 8, 3)
  np.testing.assert_array_equal(images[..., 0], images[..., 2])


def test_mixed_sizes_need_image_size_and_name_the_key(tmp_path):
  folder = make_mixed_folder(tmp_path)
  with pytest.raises(pipeline.DataError, match=r'the images have .* set --config.dataset.image_size=N'):
    pipeline.load(_config(folder))


@pytest.mark.parametrize('cache', ['memory', 'none'])
def test_mixed_folder_trains_at_image_size(tmp_path, cache):
  folder = make_mixed_folder(tmp_path)  # 6 modes, JPEG and PNG, 12-59 px, a .DS_Store per class
  dataset = pipeline.load(_config(folder, **{'dataset.image_size': 16, 'dataset.cache': cache}))
  assert dataset.image_shape == (16, 16, 3)
  assert len(dataset.train) == 3 * 18 and len(dataset.eval) == 3 * 9
  assert dataset.train.cached == (cache == 'memory')
  for batch in _batches(dataset):
    assert batch.images.shape == (8, 16, 16, 3) and batch.images.dtype == np.uint8
    # Class brightness bands survive decoding from every mode: labels are recoverable.
    brightness = batch.images.reshape(8, -1).mean(axis=1)
    assert np.all(np.abs(brightness - (30 + 80 * batch.labels)) < 40), (brightness, batch.labels)
  eval_batches = list(loaders.eval_batches(dataset, batch_size=8))
  assert [int(b.mask.sum()) for b in eval_batches] == [8, 8, 8, 3]  # 27 = 3 x 8 + 3


def test_cached_and_streamed_eval_batches_are_equal(tmp_path):
  folder = make_mixed_folder(tmp_path)
  cached = pipeline.load(_config(folder, **{'dataset.image_size': 16, 'dataset.cache': 'memory'}))
  streamed = pipeline.load(_config(folder, **{'dataset.image_size': 16, 'dataset.cache': 'none'}))
  for a, b in zip(loaders.eval_batches(cached, batch_size=8), loaders.eval_batches(streamed, batch_size=8)):
    np.testing.assert_array_equal(a.labels, b.labels)
    # The cache keeps the shorter side at the eval resize: the same crop within rounding.
    assert np.abs(a.images.astype(int) - b.images.astype(int)).mean() < 6


def test_batches_do_not_depend_on_workers_or_processes(tmp_path):
  folder = make_mixed_folder(tmp_path)
  config = _config(folder, **{'dataset.image_size': 16, 'dataset.cache': 'none'})
  threaded = pipeline.load(config)
  reference = _batches(threaded, steps=range(4, 7))
  config.input.workers = 2
  in_workers = pipeline.load(config)
  in_threads = dataclasses.replace(in_workers, worker_threads=True)
  for other in (_batches(in_workers, steps=range(4, 7)), _batches(in_threads, steps=range(4, 7))):
    for a, b in zip(reference, other, strict=True):
      np.testing.assert_array_equal(a.images, b.images)
      np.testing.assert_array_equal(a.labels, b.labels)
  # Two processes read disjoint rows that together are the global batch.
  parts = [_batches(threaded, steps=range(4, 7), process_index=p, process_count=2) for p in range(2)]
  for whole, first, second in zip(reference, *parts):
    np.testing.assert_array_equal(np.concatenate([first.images, second.images]), whole.images)
    np.testing.assert_array_equal(np.concatenate([first.labels, second.labels]), whole.labels)


def test_random_resized_crops_differ_by_step_and_repeat_by_seed(tmp_path):
  folder = make_mixed_folder(tmp_path)
  dataset = pipeline.load(_config(folder, **{'dataset.image_size': 16, 'dataset.cache': 'none'}))
  first, again = _batches(dataset, steps=range(2)), _batches(dataset, steps=range(2))
  np.testing.assert_array_equal(first[1].images, again[1].images)
  assert not np.array_equal(first[0].images, first[1].images)


# --- split slices --------------------------------------------------------------------------


def test_percentage_slices_hold_out_a_proportional_validation_set(tmp_path):
  folder = make_image_folder(tmp_path, classes=('a', 'b', 'c', 'd'), train_per_class=25, test_per_class=1)
  train, _ = folder_source.folder_split(folder, 'train[:80%]')
  held_out, _ = folder_source.folder_split(folder, 'train[80%:]')
  everything, _ = folder_source.folder_split(folder, 'train')
  assert (len(train), len(held_out)) == (80, 20)
  assert set(train.records.paths).isdisjoint(held_out.records.paths)
  assert set(train.records.paths) | set(held_out.records.paths) == set(everything.records.paths)
  assert np.bincount(held_out.labels).tolist() == [5, 5, 5, 5]  # stratified: 20% of every class
  both, _ = folder_source.folder_split(folder, 'train[:10]+test')
  assert len(both) == 14
  config = _config(folder, **{'dataset.train_split': 'train[:80%]', 'dataset.eval_split': 'train[80%:]'})
  dataset = pipeline.load(config)
  assert (len(dataset.train), len(dataset.eval)) == (80, 20)


def test_a_folder_of_class_folders_is_the_split_all(tmp_path):
  make_image_folder(tmp_path / 'made', classes=('a', 'b'), train_per_class=10, test_per_class=1)
  os.rename(tmp_path / 'made' / 'train', tmp_path / 'photos')
  folder = str(tmp_path / 'photos')
  with pytest.raises(pipeline.DataError, match=r"holds class folders .*train_split='all\[:80%\]'"):
    pipeline.load(_config(folder))
  dataset = pipeline.load(_config(folder, **{'dataset.train_split': 'all[:80%]',
                                             'dataset.eval_split': 'all[80%:]'}))
  assert (len(dataset.train), len(dataset.eval)) == (16, 4)
  assert np.bincount(dataset.eval.labels).tolist() == [2, 2]


@pytest.mark.parametrize('spec, bounds', [
    ('train', [('train', '', '')]),
    ('train[:90%]', [('train', '', '90%')]),
    ('train[-1000:]', [('train', '-1000', '')]),
    ('train[10%:20%]+test', [('train', '10%', '20%'), ('test', '', '')]),
])
def test_split_specs_parse(spec, bounds):
  assert base.parse_spec(spec) == bounds


def test_slice_arithmetic_follows_tfds():
  assert base.slice_bounds('', '90%', 1001) == (0, 901)
  assert base.slice_bounds('90%', '', 1001) == (901, 1001)
  assert base.slice_bounds('-100', '', 1000) == (900, 1000)
  assert base.slice_bounds('', '5000', 1000) == (0, 1000)


def test_bad_split_spec_is_named():
  with pytest.raises(pipeline.DataError, match=r"split 'train\[:90\]\]' is not valid"):
    base.parse_spec('train[:90]]')


# --- batches as a function of (seed, step) -----------------------------------------------


def test_same_seed_same_batches_and_steps_differ():
  first = sampling.train_indices(seed=3, step=5, num_examples=1000, batch_size=32)
  np.testing.assert_array_equal(first, sampling.train_indices(3, 5, 1000, 32))
  assert not np.array_equal(first, sampling.train_indices(3, 6, 1000, 32))
  assert not np.array_equal(first, sampling.train_indices(4, 5, 1000, 32))


def test_an_epoch_visits_each_example_at_most_once():
  indices = np.concatenate([sampling.train_indices(0, step, 100, 32) for step in range(3)])
  assert len(np.unique(indices)) == 96  # 3 full batches; the remainder of 4 is dropped
  # The next epoch reshuffles.
  assert not np.array_equal(sampling.train_indices(0, 3, 100, 32), sampling.train_indices(0, 0, 100, 32))


def _in_memory(images, labels):
  examples = pipeline.Examples(images=images, labels=labels)
  return pipeline.Dataset(train=examples, eval=examples, class_names=('a',), image_shape=images.shape[1:],
                          mean=np.zeros(3), std=np.ones(3), transform=pipeline.Transform())


def test_processes_take_disjoint_slices_of_the_global_batch():
  dataset = _in_memory(np.arange(100, dtype=np.uint8).reshape(100, 1, 1, 1), np.arange(100, dtype=np.int32))
  whole = _batches(dataset, steps=[7], batch_size=16)[0]
  parts = [_batches(dataset, steps=[7], batch_size=16, process_index=p, process_count=4)[0] for p in range(4)]
  np.testing.assert_array_equal(np.concatenate([p.labels for p in parts]), whole.labels)


def test_alternate_flips_mirror_each_image_once_in_any_two_epochs():
  # 100 examples, batch 20: 5 steps an epoch, nothing dropped.
  per_epoch = [{int(i): bool(f) for step in range(5 * epoch, 5 * epoch + 5)
                for i, f in zip(sampling.train_indices(7, step, 100, 20),
                                sampling.alternate_flips(7, step, 100, 20))}
               for epoch in range(4)]
  assert all(len(flips) == 100 for flips in per_epoch)
  for this, following in zip(per_epoch, per_epoch[1:]):
    assert all(this[i] != following[i] for i in range(100))  # mirrored in exactly one of the two
  assert 35 <= sum(per_epoch[0].values()) <= 65  # a seeded half (Binomial(100, 1/2): 50 +- 5)
  assert per_epoch[0] == per_epoch[2]  # the pattern, not a new coin, every two epochs
  other_seed = {int(i): bool(f) for step in range(5)
                for i, f in zip(sampling.train_indices(8, step, 100, 20),
                                sampling.alternate_flips(8, step, 100, 20))}
  assert other_seed != per_epoch[0]


@pytest.mark.parametrize('cache', ['memory', 'none'])
def test_alternate_flip_batches_are_the_plain_ones_mirrored_where_it_says(tmp_path, cache):
  folder = make_mixed_folder(tmp_path)
  dataset = pipeline.load(_config(folder, **{'dataset.image_size': 16, 'dataset.cache': cache}))
  steps, size = range(5, 9), len(dataset.train)  # 54 images, batch 8: steps 5-8 cross into epoch 1
  plain, flipped = _batches(dataset, steps=steps), _batches(dataset, steps=steps, alternate_flip=True)
  for step, a, b in zip(steps, plain, flipped, strict=True):
    mirror = sampling.alternate_flips(1, step, size, 8)
    np.testing.assert_array_equal(b.images[mirror], a.images[mirror][:, :, ::-1])
    np.testing.assert_array_equal(b.images[~mirror], a.images[~mirror])
    np.testing.assert_array_equal(a.labels, b.labels)
  assert 0 < sum(sampling.alternate_flips(1, step, size, 8).sum() for step in steps) < 32
  # Two processes' rows are the global batch's.
  parts = [_batches(dataset, steps=steps, alternate_flip=True, process_index=p, process_count=2)
           for p in range(2)]
  for whole, first, second in zip(flipped, *parts):
    np.testing.assert_array_equal(np.concatenate([first.images, second.images]), whole.images)


def test_eval_batches_count_every_example_once_with_a_padded_remainder():
  dataset = _in_memory(np.zeros((21, 2, 2, 3), np.uint8), np.arange(21, dtype=np.int32))
  batches = list(loaders.eval_batches(dataset, batch_size=8))
  assert len(batches) == 3
  assert all(len(b.labels) == 8 for b in batches)
  assert [int(b.mask.sum()) for b in batches] == [8, 8, 5]
  counted = np.concatenate([b.labels[b.mask] for b in batches])
  np.testing.assert_array_equal(counted, np.arange(21))
  # Two processes: the same examples, split by rows.
  rows = [list(loaders.eval_batches(dataset, batch_size=8, process_index=p, process_count=2))
          for p in range(2)]
  counted = np.concatenate([np.concatenate([r[i].labels[r[i].mask] for r in rows]) for i in range(3)])
  np.testing.assert_array_equal(counted, np.arange(21))


def test_prefetch_yields_in_order_reraises_and_closes():
  assert list(workers.prefetch(iter(range(10)))) == list(range(10))

  def broken():
    yield 1
    raise RuntimeError('boom')

  with pytest.raises(RuntimeError, match='boom'):
    list(workers.prefetch(broken()))
  closed = []

  def endless():
    try:
      while True:
        yield 0
    finally:
      closed.append(True)

  with workers.prefetch(endless(), size=2) as items:
    next(items)
  assert closed == [True]


def test_thread_workers_yield_in_order_reraise_and_stop_when_closed():
  started = []

  def slow_square(item):
    started.append(item)
    time.sleep(0.01 * (item % 3))  # finishing out of order
    if item == 7:
      raise ValueError('seven')
    return item * item

  assert list(workers.run(slow_square, range(7), workers=3, buffer=2, threads=True)) == [
      i * i for i in range(7)]
  with pytest.raises(ValueError, match='seven'):
    list(workers.run(slow_square, range(10), workers=3, buffer=2, threads=True))
  started.clear()
  results = workers.run(slow_square, range(1000), workers=2, buffer=4, threads=True)
  assert next(results) == 0
  results.close()
  assert len(started) <= 6  # computed at most `buffer` ahead; the rest never started


# --- bad data: one error naming the file or folder ---------------------------------------


def test_missing_folder(tmp_path):
  with pytest.raises(pipeline.DataError, match='is not a directory'):
    pipeline.load(_config(str(tmp_path / 'nope')))


def test_missing_split_lists_the_splits_found(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=2, test_per_class=1)
  config = _config(folder, **{'dataset.eval_split': 'validation'})
  with pytest.raises(pipeline.DataError, match=r'validation does not exist; splits found in .*: test, train'):
    pipeline.load(config)


def test_empty_class_folder(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=2, test_per_class=1)
  os.makedirs(tmp_path / 'train' / 'empty')
  (tmp_path / 'train' / 'empty' / '.DS_Store').write_bytes(b'junk')
  with pytest.raises(pipeline.DataError, match=r'class folder .*train/empty has no images'):
    pipeline.load(_config(folder))


def test_split_without_class_folders(tmp_path):
  os.makedirs(tmp_path / 'train')
  os.makedirs(tmp_path / 'test')
  with pytest.raises(pipeline.DataError, match='has no class folders'):
    pipeline.load(_config(str(tmp_path)))


def test_corrupt_image_is_named_or_skipped(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=3, test_per_class=1)
  bad = tmp_path / 'train' / 'dog' / '001.png'
  bad.write_bytes(b'not a png at all')
  with pytest.raises(pipeline.DataError, match=f'cannot decode image {bad} .*skip_corrupt=true'):
    pipeline.load(_config(folder))
  dataset = pipeline.load(_config(folder, **{'dataset.skip_corrupt': True}))
  assert len(dataset.train) == 8 and np.bincount(dataset.train.labels).tolist() == [3, 2, 3]


def test_truncated_jpeg_is_named_when_decoded_or_replaced(tmp_path):
  folder = make_mixed_folder(tmp_path)
  bad = tmp_path / 'train' / 'cat' / '000.jpg'
  content = bad.read_bytes()
  bad.write_bytes(content[:len(content) * 3 // 4])  # the header reads, the pixels do not
  config = _config(folder, **{'dataset.image_size': 16, 'dataset.cache': 'none'})
  dataset = pipeline.load(config)  # the header scan passes
  with pytest.raises(pipeline.DataError, match=f'cannot decode image {bad}'):
    for step in range(20):  # some step draws the file
      _batches(dataset, steps=[step])
  config.dataset.skip_corrupt = True
  skipping = pipeline.load(config)
  batches = [b for step in range(20) for b in _batches(skipping, steps=[step])]
  assert all(b.images.shape == (8, 16, 16, 3) for b in batches)


def test_unreadable_file_is_named(tmp_path, monkeypatch):
  folder = make_image_folder(tmp_path, train_per_class=3, test_per_class=1)
  locked = str(tmp_path / 'train' / 'cat' / '002.png')
  real_open, real_read = Image.open, preprocess.read_file

  def as_an_unprivileged_user(real):  # the suite may run as root
    def read(path, *args, **kwargs):
      if str(path) == locked:
        raise PermissionError(13, 'Permission denied', path)
      return real(path, *args, **kwargs)
    return read

  monkeypatch.setattr(Image, 'open', as_an_unprivileged_user(real_open))  # headers
  monkeypatch.setattr(preprocess, 'read_file', as_an_unprivileged_user(real_read))  # decoding
  with pytest.raises(pipeline.DataError, match=f'cannot read {locked} \\(permission denied\\)'):
    pipeline.load(_config(folder))


# --- prediction inputs --------------------------------------------------------------------


def test_read_images_for_predict(tmp_path, image_folder):
  transform = pipeline.Transform()
  paths, images = predict_inputs.read_images(os.path.join(image_folder, 'test', 'cat'), (8, 8, 3), transform)
  assert len(paths) == 7 and images.shape == (7, 8, 8, 3)
  Image.new('RGB', (16, 16), (255, 0, 0)).save(tmp_path / 'big.png')
  _, resized = predict_inputs.read_images(str(tmp_path / 'big.png'), (8, 8, 3), transform)
  assert resized.shape == (1, 8, 8, 3) and resized[0, 0, 0].tolist() == [255, 0, 0]
  # A model trained at image_size: the evaluation crop of a wide image.
  Image.new('RGB', (40, 20), (0, 0, 255)).save(tmp_path / 'wide.png')
  _, cropped = predict_inputs.read_images(str(tmp_path / 'wide.png'), (16, 16, 3),
                                          pipeline.Transform(size=16))
  assert cropped.shape == (1, 16, 16, 3) and cropped[0, 8, 8].tolist() == [0, 0, 255]
  with pytest.raises(pipeline.DataError, match='does not exist'):
    predict_inputs.read_images(str(tmp_path / 'missing.png'), (8, 8, 3), transform)


def test_a_cache_decoded_by_workers_holds_private_arrays(tmp_path):
  # Arrays from grain workers arrive in shared memory, one file descriptor each: a cache that
  # kept them would run out of descriptors at CIFAR size (50,000 images).
  folder = make_image_folder(tmp_path, classes=('a', 'b'), train_per_class=500, test_per_class=1)
  dataset = pipeline.load(_config(folder, **{'dataset.image_size': 8, 'dataset.cache': 'memory',
                                             'input.workers': 1}))
  assert len(dataset.train.images) == 1000
  assert {type(image) for image in dataset.train.images} == {np.ndarray}


def test_embedded_digits_load_without_a_download():
  config = defaults.get_config()
  config.dataset.name = 'digits'
  config.dataset.train_split = 'train[:1000]'
  dataset = pipeline.load(config)
  assert (len(dataset.train), len(dataset.eval)) == (1000, 359)
  assert dataset.image_shape == (8, 8, 1) and dataset.class_names == tuple('0123456789')
  assert dataset.train.images.dtype == np.uint8 and dataset.train.images.max() == 255
  assert np.bincount(dataset.eval.labels).tolist() == [36, 36, 35, 37, 36, 36, 36, 36, 35, 36]
  config.dataset.eval_split = 'validation'
  with pytest.raises(DataError, match="'digits' has no split 'validation'; it has: test, train"):
    pipeline.load(config)


def test_the_config_picks_one_source_and_every_source_answers_the_same_methods(image_folder):
  config = defaults.get_config()
  config.dataset.name = 'digits'
  assert type(sources.get(config.dataset)) is embedded.EmbeddedSource
  config.dataset.folder = image_folder  # wins over the name
  folder = sources.get(config.dataset)
  assert type(folder) is folder_source.FolderSource and not folder.in_memory
  train, evaluation, class_names = folder.splits('train', 'test', None)
  assert class_names == ('cat', 'dog', 'frog') and (len(train), len(evaluation)) == (48, 21)
  assert folder.native_sizes([train, evaluation]) == {(8, 8)}
  _, alone, same = folder.splits(None, 'test', None)  # evaluating alone: the training split's classes
  assert same == class_names and (alone.labels == evaluation.labels).all()


def test_rgb_mean_and_std_are_averaged_for_one_channel_images_and_other_counts_refused():
  from flaxtpu.data import spec
  from flaxtpu.validation import config as config_lib
  config = defaults.get_config()
  config.dataset.name, config.dataset.train_split = 'digits', 'train[:100]'
  config.dataset.normalize = 'fixed'
  config.dataset.mean, config.dataset.std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
  dataset = pipeline.load(config)
  np.testing.assert_allclose(dataset.mean, [np.mean([0.485, 0.456, 0.406])], rtol=1e-6)
  np.testing.assert_allclose(dataset.std, [np.mean([0.229, 0.224, 0.225])], rtol=1e-6)
  # The config is only read (spec.py); the run's config.json records the averages.
  assert config.dataset.mean == (0.485, 0.456, 0.406)
  assert len(spec.saved_config(config, dataset.image_shape[-1])['dataset']['mean']) == 1
  config_lib.check_against_data(config, dataset.image_shape, dataset.num_classes)
  config.dataset.mean, config.dataset.std = (0.5, 0.5), (0.2, 0.2)
  with pytest.raises(config_lib.ConfigError, match='mean/std have 2 channels but the images have 1'):
    config_lib.check_against_data(config, dataset.image_shape, dataset.num_classes)


def test_file_names_that_are_not_utf8_are_read(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=2, test_per_class=1)
  os.rename(os.path.join(folder, 'train', 'cat', '000.png'),
            os.path.join(folder, 'train', 'cat', os.fsdecode(b'caf\xe9.png')))  # Latin-1, not UTF-8
  dataset = pipeline.load(_config(folder, **{'dataset.cache': 'none'}))
  assert len(dataset.train) == 6 and np.bincount(dataset.train.source.labels).tolist() == [2, 2, 2]
  assert len(next(loaders.train_batches(dataset, seed=0, batch_size=6, first_step=0,
                                        last_step=1)).images) == 6
