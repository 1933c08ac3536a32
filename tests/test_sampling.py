"""Samplers (shuffle, balanced, shards), class weights, and multi-hot labels through the pipeline."""

import dataclasses
import functools
import logging
import os

import numpy as np
import pytest
from sklearn.utils.class_weight import compute_class_weight

from configs import cifar10
from conftest import make_image_folder
from flaxtpu.data import cache as cache_lib
from flaxtpu.data import class_weights, loaders, pipeline, preprocess
from flaxtpu.data import sampling as sampling_lib
from flaxtpu.data.sources import DataError, base
from flaxtpu.data.sources import folder as folder_source
from flaxtpu.data.sources import shards as shard_source


def _examples(labels, shards=None):
  """In-memory 1x1 images whose pixel is the example's index (mod 256): batches show what they hold."""
  images = (np.arange(len(labels)) % 256).astype(np.uint8).reshape(-1, 1, 1, 1)
  return pipeline.Examples(images=images, labels=labels, groups=shards)


def _dataset(labels, *, sampling='shuffle', shards=None):
  num_classes = labels.shape[1] if labels.ndim == 2 else int(labels.max()) + 1
  return pipeline.Dataset(train=_examples(labels, shards), eval=_examples(labels),
                          class_names=tuple(f'c{i}' for i in range(num_classes)), image_shape=(1, 1, 1),
                          mean=np.zeros(1), std=np.ones(1), transform=pipeline.Transform(), sampling=sampling)


def _config(**overrides):
  """The CIFAR-10 recipe on other data, read in this process."""
  config = cifar10.get_config()
  config.update_from_flattened_dict({'dataset.folder': '', 'input.workers': 0, **overrides})
  return config


