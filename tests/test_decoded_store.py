"""Decoding into memory: open files stay flat in worker processes, JPEG pixels match Pillow's, and
decoded splits kept on disk (`dataset.decoded_cache_dir`) are read back only while their files and
settings stay the same; a corrupt one is rebuilt."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from configs import cifar10
from conftest import ROOT, make_image_folder
from flaxtpu.data import cache, decoded_store, pipeline, preprocess
from flaxtpu.validation import config as config_lib


def _config(folder, store, **overrides):
  config = cifar10.get_config()
  config.dataset.folder = folder
  config.dataset.decoded_cache_dir = store
  config.input.workers = 0
  config.update_from_flattened_dict(overrides)
  return config


def _jpeg_folder(root, per_class, size=12, classes=('a', 'b')):
  rng = np.random.default_rng(0)
  for split, count in (('train', per_class), ('test', 4)):
    for label, name in enumerate(classes):
      os.makedirs(os.path.join(root, split, name), exist_ok=True)
      for i in range(count):
        pixels = (rng.integers(0, 80, (size, size, 3)) + 90 * label).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, split, name, f'{i:04d}.jpg'), quality=90)
  return str(root)


# Run in a fresh interpreter: the limit on open files must not starve pytest's own.
_OPEN_FILES_SCRIPT = textwrap.dedent('''
    import json, os, resource, sys
    import numpy as np
    from configs import cifar10
    from flaxtpu.data import loaders, pipeline, workers

    def open_files():
      return len(os.listdir('/proc/self/fd'))

    def main():
      limit, steps = int(sys.argv[2]), int(sys.argv[3])
      resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
      config = cifar10.get_config()
      config.dataset.folder, config.dataset.decoded_cache_dir = sys.argv[1], 'none'
      config.input.workers = 2
      before = open_files()
      counts = []
      progress = workers.with_progress
      def counting(chunks, *args, **kwargs):  # samples the open files as each chunk arrives
        for chunk in progress(chunks, *args, **kwargs):
          counts.append(open_files())
          yield chunk
      workers.with_progress = counting
      dataset = pipeline.load(config)
      decoded = open_files()
      config.dataset.cache = 'none'  # the same files streamed by worker processes, batch by batch
      streamed = pipeline.load(config)
      for step, _ in enumerate(loaders.train_batches(streamed, seed=0, batch_size=32, first_step=0,
                                                     last_step=steps)):
        if step % 20 == 0:
          counts.append(open_files())
      print(json.dumps({'images': len(dataset.train), 'before': before, 'decoded': decoded,
                        'most': max(counts), 'counts': counts, 'after': open_files(),
                        'samples': len(counts)}))

    if __name__ == '__main__':
      main()
''')


@pytest.mark.skipif(not os.path.isdir('/proc/self/fd'), reason='counts open files in /proc (Linux)')
def test_open_files_stay_flat_while_worker_processes_decode(tmp_path):
  """4,000 images decoded into memory and 300 streamed batches under a limit of 256 open files.

  Before, grain's hand-over gave every decoded image a shared-memory block (a file descriptor)
  of its own, 500 per result, freed later by one background thread: Errno 24 on a TPU host. Now
  results come back through the worker pool's pipes.
  """
  folder = _jpeg_folder(tmp_path / 'data', per_class=2000, size=8)
  environment = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'}
  done = subprocess.run([sys.executable, '-c', _OPEN_FILES_SCRIPT, folder, '256', '300'], cwd=ROOT,
                        capture_output=True, text=True, timeout=600, env=environment)
  assert done.returncode == 0, done.stderr[-3000:]
  counts = json.loads(done.stdout.strip().splitlines()[-1])
  assert counts['images'] == 4000 and counts['samples'] >= 6
  # Two worker processes hold a few pipes each, whatever the images or batches (15 here throughout); a
  # descriptor kept per image or per batch would pass the limit of 256 many times over.
  assert counts['most'] - counts['before'] <= 24, counts['counts']
  assert counts['after'] - counts['before'] <= 2, counts
  # Python's resource tracker names shared-memory blocks a process left behind (/dev/shm is shared by
  # every process of the machine, so counting its files would count theirs).
  assert 'leaked shared_memory' not in done.stderr, done.stderr[-2000:]


def test_jpeg_pixels_decoded_into_memory_equal_pillows(tmp_path):
  folder = _jpeg_folder(tmp_path, per_class=5, size=20)
  path = os.path.join(folder, 'train', 'a', '0003.jpg')
  ours = preprocess.shorter_side_at_most(path, 3)
  assert ours.dtype == np.uint8 and ours.shape == (20, 20, 3)
  np.testing.assert_array_equal(ours, np.asarray(Image.open(path).convert('RGB')))
  # Shrunk to a shorter side: the shape kept in memory for crops of that side.
  wide = tmp_path / 'wide.jpg'
  Image.new('RGB', (400, 100), (200, 30, 30)).save(wide, quality=95)
  shrunk = preprocess.shorter_side_at_most(str(wide), 3, side=50)
  assert shrunk.shape == (50, 200, 3) and np.abs(shrunk.astype(int) - [200, 30, 30]).max() <= 3


def test_processes_and_threads_decode_the_same_pixels(tmp_path):
  folder = _jpeg_folder(tmp_path / 'data', per_class=40)
  arrays = {}
  for workers, threads in ((0, False), (2, False), (2, True)):
    config = _config(folder, 'none', **{'input.workers': workers, 'input.threads': threads})
    arrays[workers, threads] = pipeline.load(config).train.images
  first = arrays[0, False]
  assert first.shape == (80, 12, 12, 3)
  for images in arrays.values():
    np.testing.assert_array_equal(images, first)


def test_decoded_split_is_read_back_until_a_file_changes(tmp_path, monkeypatch):
  folder = _jpeg_folder(tmp_path / 'data', per_class=30)
  store = str(tmp_path / 'store')
  first = pipeline.load(_config(folder, store))
  stored = sorted(os.listdir(store))
  assert len(stored) == 2 and all(name.endswith('.npz') for name in stored)  # train and test

  decodes = []
  real_decode = cache._decode
  monkeypatch.setattr(cache, '_decode', lambda split, *args: decodes.append(split.name) or
                      real_decode(split, *args))
  again = pipeline.load(_config(folder, store))
  assert decodes == []  # both splits read back
  np.testing.assert_array_equal(again.train.images, first.train.images)
  np.testing.assert_array_equal(again.eval.images, first.eval.images)
  np.testing.assert_array_equal(again.train.labels, first.train.labels)

  # A file rewritten (new pixels, same name), then one added: each run decodes train afresh.
  changed = os.path.join(folder, 'train', 'b', '0007.jpg')
  Image.new('RGB', (12, 12), (255, 255, 255)).save(changed)
  rewritten = pipeline.load(_config(folder, store))
  assert decodes == ['train']
  white = lambda dataset: int((dataset.train.images.min(axis=(1, 2, 3)) >= 250).sum())
  assert white(first) == 0 and white(rewritten) == 1
  Image.new('RGB', (12, 12), (0, 0, 0)).save(os.path.join(folder, 'train', 'a', '9999.jpg'))
  assert len(pipeline.load(_config(folder, store)).train) == 61 and decodes == ['train', 'train']
  # Other decode settings (images kept at a shorter side of ceil(8 / 0.875) for 8 px crops) are
  # another key; the images then stay a list, each a view of the stored pixels.
  smaller = pipeline.load(_config(folder, store, **{'dataset.image_size': 8})).train.images
  assert decodes == ['train', 'train', 'train', 'test']
  assert {image.shape for image in smaller} == {(10, 10, 3)}
  again = pipeline.load(_config(folder, store, **{'dataset.image_size': 8})).train.images
  assert len(decodes) == 4 and all(np.array_equal(a, b) for a, b in zip(again, smaller))


def test_the_stat_pass_gives_the_same_lines_in_a_child_process_as_in_this_one(tmp_path, monkeypatch):
  """The key's stat() lines come from a child process (its threads then wait on no GIL); they equal the
  in-process ones, which stand in where no child can run: in order, a missing file and a name that is
  not UTF-8 included."""
  names = [b'a.jpg', b'caf\xe9.jpg', b'gone.jpg', b'b.jpg']
  for name in names[:2] + names[3:]:
    with open(os.path.join(os.fsencode(tmp_path), name), 'wb') as f:
      f.write(b'x' * len(name))
  paths = [os.path.join(os.fsencode(tmp_path), name) for name in names] * 300  # several chunks
  here = decoded_store.file_stats.lines(paths, 4)
  assert decoded_store.stat_lines(paths, 4) == here
  rows = here.split(b'\n')[:4]
  assert rows[0].endswith(b'\x005 %d' % os.stat(paths[0]).st_mtime_ns)
  assert rows[1].startswith(paths[1] + b'\x00') and rows[2] == paths[2] + b'\x00unreadable 2'
  children = []

  def no_child(*args, **kwargs):
    children.append(args)
    raise OSError('no child')
  monkeypatch.setattr(subprocess, 'run', no_child)
  assert decoded_store.stat_lines(paths, 4) == here and len(children) == 1
  assert decoded_store.stat_lines([], 4) == b''


def test_corrupt_stored_split_is_rebuilt_not_trusted(tmp_path, caplog):
  folder = _jpeg_folder(tmp_path / 'data', per_class=30)
  store = str(tmp_path / 'store')
  first = pipeline.load(_config(folder, store))
  split = pipeline.sources.get(pipeline.DatasetSpec.of(_config(folder, store))).splits('train', 'test',
                                                                                       None)[0]
  path = decoded_store.path_of(store, decoded_store.key(split, 3, 0))
  with open(path, 'r+b') as f:  # one byte of the pixels flipped, the file's size unchanged
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0xFF]))
  with caplog.at_level('WARNING'):
    rebuilt = pipeline.load(_config(folder, store))
  warnings = [r.getMessage() for r in caplog.records if 'decoded cache' in r.getMessage()]
  assert len(warnings) == 1 and path in warnings[0] and 'decoding the images again' in warnings[0]
  np.testing.assert_array_equal(rebuilt.train.images, first.train.images)
  with np.load(path) as stored:  # rewritten whole
    np.testing.assert_array_equal(stored['pixels'], first.train.images.reshape(-1))
  # Truncated (a run killed mid-copy, a full disk): the same.
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 3)
  caplog.clear()
  with caplog.at_level('WARNING'):
    np.testing.assert_array_equal(pipeline.load(_config(folder, store)).train.images, first.train.images)
  assert sum('decoded cache' in r.getMessage() for r in caplog.records) == 1


def test_decoded_cache_dir_default_none_and_remote(tmp_path, monkeypatch):
  folder = make_image_folder(tmp_path / 'data', train_per_class=4, test_per_class=2)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'user_cache'))
  pipeline.load(_config(folder, 'none'))
  assert not os.path.exists(tmp_path / 'user_cache')
  pipeline.load(_config(folder, ''))  # the user's cache folder
  assert len(os.listdir(tmp_path / 'user_cache' / 'flaxtpu' / 'decoded')) == 2
  with pytest.raises(config_lib.ConfigError, match='decoded_cache_dir.*must be a local folder'):
    config_lib.validate(_config(folder, 'gs://bucket/cache'))


def test_splits_no_run_read_for_a_month_are_removed(tmp_path):
  folder = _jpeg_folder(tmp_path / 'data', per_class=10)
  store = tmp_path / 'store'
  pipeline.load(_config(folder, str(store)))
  kept = sorted(os.listdir(store))
  month_ago = os.path.getmtime(store / kept[0]) - (decoded_store.UNUSED_DAYS + 1) * 86400
  for name in ('old_dataset.npz', 'old_dataset.npz.tmp-123'):  # an edited dataset, a killed write
    (store / name).write_bytes(b'x')
    os.utime(store / name, (month_ago, month_ago))
  os.utime(store / kept[0], (month_ago, month_ago))
  pipeline.load(_config(folder, str(store)))  # reads both back: each marked used now
  assert sorted(os.listdir(store)) == sorted(kept + ['old_dataset.npz', 'old_dataset.npz.tmp-123'])
  pipeline.load(_config(folder, str(store), **{'dataset.image_size': 8}))  # writes: prunes
  assert not {'old_dataset.npz', 'old_dataset.npz.tmp-123'} & set(os.listdir(store))
  assert set(kept) <= set(os.listdir(store)) and len(os.listdir(store)) == 4


def test_pruning_skips_a_file_another_run_removes_meanwhile(tmp_path, monkeypatch):
  store = tmp_path / 'store'
  store.mkdir()
  for name in ('a.npz', 'b.npz'):
    (store / name).write_bytes(b'x')
  real_getmtime = os.path.getmtime

  def removed_meanwhile(path):
    if path.endswith('a.npz'):
      raise FileNotFoundError(2, 'No such file or directory', path)
    return real_getmtime(path)

  monkeypatch.setattr(os.path, 'getmtime', removed_meanwhile)
  decoded_store._remove_unused(str(store), now=real_getmtime(store / 'b.npz') + 31 * 86400)
  assert sorted(os.listdir(store)) == ['a.npz']  # b pruned, a left to whoever holds it
