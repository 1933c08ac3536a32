"""Labels beside the images: label files (CSV, JSON Lines), WebDataset tar shards, parquet."""

import io
import json
import logging
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from benchmarks.data import make_shards
from conftest import ROOT, cli_env, make_image_folder
from flaxtpu.data import loaders, pipeline, sources
from flaxtpu.data.sources import DataError, shards, tagged
from flaxtpu.settings import defaults

CLASSES = ('cat', 'dog', 'frog')


def _png(path, value=0, size=8) -> bytes:
  """An 8x8 RGB PNG of one brightness (a class's), written to `path` (if given); its bytes."""
  buffer = io.BytesIO()
  pixels = np.full((size, size, 3), value, np.uint8) + np.arange(size, dtype=np.uint8)[:, None, None]
  Image.fromarray(pixels).save(buffer, format='PNG')
  if path:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(buffer.getvalue())
  return buffer.getvalue()


def _write(path, text) -> str:
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return str(path)


def _dataset(task='multiclass', **keys):
  config = defaults.get_config()
  config.dataset.update(keys)
  return sources.get(config.dataset, task)


def _photos(root, count=12):
  """`count` images per class in one flat folder (any layout works), a label file row each."""
  rows = []
  for label, name in enumerate(CLASSES):
    for i in range(count):
      relative = f'photos/{name[0]}{i:02d}.png'
      _png(os.path.join(root, relative), 80 * label)
      rows.append((relative, name, 'train' if i < count * 2 // 3 else 'test'))
  return rows


# --- label files -------------------------------------------------------------------------------


def test_csv_header_with_split_column_gives_its_splits_and_sorted_classes(tmp_path):
  rows = _photos(tmp_path)
  labels = _write(tmp_path / 'labels.csv', 'path,label,split\n' + ''.join(
      f'{path},{label},{split}\n' for path, label, split in rows))
  train, evaluation, class_names = _dataset(labels=labels).splits('train', 'test', None)
  assert class_names == CLASSES and (len(train), len(evaluation)) == (24, 12)
  assert train.labels.dtype == np.int32 and np.bincount(train.labels).tolist() == [8, 8, 8]
  for split in (train, evaluation):
    for i in range(len(split)):
      path, label = split.load(i)
      assert os.path.basename(path)[0] == CLASSES[label][0] and isinstance(label, int)
      assert path.startswith(str(tmp_path))  # the label file's folder is the image folder
  assert train.groups is None


def test_labels_column_is_multi_hot_for_multilabel_and_refused_for_multiclass(tmp_path):
  for name in ('a', 'b', 'c', 'd'):
    _png(tmp_path / 'img' / f'{name}.png')
  labels = _write(tmp_path / 'tags.csv', 'image,labels\nimg/a.png,car;person\nimg/b.png,\n'
                                         'img/c.png, person \nimg/d.png,tree;car;car\n')
  _, split, class_names = _dataset('multilabel', labels=labels).splits(None, 'all', None)
  assert class_names == ('car', 'person', 'tree')
  assert split.labels.dtype == np.uint8
  assert split.labels.tolist() == [[1, 1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 1]]
  item, label = split.load(3)
  assert item.endswith('d.png') and label.tolist() == [1, 0, 1]
  with pytest.raises(DataError, match=r'line 2 of .*tags.csv \(img/a.png\) has 2 labels \(car;person\); .*'
                                      r'set --config.task=multilabel'):
    _dataset(labels=labels).splits(None, 'all', None)


def test_headerless_rows_and_json_lines_read_as_a_header_does(tmp_path):
  for name in ('a', 'b', 'c'):
    _png(tmp_path / f'{name}.jpg.png')
  headerless = _write(tmp_path / 'rows.csv', 'a.jpg.png,10,2\nb.jpg.png,2\nc.jpg.png\n')
  jsonl = _write(tmp_path / 'rows.jsonl', '{"path": "a.jpg.png", "labels": [10, 2]}\n\n'
                                          '{"path": "b.jpg.png", "labels": "2"}\n'
                                          '{"path": "c.jpg.png", "labels": []}\n')
  expected = [[1, 1], [1, 0], [0, 0]]
  for labels in (headerless, jsonl):
    _, split, class_names = _dataset('multilabel', labels=labels).splits(None, 'all', None)
    assert class_names == ('2', '10')  # numerically sorted
    assert split.labels.tolist() == expected
  single = _write(tmp_path / 'one.jsonl',
                  '{"img": "a.jpg.png", "label": 10}\n{"img": "b.jpg.png", "label": "x"}\n')
  _, split, class_names = _dataset(labels=single).splits(None, 'all', None)
  assert class_names == ('10', 'x') and split.labels.tolist() == [0, 1]


def test_slices_of_all_partition_the_file_and_keep_class_proportions(tmp_path):
  rows = _photos(tmp_path, count=10)
  labels = _write(tmp_path / 'labels.csv', 'file,label\n' + ''.join(f'{p},{c}\n' for p, c, _ in rows))
  source = _dataset(labels=labels)
  train, held_out, _ = source.splits('all[:80%]', 'all[80%:]', None)
  assert np.bincount(train.labels).tolist() == [8, 8, 8]
  assert np.bincount(held_out.labels).tolist() == [2, 2, 2]
  train_paths, held_out_paths = set(train.records.paths), set(held_out.records.paths)
  assert not train_paths & held_out_paths and len(train_paths | held_out_paths) == 30
  again, _, _ = _dataset(labels=labels).splits('all[:80%]', 'all[80%:]', None)
  assert (again.records.paths == train.records.paths).all()  # a fixed order: the same slice in every run
  with pytest.raises(DataError, match=r"has no split column, so its one split is 'all': hold out a part with "
                                      r"--config.dataset.train_split='all\[:80%\]'"):
    source.splits('train', 'test', None)


def test_multi_tag_rows_stratify_on_their_first_tag(tmp_path):
  lines = []
  for i in range(20):
    _png(tmp_path / f'{i}.png')
    lines.append(f'{i}.png,{"a;b" if i < 10 else "b" if i < 18 else ""}\n')  # first tags: 10 a, 8 b, 2 none
  labels = _write(tmp_path / 'l.csv', 'path,labels\n' + ''.join(lines))
  train, held_out, _ = _dataset('multilabel', labels=labels).splits('all[:50%]', 'all[50%:]', None)
  first = lambda split: [('a' if row[0] else 'b' if row[1] else '-') for row in split.labels]
  assert sorted(first(train)) == ['-'] + ['a'] * 5 + ['b'] * 4
  assert sorted(first(held_out)) == ['-'] + ['a'] * 5 + ['b'] * 4


def test_an_eval_only_load_matches_the_checkpoints_classes_by_name(tmp_path):
  rows = _photos(tmp_path, count=3)
  labels = _write(tmp_path / 'labels.csv', 'path,label\n' + ''.join(f'{p},{c}\n' for p, c, _ in rows))
  checkpoint = ('frog', 'bird', 'cat', 'dog')
  _, split, class_names = _dataset(labels=labels).splits(None, 'all', checkpoint)
  assert class_names == checkpoint
  for i in range(len(split)):
    path, label = split.load(i)
    assert os.path.basename(path)[0] == checkpoint[label][0]
  with pytest.raises(DataError, match=r"split 'all' of .*labels.csv has labels the model is not trained on: "
                                      r"frog \(3 examples\); .*unknown_classes=drop"):
    _dataset(labels=labels).splits(None, 'all', ('cat', 'dog'))
  _, kept, _ = _dataset(labels=labels, unknown_classes='drop').splits(None, 'all', ('cat', 'dog'))
  assert sorted(kept.labels.tolist()) == [0, 0, 0, 1, 1, 1]
  _, tags, _ = _dataset('multilabel', labels=labels, unknown_classes='drop').splits(
      None, 'all', ('dog', 'cat'))
  assert tags.labels.sum(axis=0).tolist() == [3, 3] and len(tags) == 9  # frogs stay, untagged


def test_a_class_only_the_eval_split_has_is_not_made_a_class_of_the_model(tmp_path):
  # One class list, taken from training: a test-only class in a label file is the unknown-label error.
  rows = [(p, c, s) for p, c, s in _photos(tmp_path, count=3) if c != 'frog' or s == 'test']
  labels = _write(tmp_path / 'labels.csv',
                  'path,label,split\n' + ''.join(f'{p},{c},{s}\n' for p, c, s in rows))
  with pytest.raises(DataError, match=r"split 'test' of .*labels.csv has labels the model is not trained on: "
                                      r'frog \(1 examples\)'):
    _dataset(labels=labels).splits('train', 'test', None)
  train, test, class_names = _dataset(labels=labels, unknown_classes='drop').splits('train', 'test', None)
  assert class_names == ('cat', 'dog') and test.labels.tolist() == [0, 1]


@pytest.mark.parametrize('value, close', [('Train', 'train'), ('tset', 'test'), ('valid', 'val')])
def test_a_split_value_that_looks_like_a_split_the_run_reads_is_one_line(tmp_path, value, close):
  eval_split = 'val' if close == 'val' else 'test'
  rows = [(p, c, eval_split if s == 'test' else s) for p, c, s in _photos(tmp_path, count=3)]
  first = next(i for i, (_, _, s) in enumerate(rows) if s == close)  # one row's value misspelt
  labels = _write(tmp_path / 'labels.csv', 'path,label,split\n' + ''.join(
      f'{p},{c},{value if i == first else s}\n' for i, (p, c, s) in enumerate(rows)))
  with pytest.raises(DataError, match=r'labels.csv has split values that are not a split this run reads but '
                                      rf"look like one: '{value}' \(1 examples; '{close}'\?\); .*the run "
                                      rf'reads train, {eval_split}'):
    _dataset(labels=labels, eval_split=eval_split).splits('train', eval_split, None)


def test_a_split_the_run_does_not_read_is_left_out_with_a_warning(tmp_path, caplog):
  rows = _photos(tmp_path, count=6)
  labels = _write(tmp_path / 'labels.csv', 'path,label,split\n' + ''.join(
      f'{p},{c},{"validation" if i % 6 == 5 else s}\n' for i, (p, c, s) in enumerate(rows)))
  with caplog.at_level(logging.WARNING):
    train, test, _ = _dataset(labels=labels).splits('train', 'test', None)
  assert (len(train), len(test)) == (12, 3)
  assert ("leaving out the examples of splits this run does not read (it reads train, test): 'validation' "
          '(3 examples)') in caplog.text


def test_an_image_folder_elsewhere_and_a_missing_image_skipped_on_request(tmp_path, caplog):
  _png(tmp_path / 'images' / 'x' / 'a.png')
  labels = _write(tmp_path / 'l.csv', 'path,label\nx/a.png,cat\nx/gone.png,dog\n')
  with pytest.raises(DataError, match=r'image .*images/x/gone.png \(line 3 of .*l.csv\) does not exist; fix '
                                      r'the path .* or set --config.dataset.skip_corrupt=true'):
    _dataset(labels=labels, folder=str(tmp_path / 'images')).splits(None, 'all', None)
  with caplog.at_level(logging.WARNING):
    _, split, class_names = _dataset(labels=labels, folder=str(tmp_path / 'images'),
                                     skip_corrupt=True).splits(None, 'all', None)
  assert len(split) == 1 and class_names == ('cat',) and 'x/gone.png' in caplog.text


@pytest.mark.parametrize('text, message', [
    ('path,label\n../out.png,cat\n', r'line 2 of .*: image ../out.png is outside the image folder .*; write '
                                     r'paths inside it'),
    ('path,label\n/etc/passwd.png,cat\n', r'line 2 of .*: image /etc/passwd.png is outside the image folder'),
    ('path,label,width\na.png,cat,8\n', r"has columns flaxtpu does not read: 'width'; it reads an image "
                                        r'column \(path, image, img, file, filename\), a label column'),
    ('pth,label\na.png,cat\n', r'has no image column \(its columns: pth, label\); name it path or image'),
    ('path,label\na.png,\n', r'line 2 of .* \(a.png\) has no label; give every image one .* set '
                             r'--config.task=multilabel'),
    ('path,label\na.png,cat\nb.png,dog\n./a.png,cat\n',
     r'image a.png is listed twice in .*, on lines 2 and 4'),
    ('path,label\na.png,cat,extra\n', r'line 2 of .* has 3 cells but the header has 2 columns; quote cells'),
    ('{"path": "a.png", "label": "cat"}\n{"path": "b.png" "label": 1}\n', r'line 2 of .* is not valid JSON'),
    ('path,label,split\na.png,cat,train\nb.png,dog,val\n',
     r"split 'test' is not in .*; its split column holds: train, val"),
    ('cat,a.png\n', r'the first row of .* \(cat, a.png\) is neither a header .* nor a row path,label'),
    ('{"path": "a.png", "label": "cat", "split": "train"}\n{"path": "b.png", "label": "dog"}\n',
     r'line 2 of .*l.jsonl has no split while other lines have one'),
])
def test_label_file_problems_are_one_line_naming_the_row(tmp_path, text, message):
  for name in ('a', 'b'):
    _png(tmp_path / f'{name}.png')
  labels = _write(tmp_path / ('l.jsonl' if text.startswith('{') else 'l.csv'), text)
  with pytest.raises(DataError, match=message) as raised:
    _dataset(labels=labels).splits('train' if 'split' in text else None, 'test' if 'split' in text else 'all',
                                   None)
  assert '\n' not in str(raised.value)


def test_configured_columns_read_any_names_and_ignore_the_rest(tmp_path):
  _png(tmp_path / 'a.png')
  _png(tmp_path / 'b.png')
  labels = _write(tmp_path / 'l.csv', f'Photo,Kind,width\n{tmp_path}/a.png,cat,8\nsub/../b.png,dog,8\n')
  _, split, class_names = _dataset(labels=labels, image_column='photo', label_column='Kind').splits(
      None, 'all', None)
  assert class_names == ('cat', 'dog') and split.records.paths.tolist() == [b'a.png', b'b.png']  # normalised


# --- tar shards ------------------------------------------------------------------------------


def _tar(path, members, cut=None) -> str:
  """A tar of (name, bytes) members; `cut` keeps only its first bytes (a truncated shard)."""
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode='w', format=tarfile.USTAR_FORMAT) as tar:
    for name, data in members:
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  with open(path, 'wb') as f:
    f.write(buffer.getvalue()[:cut])
  return str(path)


def test_brace_ranges_keep_zero_padding_and_multiply():
  assert tagged.expand_braces('train-{0000..0002}.tar') == [
      'train-0000.tar', 'train-0001.tar', 'train-0002.tar']
  assert tagged.expand_braces('{a,b}-{8..10}.tar') == [
      'a-8.tar', 'a-9.tar', 'a-10.tar', 'b-8.tar', 'b-9.tar', 'b-10.tar']
  assert tagged.expand_braces('{split}-{00..01}.tar') == ['{split}-00.tar', '{split}-01.tar']


def test_a_shard_is_indexed_from_its_headers_and_read_by_offset(tmp_path):
  images = [_png(None, 40 * i) for i in range(3)]
  shard = _tar(tmp_path / 'x-0.tar', [
      ('a/000.png', images[0]), ('a/000.cls', b'2'), ('a/000.seg.png', b'a mask'), ('._000.png', b'mac'),
      ('a/001.json', b'{"label": 0}'), ('a/001.PNG', images[1]), ('a/001.txt', b'a caption'),
      ('002.jpeg', images[2]), ('002.cls', b'1\n')])
  index = shards.index_shard(shard)
  assert index['broken'] is None and index['compressed'] is None
  keys = [(key, member, values, problem) for key, member, _, _, values, problem in index['examples']]
  assert keys == [('a/000', 'a/000.png', [2], None), ('a/001', 'a/001.PNG', [0], None),
                  ('002', '002.jpeg', [1], None)]
  for (_, _, offset, size, _, _), image in zip(index['examples'], images):
    assert shards.read_member(shard, offset, size) == image
  train, _, class_names = _dataset(shards=shard).splits('all', 'all', None)
  assert class_names == ('0', '1', '2') and train.labels.tolist() == [2, 0, 1]  # indices without classes.txt
  assert [train.load(i)[0] for i in range(3)] == images and train.groups.tolist() == [0, 0, 0]
  assert train.describe(1) == f'a/001.PNG in shard {shard}'


def test_shard_labels_from_classes_txt_names_and_json_tags(tmp_path):
  _write(tmp_path / 'classes.txt', 'zebra\napple\nmoth\n')
  first = _tar(tmp_path / 's-0.tar', [('k0.png', _png(None)), ('k0.cls', b'2'),
                                      ('k1.png', _png(None)), ('k1.cls', b'apple')])
  _tar(tmp_path / 's-1.tar', [('k2.png', _png(None)), ('k2.json', b'{"labels": ["zebra", 2]}'),
                              ('k3.png', _png(None)), ('k3.json', b'{"labels": []}')])
  source = _dataset('multilabel', shards=str(tmp_path / 's-{0..1}.tar'))
  _, split, class_names = source.splits(None, 'all', None)
  assert class_names == ('zebra', 'apple', 'moth')  # classes.txt's order
  assert split.labels.tolist() == [[0, 0, 1], [0, 1, 0], [1, 0, 1], [0, 0, 0]]
  assert split.groups.tolist() == [0, 0, 1, 1] and split.describe(2) == f'k2.png in shard {tmp_path}/s-1.tar'
  _write(tmp_path / 'classes.txt', 'zebra\n')
  with pytest.raises(DataError, match=rf'k0 in shard {first} has class index 2, but .*classes.txt names 1 '
                                      r'classes'):
    _dataset(shards=first).splits(None, 'all', None)


def test_split_pattern_globs_and_absent_splits(tmp_path):
  for split, count in (('train', 3), ('val', 1)):
    for k in range(count):
      _tar(tmp_path / f'{split}-{k}.tar', [(f'{split}{k}.png', _png(None)), (f'{split}{k}.cls', b'cat')])
  source = _dataset(shards=str(tmp_path / '{split}-*.tar'))
  train, evaluation, class_names = source.splits('train', 'val', None)
  assert (len(train), len(evaluation), class_names) == (3, 1, ('cat',))
  assert train.groups.tolist() == [0, 1, 2] and evaluation.groups.tolist() == [3]
  with pytest.raises(DataError, match=r"matches no file for split 'test'; splits found: train, val"):
    source.splits('train', 'test', None)
  with pytest.raises(DataError, match=r"has no \{split\}, so its one split is 'all'"):
    _dataset(shards=str(tmp_path / 'train-*.tar')).splits('train', 'test', None)
  with pytest.raises(DataError, match=r'train-3.tar \(from config.dataset.shards=.*\) does not exist'):
    _dataset(shards=str(tmp_path / 'train-{0..3}.tar')).splits(None, 'all', None)


def test_a_truncated_shard_is_named_or_its_readable_members_kept(tmp_path, caplog):
  members = []
  for k in range(4):
    members += [(f'{k}.png', _png(None, 50 * k, size=40)), (f'{k}.cls', str(k % 2).encode())]
  whole = _tar(tmp_path / 'whole.tar', members)
  complete = shards.index_shard(whole)['examples']
  _, _, offset, size, _, _ = complete[2]
  cut = _tar(tmp_path / 'cut.tar', members, cut=offset + size // 2)  # inside the third image
  with pytest.raises(DataError, match=rf'shard {cut} is truncated or corrupt at byte {offset - 512} \(member '
                                      r'2.png runs past the end of the file\); rebuild it, or set '
                                      r'--config.dataset.skip_corrupt=true to keep its readable members'):
    _dataset(shards=cut).splits(None, 'all', None)
  with caplog.at_level(logging.WARNING):
    _, split, _ = _dataset(shards=cut, skip_corrupt=True).splits(None, 'all', None)
  assert 'truncated or corrupt' in caplog.text and split.labels.tolist() == [0, 1]
  assert [split.load(i)[0] for i in range(2)] == [
      shards.read_member(whole, offset, size) for _, _, offset, size, _, _ in complete[:2]]
  _, _, offset, size, _, _ = complete[-1]  # 3.png, then 3.cls: one header and one block of data
  members_end = -(-(offset + size) // 512) * 512 + 1024
  ended = _tar(tmp_path / 'ended.tar', members, cut=members_end + 512)
  assert shards.index_shard(ended)['broken'] is None  # an end block is all a tar needs at its end
  no_end = _tar(tmp_path / 'no_end.tar', members, cut=members_end)
  assert shards.index_shard(no_end)['broken'] == (members_end, 'the file ends without the tar end marker '
                                                                 '(cut off)')


def test_shard_members_without_a_label_or_image_and_compressed_shards(tmp_path):
  shard = _tar(tmp_path / 'a.tar', [('k0.png', _png(None)), ('k0.cls', b'0'), ('k1.png', _png(None)),
                                    ('k2.cls', b'1')])
  with pytest.raises(DataError, match=rf'k1 in shard {shard} has an image but no label \(k1.cls or '
                                      r'k1.json\); fix the shard, or set --config.dataset.skip_corrupt=true'):
    _dataset(shards=shard).splits(None, 'all', None)
  _, split, _ = _dataset(shards=shard, skip_corrupt=True).splits(None, 'all', None)
  assert len(split) == 1
  import gzip
  packed = tmp_path / 'b.tar'
  packed.write_bytes(gzip.compress((tmp_path / 'a.tar').read_bytes()))
  with pytest.raises(DataError, match=r'b.tar is gzip-compressed, which cannot be read by offset'):
    _dataset(shards=str(packed)).splits(None, 'all', None)


def test_make_shards_writes_a_folder_as_deterministic_shards_that_read_back(tmp_path):
  folder = make_image_folder(tmp_path / 'images', train_per_class=5, test_per_class=2)
  examples, class_names = make_shards.folder_examples(folder)
  pattern = make_shards.make_shards(examples, class_names, str(tmp_path / 'shards'), shards=4)
  assert pattern == f'{tmp_path}/shards/{{split}}-{{0000..0003}}.tar'
  again = make_shards.make_shards(examples, class_names, str(tmp_path / 'again'), shards=4)
  for name in os.listdir(tmp_path / 'shards'):
    assert (tmp_path / 'shards' / name).read_bytes() == (tmp_path / 'again' / name).read_bytes(), again
  train, evaluation, names = _dataset(shards=pattern).splits('train', 'test', None)
  assert names == CLASSES and (len(train), len(evaluation)) == (15, 6)
  originals = {}
  for name in CLASSES:
    for file in os.listdir(os.path.join(folder, 'train', name)):
      with open(os.path.join(folder, 'train', name, file), 'rb') as f:
        originals[f.read()] = CLASSES.index(name)
  assert {train.load(i)[0]: train.load(i)[1] for i in range(len(train))} == originals
  assert sorted(np.unique(train.groups).tolist()) == [0, 1, 2, 3]


# --- parquet ---------------------------------------------------------------------------------


def _hf_parquet(path, images, labels, features, row_group_size=4):
  import pyarrow as pa
  import pyarrow.parquet as pq
  image_type = pa.struct([('bytes', pa.binary()), ('path', pa.string())])
  table = pa.table({'image': pa.array([{'bytes': image, 'path': None} for image in images], image_type),
                    'label': labels, 'note': ['x'] * len(images)})
  metadata = {'info': {'features': {'image': {'_type': 'Image'}, **features}}}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  pq.write_table(table.replace_schema_metadata({'huggingface': json.dumps(metadata)}), path,
                 row_group_size=row_group_size)


def test_parquet_round_trip_with_hugging_face_class_labels(tmp_path):
  rng = np.random.default_rng(0)
  names = ['zebra', 'ant', 'moth']
  written = {}
  for split, count in (('train', 14), ('test', 5)):
    labels = rng.integers(0, 3, count).tolist()
    images = [_png(None, int(value)) for value in rng.integers(0, 200, count)]
    for part in range(2):
      rows = slice(part * count // 2, (part + 1) * count // 2 if part == 0 else count)
      _hf_parquet(str(tmp_path / 'data' / f'{split}-0000{part}-of-00002.parquet'), images[rows], labels[rows],
                  {'label': {'names': names, '_type': 'ClassLabel'}})
    written[split] = (images, labels)
  train, evaluation, class_names = _dataset(parquet=str(tmp_path)).splits('train', 'test', None)
  assert class_names == tuple(names)  # the ClassLabel's order
  for split, (images, labels) in ((train, written['train']), (evaluation, written['test'])):
    assert [split.load(i)[0] for i in range(len(split))] == images
    assert split.labels.dtype == np.int32 and split.labels.tolist() == labels
  assert train.describe(8) == f'row 1 of {tmp_path}/data/train-00001-of-00002.parquet'


def test_parquet_string_labels_lists_and_images_by_path(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  image = _png(tmp_path / 'files' / 'a.png', 30)
  table = pa.table({'img': [image, None], 'label': ['dog', 'cat']})
  pq.write_table(table, tmp_path / 'one.parquet')
  _, split, class_names = _dataset(parquet=str(tmp_path / 'one.parquet')).splits(None, 'all', None)
  assert class_names == ('cat', 'dog') and split.labels.tolist() == [1, 0] and split.load(0)[0] == image
  with pytest.raises(ValueError, match="its 'img' cell holds no image"):
    split.load(1)
  _hf_parquet(str(tmp_path / 'tags' / 'x.parquet'), [image] * 3, [[0, 2], [], [1]],
              {'label': {'feature': {'names': ['a', 'b', 'c'], '_type': 'ClassLabel'}, '_type': 'Sequence'}})
  _, tags, class_names = _dataset('multilabel', parquet=str(tmp_path / 'tags' / '*.parquet')).splits(
      None, 'all', None)
  assert class_names == ('a', 'b', 'c') and tags.labels.tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 0]]
  by_path = pa.table({'image': pa.array([{'bytes': None, 'path': 'files/a.png'}],
                                        pa.struct([('bytes', pa.binary()), ('path', pa.string())])),
                      'label': [0]})
  pq.write_table(by_path, tmp_path / 'paths.parquet')
  _, split, class_names = _dataset(parquet=str(tmp_path / 'paths.parquet')).splits(None, 'all', None)
  assert class_names == ('0',) and split.load(0)[0] == str(tmp_path / 'files' / 'a.png')
  with pytest.raises(DataError, match=r"has no label column \(its columns: img, label\)|no column 'kind'"):
    _dataset(parquet=str(tmp_path / 'one.parquet'), label_column='kind').splits(None, 'all', None)


def test_each_shard_reads_the_classes_txt_beside_it_matched_by_name(tmp_path):
  # train/classes.txt and test/classes.txt list the classes in other orders: labels go by name.
  for split, order in (('train', ('zebra', 'apple', 'moth')), ('test', ('moth', 'zebra', 'apple'))):
    os.makedirs(tmp_path / split)
    _write(tmp_path / split / 'classes.txt', '\n'.join(order) + '\n')
    _tar(tmp_path / split / 's-0.tar', [
        member for i, name in enumerate(('zebra', 'apple', 'moth'))
        for member in ((f'{split}{i}.png', _png(None)),
                       (f'{split}{i}.cls', str(order.index(name)).encode()))])
  source = _dataset(shards=str(tmp_path / '{split}' / 's-0.tar'))
  train, test, class_names = source.splits('train', 'test', None)
  assert class_names == ('zebra', 'apple', 'moth')  # training's classes.txt
  assert train.labels.tolist() == [0, 1, 2] and test.labels.tolist() == [0, 1, 2]
  # Evaluating alone with a checkpoint's classes: the same, by name.
  _, test, _ = source.splits(None, 'test', ('apple', 'moth', 'zebra'))
  assert test.labels.tolist() == [2, 0, 1]
  # A class the run lacks: the unknown-label error (or dataset.unknown_classes=drop).
  _write(tmp_path / 'test' / 'classes.txt', 'moth\nzebra\nowl\n')
  with pytest.raises(DataError, match=r"split 'test' of shards .* labels the model is not trained on: owl"):
    source.splits('train', 'test', None)
  # Index labels in a shard with no classes.txt beside it, while other shards' lists differ.
  os.remove(tmp_path / 'test' / 'classes.txt')
  _write(tmp_path / 'train' / 'classes.txt', 'zebra\napple\nmoth\n')
  os.makedirs(tmp_path / 'val')
  _write(tmp_path / 'val' / 'classes.txt', 'apple\nzebra\nmoth\n')
  _tar(tmp_path / 'val' / 's-0.tar', [('v.png', _png(None)), ('v.cls', b'0')])
  with pytest.raises(DataError, match=r'test0 in shard .*test/s-0.tar has class index 1 but no classes.txt '
                                      r'beside it'):
    source.splits('train', 'test+val', None)
  # No classes.txt beside the test shards and one list elsewhere: that list (as before).
  os.remove(tmp_path / 'val' / 'classes.txt')
  assert source.splits('train', 'test+val', None)[1].labels.tolist() == [1, 2, 0, 0]


def test_parquet_class_labels_are_read_per_file_and_matched_by_name(tmp_path):
  image = _png(None)
  # Files sorted: test first. Its ClassLabel lists the classes in another order than train's.
  _hf_parquet(str(tmp_path / 'data' / 'test-00000-of-00001.parquet'), [image] * 3, [2, 0, 1],
              {'label': {'names': ['moth', 'zebra', 'apple'], '_type': 'ClassLabel'}})
  _hf_parquet(str(tmp_path / 'data' / 'train-00000-of-00002.parquet'), [image] * 3, [0, 1, 2],
              {'label': {'names': ['zebra', 'apple', 'moth'], '_type': 'ClassLabel'}})
  # Two files of one split that disagree: each decoded with its own names.
  _hf_parquet(str(tmp_path / 'data' / 'train-00001-of-00002.parquet'), [image] * 2, [0, 1],
              {'label': {'names': ['moth', 'apple'], '_type': 'ClassLabel'}})
  train, test, class_names = _dataset(parquet=str(tmp_path)).splits('train', 'test', None)
  assert class_names == ('zebra', 'apple', 'moth')  # the first train file's ClassLabel
  assert train.labels.tolist() == [0, 1, 2, 2, 1]
  assert test.labels.tolist() == [1, 2, 0]  # apple, moth, zebra


@pytest.mark.parametrize('kind', ['csv', 'jsonl', 'parquet', 'cls', 'json'])
def test_tags_in_a_one_label_column_are_one_line_not_a_class_named_with_the_separator(tmp_path, kind):
  # Multi-label tags written where one class is read (a `label` column, KEY.cls) would become a class
  # named 'cat;outdoor'.
  image = _png(tmp_path / 'a.png')
  _png(tmp_path / 'b.png')
  if kind in ('csv', 'jsonl'):
    text = ('path,label\na.png,cat\nb.png,cat;outdoor\n' if kind == 'csv' else
            '{"path": "a.png", "label": "cat"}\n{"path": "b.png", "label": "cat;outdoor"}\n')
    source, where = _dataset(labels=_write(tmp_path / f'l.{kind}', text)), rf'line 2 of .*l\.{kind}'
    if kind == 'csv':
      where = r'line 3 of .*l\.csv'
  elif kind == 'parquet':
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({'image': [image, image], 'label': ['cat', 'cat;outdoor']}),
                   tmp_path / 'x.parquet')
    source, where = _dataset(parquet=str(tmp_path / 'x.parquet')), r'row 1 of .*x\.parquet'
  else:
    label = b'cat;outdoor' if kind == 'cls' else b'{"label": "cat;outdoor"}'
    shard = _tar(tmp_path / 's.tar', [('a.png', image), ('a.cls', b'cat'), ('b.png', image),
                                      (f'b.{kind}', label)])
    source, where = _dataset(shards=shard), rf'b in shard {shard} has b\.{kind}'
  fix = (r"a 'label' column holds one class per image: name it labels" if kind not in ('cls', 'json') else
         r'(KEY.cls|"label") holds one class: write tags as .*"labels"')
  with pytest.raises(DataError, match=rf"{where}:? 'cat;outdoor' holds tags separated by ';', but {fix}"):
    source.splits(None, 'all', None)
  if kind == 'csv':  # in a `labels` column they are tags
    labels = _write(tmp_path / 'tags.csv', 'path,labels\na.png,cat\nb.png,cat;outdoor\n')
    _, split, class_names = _dataset('multilabel', labels=labels).splits(None, 'all', None)
    assert class_names == ('cat', 'outdoor') and split.labels.tolist() == [[1, 0], [1, 1]]


# --- end to end ----------------------------------------------------------------------------------


def test_parquet_through_data_load_the_same_cached_and_streamed(tmp_path):
  rows = _photos(tmp_path, count=6)
  for split in ('train', 'test'):
    kept = [(p, c) for p, c, s in rows if s == split]
    _hf_parquet(str(tmp_path / 'pq' / 'data' / f'{split}-00000-of-00001.parquet'),
                [(tmp_path / p).read_bytes() for p, _ in kept], [CLASSES.index(c) for _, c in kept],
                {'label': {'names': list(CLASSES), '_type': 'ClassLabel'}})
  loaded = []
  for cache in ('memory', 'none'):
    config = defaults.get_config()
    config.dataset.update({'parquet': str(tmp_path / 'pq'), 'cache': cache})
    config.input.workers = 0
    loaded.append(pipeline.load(config))
  expected = [(np.asarray(Image.open(tmp_path / p)), CLASSES.index(c)) for p, c, s in rows if s == 'test']
  for dataset in loaded:
    assert dataset.class_names == CLASSES and (len(dataset.train), len(dataset.eval)) == (12, 6)
    batch, = loaders.eval_batches(dataset, batch_size=8)
    assert batch.mask.tolist() == [True] * 6 + [False] * 2
    np.testing.assert_array_equal(batch.images[:6], np.stack([image for image, _ in expected]))
    assert batch.labels[:6].tolist() == [label for _, label in expected]
  assert loaded[0].train.cached and not loaded[1].train.cached


def test_a_short_training_run_streams_tar_shards_through_the_cli(tmp_path):
  rows = _photos(tmp_path, count=12)
  examples = {split: [(str(tmp_path / path), (name,)) for path, name, s in rows if s == split]
              for split in ('train', 'test')}
  pattern = make_shards.make_shards(examples, CLASSES, str(tmp_path / 'shards'), shards=2)
  workdir = tmp_path / 'run'
  env = cli_env()  # the CLI picks the devices
  result = subprocess.run(
      [sys.executable, '-m', 'flaxtpu.main', '--config=configs/cifar10.py', f'--workdir={workdir}',
       f'--config.dataset.shards={pattern}', '--config.dataset.sampling=shards',
       '--config.dataset.cache=none',
       '--config.batch_size=12', '--config.num_train_steps=4', '--config.eval_every_steps=4',
       '--config.checkpoint_every_steps=4', '--config.log_every_steps=2', '--config.input.workers=0',
       '--config.compilation_cache_dir=none'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads((workdir / 'results.json').read_text())
  assert results['step'] == 4 and 0.0 <= results['eval_accuracy'] <= 1.0
  assert json.loads((workdir / 'config.json').read_text())['dataset']['shards'] == pattern