def _old_train_indices(seed, step, num_examples, batch_size):
  """train_indices as it was before samplers: the formula the shuffle sampler must keep bit for bit."""
  epoch, position = divmod(step, num_examples // batch_size)
  return np.random.default_rng([seed, epoch]).permutation(num_examples)[
      position * batch_size:(position + 1) * batch_size]


# --- shuffle: unchanged ------------------------------------------------------------------------


@pytest.mark.parametrize('seed,num_examples,batch_size', [(0, 100, 32), (7, 1000, 48), (3, 64, 64)])
def test_shuffle_sampler_is_the_old_formula(seed, num_examples, batch_size):
  steps = range(0, 3 * (num_examples // batch_size) + 1)  # across three epoch boundaries
  whole = sampling_lib.ShuffleSampler(seed, num_examples, batch_size)
  halves = [sampling_lib.ShuffleSampler(seed, num_examples, batch_size, p, 2) for p in range(2)]
  for step in steps:
    old = _old_train_indices(seed, step, num_examples, batch_size)
    np.testing.assert_array_equal(whole.indices(step), old)
    np.testing.assert_array_equal(sampling_lib.train_indices(seed, step, num_examples, batch_size), old)
    np.testing.assert_array_equal(np.concatenate([half.indices(step) for half in halves]), old)
    odd = step // (num_examples // batch_size) % 2 == 1
    np.testing.assert_array_equal(whole.mirrored(step, old),
                                  sampling_lib.alternate_flips(seed, step, num_examples, batch_size))
    np.testing.assert_array_equal(sampling_lib.alternate_flips(seed, step, num_examples, batch_size),
                                  sampling_lib._first_epoch_flips(seed, num_examples)[old] ^ odd)


def test_shuffle_batches_are_the_old_ones():
  labels = np.arange(200, dtype=np.int32) % 5
  dataset = _dataset(labels)
  batches = list(loaders.train_batches(dataset, seed=4, batch_size=16, first_step=10, last_step=30))
  for step, batch in zip(range(10, 30), batches, strict=True):
    old = _old_train_indices(4, step, 200, 16)
    np.testing.assert_array_equal(batch.labels, labels[old])
    np.testing.assert_array_equal(batch.images[:, 0, 0, 0], old % 256)


# --- balanced ---------------------------------------------------------------------------------


def _imbalanced(seed=0):
  """1000 labels, 90% / 9% / 1% of classes 0, 1, 2, in a shuffled order."""
  labels = np.repeat(np.arange(3, dtype=np.int32), [900, 90, 10])
  return np.random.default_rng(seed).permutation(labels)


def test_balanced_sampling_draws_every_class_equally_often():
  labels = _imbalanced()
  sampler = sampling_lib.BalancedSampler(5, labels, 100)
  assert sampler.steps_per_epoch == 10  # N // batch, as shuffle
  drawn = np.concatenate([sampler.indices(step) for step in range(200)])  # 20 epochs, 20k draws
  frequencies = np.bincount(labels[drawn], minlength=3) / len(drawn)
  np.testing.assert_allclose(frequencies, 1 / 3, atol=0.02)  # the binomial sd is 0.0033
  # Within an epoch, with replacement: the 10 class-2 examples come up ~33 times each.
  epoch = np.concatenate([sampler.indices(step) for step in range(10)])
  assert len(np.unique(epoch[labels[epoch] == 2])) == 10
  assert np.bincount(epoch).max() > 10
  # Probabilities by hand: 1 / (count of the class), normalised.
  expected = 1 / np.array([900, 90, 10])[labels]
  np.testing.assert_allclose(sampling_lib.balanced_probabilities(labels), expected / expected.sum())


def test_balanced_sampling_is_deterministic_and_resumes_exactly():
  labels = _imbalanced()
  steps = range(0, 35)  # 3.5 epochs of 10 steps
  first = [sampling_lib.BalancedSampler(2, labels, 100).indices(step) for step in steps]
  again = [sampling_lib.BalancedSampler(2, labels, 100).indices(step) for step in steps]
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first[0], first[10])  # each epoch draws anew
  other_seed = [sampling_lib.BalancedSampler(3, labels, 100).indices(step) for step in steps]
  assert not np.array_equal(first, other_seed)
  # Batches from a resumed iterator are the tail of a full one, whatever the process layout.
  dataset = _dataset(labels, sampling='balanced')
  full = list(loaders.train_batches(dataset, seed=2, batch_size=100, first_step=0, last_step=35))
  resumed = list(loaders.train_batches(dataset, seed=2, batch_size=100, first_step=23, last_step=35))
  for a, b in zip(full[23:], resumed, strict=True):
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.images, b.images)
  halves = [list(loaders.train_batches(dataset, seed=2, batch_size=100, first_step=23, last_step=35,
                                       process_index=p, process_count=2)) for p in range(2)]
  for whole, first_half, second_half in zip(resumed, *halves, strict=True):
    np.testing.assert_array_equal(np.concatenate([first_half.labels, second_half.labels]), whole.labels)
  np.testing.assert_array_equal(np.concatenate([batch.labels for batch in full[:10]]),
                                labels[np.concatenate(first[:10])])


def test_balanced_sampling_skips_absent_classes():
  labels = np.repeat(np.array([0, 2], np.int32), [95, 5])  # class 1 has no train example
  sampler = sampling_lib.BalancedSampler(0, labels, 10)
  drawn = labels[np.concatenate([sampler.indices(step) for step in range(100)])]
  frequencies = np.bincount(drawn, minlength=3) / len(drawn)
  assert frequencies[1] == 0
  np.testing.assert_allclose(frequencies[[0, 2]], 0.5, atol=0.03)


def test_balanced_probabilities_of_multi_hot_rows_follow_the_rarest_tag():
  labels = np.array([[1, 0, 0],   # tag 0 (3 rows)  -> 1/3
                     [1, 0, 0],
                     [1, 1, 0],   # tags 0 and 1 (1 row) -> the rarer: 1/1
                     [0, 0, 0],   # untagged (2 rows): a group of their own -> 1/2
                     [0, 0, 0]], np.uint8)
  expected = np.array([1 / 3, 1 / 3, 1, 1 / 2, 1 / 2])
  np.testing.assert_allclose(sampling_lib.balanced_probabilities(labels), expected / expected.sum())
  # One tag a row: the same as class indices.
  one_hot = np.eye(3, dtype=np.uint8)[_imbalanced()]
  np.testing.assert_allclose(sampling_lib.balanced_probabilities(one_hot),
                             sampling_lib.balanced_probabilities(_imbalanced()))


def test_balanced_sampling_of_multi_hot_rows_lifts_the_rare_tag():
  rng = np.random.default_rng(0)
  labels = np.zeros((1000, 3), np.uint8)
  labels[:, 0] = rng.random(1000) < 0.9
  labels[:, 1] = rng.random(1000) < 0.09
  labels[:10, 2] = 1  # 1% rare
  sampler = sampling_lib.BalancedSampler(1, labels, 100)
  drawn = labels[np.concatenate([sampler.indices(s) for s in range(100)])]
  share = drawn.mean(axis=0)
  assert share[2] > 0.2 and share[1] > 0.2  # from 1% and 9% of rows
  assert labels.mean(axis=0)[2] == 0.01


# --- shards -----------------------------------------------------------------------------------


def _shards():
  """9 shards of 24..33 examples, listed shard after shard (tar order within each)."""
  sizes = [30, 24, 27, 33, 25, 29, 28, 31, 26]
  return np.repeat(np.arange(len(sizes), dtype=np.int32), sizes), sizes


@pytest.mark.parametrize('process_count', [1, 2, 3])
def test_shard_assignment_is_disjoint_covering_and_even(process_count):
  shards, sizes = _shards()
  batch_size = 6  # local batch 6, 3 or 2
  samplers = [shard_source.ShardSampler(9, shards, batch_size, p, process_count)
              for p in range(process_count)]
  local = batch_size // process_count
  per_process = [sum(size for k, size in enumerate(sizes) if k % process_count == p)
                 for p in range(process_count)]
  steps = min(per_process) // local
  assert {s.steps_per_epoch for s in samplers} == {steps}  # every process takes the same steps
  seen = [set() for _ in range(process_count)]
  for epoch in range(12):
    visited = []
    for p, sampler in enumerate(samplers):
      rows = np.concatenate([sampler.indices(step) for step in range(epoch * steps, (epoch + 1) * steps)])
      assert len(rows) == steps * local == len(set(rows.tolist()))  # each example at most once an epoch
      assert set((shards[rows] % process_count).tolist()) == {p}  # process p touches only its shards
      visited.append(set(rows.tolist()))
      seen[p] |= visited[-1]
    for a in range(process_count):  # disjoint across processes
      for b in range(a + 1, process_count):
        assert not visited[a] & visited[b]
  # Over a few epochs every example of every shard is read (each epoch leaves out a different tail).
  assert set().union(*seen) == set(range(len(shards)))


def test_shards_stream_in_a_seeded_shard_order_in_tar_order(monkeypatch):
  shards, sizes = _shards()
  monkeypatch.setattr(shard_source, 'SHUFFLE_WINDOW', 1)  # no window shuffle: the raw stream
  sampler = shard_source.ShardSampler(0, shards, 1)
  steps = sampler.steps_per_epoch
  assert steps == len(shards)

  def shard_order(epoch):
    stream = np.concatenate([sampler.indices(step) for step in range(epoch * steps, (epoch + 1) * steps)])
    order = [int(k) for i, k in enumerate(shards[stream]) if i == 0 or k != shards[stream][i - 1]]
    for k in order:  # each shard whole, in tar order
      np.testing.assert_array_equal(stream[shards[stream] == k], np.flatnonzero(shards == k))
    return order

  orders = [shard_order(epoch) for epoch in range(3)]
  assert all(sorted(order) == list(range(9)) for order in orders)  # each shard once an epoch
  assert orders[0] != orders[1] != orders[2] and orders[0] != list(range(9))  # a seeded order each epoch
  assert shard_order(0) == orders[0]


def test_shard_window_shuffle_stays_within_the_window(monkeypatch):
  shards, _ = _shards()

  def epoch(window):  # the sampler orders an epoch when first asked, with the window of that moment
    monkeypatch.setattr(shard_source, 'SHUFFLE_WINDOW', window)
    sampler = shard_source.ShardSampler(0, shards, 2)
    return np.concatenate([sampler.indices(step) for step in range(sampler.steps_per_epoch)])

  a, b = epoch(8), epoch(1)
  assert not np.array_equal(a, b)
  for start in range(0, len(a) - 8, 8):  # each window holds the same examples, reordered
    assert sorted(a[start:start + 8]) == sorted(b[start:start + 8])


def test_shard_batches_resume_exactly_and_hold_only_local_rows():
  shards, _ = _shards()
  labels = (np.arange(len(shards)) % 4).astype(np.int32)
  dataset = _dataset(labels, sampling='shards', shards=shards)
  for p in range(2):
    full = list(loaders.train_batches(dataset, seed=1, batch_size=8, first_step=0, last_step=40,
                                      process_index=p, process_count=2))
    resumed = list(loaders.train_batches(dataset, seed=1, batch_size=8, first_step=17, last_step=40,
                                         process_index=p, process_count=2))
    assert all(batch.labels.shape == (4,) and batch.mask.all() for batch in full)
    for a, b in zip(full[17:], resumed, strict=True):
      np.testing.assert_array_equal(a.images, b.images)
    indices = np.concatenate([batch.images[:, 0, 0, 0] for batch in full[:5]])
    assert set((shards[indices] % 2).tolist()) == {p}  # the pixel is the index (all < 256)


def test_fewer_shards_than_processes_is_one_line():
  shards = np.repeat(np.arange(3, dtype=np.int32), 20)
  with pytest.raises(DataError, match=r'has 3 shards for 4 processes; write the data as at least 4 shards, '
                                      r'or set --config.dataset.sampling=shuffle$'):
    shard_source.ShardSampler(0, shards, 8, 0, 4)
  with pytest.raises(DataError, match=r'process 1 of 2 gets 5 examples .* fewer than its 8 rows'):
    shard_source.ShardSampler(0, np.repeat(np.arange(2, dtype=np.int32), [30, 5]), 16, 0, 2)
  with pytest.raises(DataError, match='is not read from shards; set config.dataset.shards'):
    loaders.train_batches(_dataset(np.zeros(20, np.int32), sampling='shards'), seed=0, batch_size=4,
                          first_step=0, last_step=1)


def test_alternate_flip_under_other_samplers_mirrors_by_example_and_epoch_parity():
  labels = _imbalanced()
  for sampler in (sampling_lib.BalancedSampler(3, labels, 100),
                  shard_source.ShardSampler(3, np.arange(1000) // 100, 100)):
    flips = sampling_lib._first_epoch_flips(3, 1000)
    for step in (0, sampler.steps_per_epoch):  # an even and an odd epoch
      indices = sampler.indices(step)
      np.testing.assert_array_equal(sampler.mirrored(step, indices), flips[indices] ^ (step > 0))


# --- class weights -----------------------------------------------------------------------------


def _weights(setting, labels, class_names=('a', 'b', 'c')):
  return class_weights.class_weights(setting, _examples(labels), class_names)


def test_balanced_class_weights_are_sklearns():
  labels = _imbalanced()
  weights = _weights('balanced', labels)
  assert weights.dtype == np.float32
  np.testing.assert_allclose(weights, [1000 / (3 * 900), 1000 / (3 * 90), 1000 / (3 * 10)], rtol=1e-6)
  np.testing.assert_allclose(weights, compute_class_weight('balanced', classes=np.arange(3), y=labels),
                             rtol=1e-6)
  assert np.mean(weights[labels]) == pytest.approx(1.0)  # the loss keeps its scale
  # A class absent from the train split weighs 1.0; C counts the classes present (sklearn's classes=).
  absent = np.repeat(np.array([0, 2], np.int32), [80, 20])
  weights = _weights('balanced', absent)
  np.testing.assert_allclose(weights, [100 / (2 * 80), 1.0, 100 / (2 * 20)])
  np.testing.assert_allclose(weights[[0, 2]], compute_class_weight('balanced', classes=np.array([0, 2]),
                                                                    y=absent))
  assert _weights('none', absent) is None


def test_balanced_class_weights_of_multi_hot_rows_count_positives():
  labels = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]], np.uint8)
  weights = _weights('balanced', labels)
  np.testing.assert_allclose(weights, [4 / (2 * 3), 4 / (2 * 1), 1.0])


def test_streamed_tfds_split_without_listed_labels_is_one_line():
  records = base.IndexedRecords(None, np.arange(10))
  streamed = pipeline.Examples(source=base.Split(name='train', records=records))
  with pytest.raises(DataError, match=r'class_weights=balanced counts .* set --config.dataset.cache=memory'):
    class_weights.class_weights('balanced', streamed, ('a', 'b'))


@pytest.mark.parametrize('text,name', [
    ('class,weight\ncat,2.5\nfrog,0\n', 'weights.csv'),
    ('cat, 2.5\n\nfrog,0\n', 'weights.csv'),  # no header, spaces and a blank line
    ('{"cat": 2.5, "frog": 0}', 'weights.json'),
    ('{"cat": 2.5, "frog": 0.0}', 'weights.txt'),  # JSON by its content
])
def test_class_weights_from_a_file(tmp_path, text, name):
  path = tmp_path / name
  path.write_text(text)
  weights = _weights(str(path), np.arange(3), ('cat', 'dog', 'frog'))
  np.testing.assert_array_equal(weights, np.array([2.5, 1.0, 0.0], np.float32))  # dog unlisted: 1.0


def test_classes_a_class_weights_file_leaves_out_are_named(tmp_path, caplog):
  path = tmp_path / 'w.csv'
  path.write_text('cat,2\n')
  with caplog.at_level(logging.WARNING):
    weights = _weights(str(path), np.arange(3), ('cat', 'dog', 'frog'))
  assert weights.tolist() == [2.0, 1.0, 1.0]
  assert 'does not list 2 of the 3 classes; they weigh 1.0: dog, frog' in caplog.text


@pytest.mark.parametrize('text,name,message', [
    ('cat,2\nhorse,1\n', 'w.csv', r"w.csv', line 2: class 'horse' is not one of the dataset's 3 classes "
                                  r'\(cat, dog, frog\); correct the name or remove it'),
    # A first row that misspells a class is a row, not a header (issue 43): named with its near miss.
    ('dgo,heavy\ncat,2\n', 'w.csv', r"w.csv', line 1: class 'dgo' is not one of the dataset's 3 classes "
                                    r"\(did you mean 'dog'\?\) \(cat, dog, frog\)"),
    ('Class,Weight\nglass,2\n', 'w.csv', r"line 2: class 'glass' is not one of"),  # a header word is one
    ('cat,-1\n', 'w.csv', r"line 1: the weight of class 'cat' is '-1', not a finite number >= 0"),
    ('class,weight\ncat,heavy\n', 'w.csv', r"line 2: the weight of class 'cat' is 'heavy', not a finite"),
    ('cat,nan\n', 'w.csv', r"the weight of class 'cat' is 'nan'"),
    ('cat,1,2\n', 'w.csv', r'line 1: 3 cells \(cat,1,2\); write one class,weight pair a line'),
    ('cat,1\ncat,2\n', 'w.csv', r"line 2: class 'cat' is weighted twice"),
    ('{"cat": "heavy"}', 'w.json', r"key 'cat': the weight of class 'cat' is 'heavy', not a finite number"),
    ('{"cat": true}', 'w.json', r"the weight of class 'cat' is True"),
    ('{"cat": 1,}', 'w.json', r'w.json' + "'" + r' is not valid JSON \(.*\); write an object'),
    ('[["cat", 1]]', 'w.json', r'holds a JSON list, not an object'),
    (None, 'missing.csv', r"missing.csv' cannot be read \(No such file or directory\); give a CSV"),
    ('class,weight\n', 'w.csv', r"w.csv' weighs no class; write class,weight lines"),
    ('{}', 'w.json', r"w.json' weighs no class"),
    ('cat,0\ndog,0\nfrog,0.0\n', 'w.csv', r"w.csv' weighs every class 0, so the loss would be 0"),
    ('cat,inf\n', 'w.csv', r"the weight of class 'cat' is 'inf', not a finite number >= 0"),
])
def test_class_weight_file_mistakes_are_one_line(tmp_path, text, name, message):
  path = tmp_path / name
  if text is not None:
    path.write_text(text)
  with pytest.raises(DataError, match=message) as raised:
    _weights(str(path), np.arange(3), ('cat', 'dog', 'frog'))
  assert '\n' not in str(raised.value)


# --- multi-hot labels through the pipeline --------------------------------------------------------


@pytest.fixture(scope='module')
def multi_hot_split(tmp_path_factory):
  """48 8x8 PNGs with random multi-hot rows over 4 tags (some rows empty), as a split of files."""
  folder = make_image_folder(tmp_path_factory.mktemp('tags'))
  split, _ = folder_source.folder_split(folder, 'train')
  labels = (np.random.default_rng(0).random((len(split), 4)) < 0.4).astype(np.uint8)
  assert (labels.sum(axis=1) == 0).any() and (labels.sum(axis=1) > 1).any()
  return base.Split(name='train', records=split.records, labels=labels)


def _from_split(split, *, cache, size=0, skip_corrupt=False):
  transform = pipeline.Transform(size=size)
  examples = cache_lib.examples(split, cache=cache, transform=transform, num_workers=0,
                                skip_corrupt=skip_corrupt)
  return pipeline.Dataset(train=examples, eval=examples, class_names=('a', 'b', 'c', 'd'),
                          image_shape=(size or 8, size or 8, 3), mean=np.zeros(3), std=np.ones(3),
                          transform=transform, skip_corrupt=skip_corrupt, multilabel=True)


@pytest.mark.parametrize('size', [0, 8])  # 0: cached batches are slices; 8: cropped from the cache
def test_multi_hot_labels_are_the_same_cached_and_streamed(multi_hot_split, size):
  cached, streamed = (_from_split(multi_hot_split, cache=cache, size=size) for cache in (True, False))
  assert cached.train.labels.dtype == np.uint8 and cached.train.labels.shape == (48, 4)
  np.testing.assert_array_equal(cached.train.labels, multi_hot_split.labels)
  for sampling in ('shuffle', 'balanced'):
    batches = [list(loaders.train_batches(dataclasses.replace(d, sampling=sampling), seed=3, batch_size=8,
                                          first_step=4, last_step=9)) for d in (cached, streamed)]
    for a, b in zip(*batches, strict=True):
      assert a.labels.dtype == b.labels.dtype == np.uint8 and a.labels.shape == (8, 4)
      np.testing.assert_array_equal(a.labels, b.labels)
      np.testing.assert_array_equal(a.images, b.images)
    indices = sampling_lib.sampler(cached, seed=3, batch_size=8).indices(4) if sampling == 'shuffle' else None
    if indices is not None:
      np.testing.assert_array_equal(batches[0][0].labels, multi_hot_split.labels[indices])


@pytest.mark.parametrize('cache', [True, False])
def test_eval_padding_keeps_multi_hot_rows(multi_hot_split, cache):
  dataset = _from_split(multi_hot_split, cache=cache)
  batches = list(loaders.eval_batches(dataset, batch_size=20))  # 48 = 20 + 20 + 8 and 12 padding rows
  assert [int(b.mask.sum()) for b in batches] == [20, 20, 8]
  for batch in batches:
    assert batch.labels.shape == (20, 4) and batch.labels.dtype == np.uint8
  np.testing.assert_array_equal(np.concatenate([b.labels[b.mask] for b in batches]), multi_hot_split.labels)
  np.testing.assert_array_equal(batches[-1].labels[~batches[-1].mask],
                                np.repeat(multi_hot_split.labels[:1], 12, axis=0))  # example 0 pads
  # Two processes' rows are the whole batch's.
  parts = [list(loaders.eval_batches(dataset, batch_size=20, process_index=p, process_count=2))
           for p in range(2)]
  for whole, first, second in zip(batches, *parts, strict=True):
    np.testing.assert_array_equal(np.concatenate([first.labels, second.labels]), whole.labels)


def test_skip_corrupt_substitutes_the_next_examples_multi_hot_row(multi_hot_split, tmp_path):
  broken = multi_hot_split.records.paths.copy()
  with open(tmp_path / 'broken.png', 'wb') as f:
    f.write(b'not a png')
  broken[5] = os.fsencode(str(tmp_path / 'broken.png'))  # an absolute path: join keeps it
  split = base.Split(name='train', records=folder_source.FileRecords(multi_hot_split.records.root, broken),
                     labels=multi_hot_split.labels)
  transform = pipeline.Transform()
  reader = loaders._ExampleReader(pipeline.Examples(source=split), transform, skip_corrupt=True)
  decode = functools.partial(preprocess.eval_image, transform=transform)  # what the loaders pass
  image, label = reader.read(5, decode)
  np.testing.assert_array_equal(label, multi_hot_split.labels[6])
  np.testing.assert_array_equal(image, decode(split.load(6)[0]))  # example 6 stands in, image and label
  assert label.dtype == np.uint8
  _, label = reader.read(4, decode)
  np.testing.assert_array_equal(label, multi_hot_split.labels[4])
  # Cached: the broken file is left out, the rows stay with their images.
  cached = _from_split(split, cache=True, skip_corrupt=True)
  np.testing.assert_array_equal(cached.train.labels, np.delete(multi_hot_split.labels, 5, axis=0))


def test_load_computes_class_weights_from_the_train_split_only(tmp_path):
  folder = make_image_folder(tmp_path, train_per_class=16, test_per_class=2)
  for name in sorted(os.listdir(tmp_path / 'train' / 'cat'))[4:]:  # cat keeps 4 of its 16
    os.remove(tmp_path / 'train' / 'cat' / name)
  config = _config(**{'dataset.folder': folder, 'dataset.class_weights': 'balanced',
                      'dataset.sampling': 'balanced'})
  dataset = pipeline.load(config)
  np.testing.assert_allclose(dataset.class_weights, [36 / (3 * 4), 36 / (3 * 16), 36 / (3 * 16)])
  assert dataset.sampling == 'balanced' and not dataset.multilabel
  chosen = sampling_lib.sampler(dataset, seed=0, batch_size=12)
  drawn = dataset.train.labels[np.concatenate([chosen.indices(step) for step in range(300)])]
  np.testing.assert_allclose(np.bincount(drawn) / len(drawn), 1 / 3, atol=0.02)
  assert pipeline.load(config, need_train=False).class_weights is None  # evaluating: no loss weights


@pytest.fixture(scope='module')
def shard_set(tmp_path_factory):
  """A 3-class image folder (16 train, 7 test images a class) written as 3 tar shards a split (few
  enough to be indexed in this process, without starting workers)."""
  from benchmarks.data import make_shards
  root = tmp_path_factory.mktemp('shard_set')
  folder = make_image_folder(root / 'folder')
  examples, class_names = make_shards.folder_examples(folder)
  return make_shards.make_shards(examples, class_names, str(root / 'shards'), shards=3)


def test_tar_shards_stream_per_process_the_same_cached_or_not_and_resume_exactly(shard_set):
  cached, streamed = (pipeline.load(_config(**{'dataset.shards': shard_set, 'dataset.sampling': 'shards',
                                               'dataset.cache': cache})) for cache in ('memory', 'none'))
  assert cached.train.cached and not streamed.train.cached and len(cached.train) == 48
  shards = cached.train.example_groups
  np.testing.assert_array_equal(shards, streamed.train.example_groups)
  assert sorted(set(shards.tolist())) == list(range(3))
  for process_count in (1, 2):
    for p in range(process_count):
      layout = dict(batch_size=6, process_index=p, process_count=process_count)
      chosen = sampling_lib.sampler(cached, seed=5, **layout)
      full = [list(loaders.train_batches(d, seed=5, first_step=0, last_step=12, **layout))
              for d in (cached, streamed)]
      resumed = list(loaders.train_batches(streamed, seed=5, first_step=7, last_step=12, **layout))
      for step, (a, b) in enumerate(zip(*full, strict=True)):
        indices = chosen.indices(step)
        assert set((shards[indices] % process_count).tolist()) == {p}  # only this process's shards
        np.testing.assert_array_equal(a.labels, cached.train.labels[indices])
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.images, b.images)
      for a, b in zip(full[1][7:], resumed, strict=True):
        np.testing.assert_array_equal(a.images, b.images)
  with pytest.raises(DataError, match='has 3 shards for 4 processes'):
    sampling_lib.examples_per_epoch(cached, batch_size=8, process_count=4)


def test_a_multilabel_label_file_loads_the_same_cached_and_streamed(tmp_path):
  folder = make_image_folder(tmp_path / 'images', train_per_class=8, test_per_class=3)
  rng = np.random.default_rng(1)
  tags = ('cat', 'dog', 'frog', 'bird')  # bird only on a few train rows
  lines = ['path,labels,split']
  for split in ('train', 'test'):
    for path in sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(
        os.path.join(folder, split)) for f in files):
      chosen = [tag for tag in tags[:3] if rng.random() < 0.4] + (['bird'] if rng.random() < 0.1 else [])
      lines.append(f'{path},{";".join(chosen)},{split}')
  (tmp_path / 'labels.csv').write_text('\n'.join(lines) + '\n')
  loaded = []
  for cache in ('memory', 'none'):
    config = _config(**{'dataset.labels': str(tmp_path / 'labels.csv'), 'dataset.folder': folder,
                        'dataset.cache': cache, 'task': 'multilabel', 'dataset.sampling': 'balanced',
                        'dataset.class_weights': 'balanced'})
    loaded.append(pipeline.load(config))
  cached, streamed = loaded
  assert cached.multilabel and cached.train.cached and not streamed.train.cached
  labels = cached.train.labels
  assert labels.dtype == np.uint8 and labels.shape == (24, len(cached.class_names))
  np.testing.assert_array_equal(labels, streamed.train.listed_labels)
  counts = labels.sum(axis=0)
  present = counts > 0
  expected = np.where(present, 24 / (present.sum() * np.maximum(counts, 1)), 1.0)
  np.testing.assert_allclose(cached.class_weights, expected, rtol=1e-6)
  for a, b in zip(*(loaders.train_batches(d, seed=0, batch_size=8, first_step=0, last_step=6)
                    for d in (cached, streamed)), strict=True):
    assert a.labels.shape == (8, len(cached.class_names)) and a.labels.dtype == np.uint8
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.images, b.images)
  for a, b in zip(*(loaders.eval_batches(d, batch_size=4) for d in (cached, streamed)), strict=True):
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.mask, b.mask)
