"""--mode=export for deployment: quantized TFLite models, the model card, the hub upload, an unwritable
export folder."""

import base64
import contextlib
import gzip
import http.server
import json
import logging
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import yaml

from configs import cifar10
from conftest import make_image_folder
from flaxtpu.data import loaders, pipeline
from flaxtpu.exporters import export, hub, model_card, tflite_export
from flaxtpu.loop import train
from flaxtpu.modes import predict, restore
from flaxtpu.settings.errors import UserError


def _config(folder, **overrides):
  config = cifar10.get_config()  # the Keras CNN, the smallest model
  config.dataset.folder = folder
  config.update_from_flattened_dict({
      'batch_size': 16, 'num_train_steps': 40, 'log_every_steps': 40, 'eval_every_steps': 40,
      'checkpoint_every_steps': 40, 'optimizer.learning_rate': 1e-2, 'compilation_cache_dir': 'none',
      'export.calibration_images': 40,
      **overrides})
  return config


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  folder = make_image_folder(tmp_path_factory.mktemp('images'), train_per_class=24, test_per_class=7)
  workdir = str(tmp_path_factory.mktemp('run'))
  config = _config(folder)
  train.train_and_evaluate(config, workdir)
  return config, workdir, export.export_checkpoint(config, workdir)


def _eval_split(config):
  dataset = pipeline.load(config, need_train=False)
  batch = next(loaders.eval_batches(dataset, batch_size=len(dataset.eval)))
  return batch.images[batch.mask], batch.labels[batch.mask]


def test_quantized_models_sizes_agreement_and_accuracy(exported):
  config, workdir, summary = exported
  directory = os.path.join(workdir, 'export')
  models = summary['tflite_models']
  assert models['split'] == 'test' and models['num_images'] == 21 and models['calibration_images'] == 40
  sizes = {kind: os.path.getsize(os.path.join(directory, models[kind]['file']))
           for kind in ('float32', 'fp16', 'int8')}
  assert {kind: models[kind]['bytes'] for kind in sizes} == sizes
  # 20,000 float32 weights: ~80 kB; float16 halves the weights, int8 quarters them.
  assert sizes['fp16'] < 0.65 * sizes['float32'] and sizes['int8'] < 0.45 * sizes['float32']
  images, labels = _eval_split(config)
  placement, state, _, _ = restore.restore(config, workdir)
  expected = predict.predict_logits(placement, state, images, 16)
  logits = {kind: tflite_export.tflite_runner(os.path.join(directory, models[kind]['file']))(images)
            for kind in sizes}
  assert models['float32']['eval_accuracy'] == pytest.approx(np.mean(expected.argmax(-1) == labels))
  for kind in ('fp16', 'int8'):  # the recorded numbers are these models' on the eval split
    agreement = np.mean(logits[kind].argmax(-1) == logits['float32'].argmax(-1))
    accuracy = np.mean(logits[kind].argmax(-1) == labels)
    assert models[kind]['top1_agreement_with_float'] == pytest.approx(agreement)
    assert models[kind]['eval_accuracy'] == pytest.approx(accuracy)
    assert models[kind]['accuracy_drop'] == pytest.approx(models['float32']['eval_accuracy'] - accuracy)
  assert models['float32']['eval_accuracy'] >= 0.9  # brightness bands: learnt in 40 steps
  assert models['fp16']['top1_agreement_with_float'] == 1.0
  assert models['fp16']['max_abs_logit_diff_vs_float'] < 0.05
  assert models['int8']['top1_agreement_with_float'] >= 0.9
  assert models['int8']['within_max_drop'] and 'warning' not in models['int8']
  assert models['int8']['max_drop'] == 0.02
  # int8 in, as the float model: uint8 images; float32 logits out.
  interpreter = tflite_export.interpreter_class()(model_path=os.path.join(directory, 'model_int8.tflite'))
  assert [d['dtype'] for d in interpreter.get_input_details()] == [np.uint8]
  assert {d['dtype'] for d in interpreter.get_output_details()} == {np.float32}
  kernels = [d for d in interpreter.get_tensor_details() if len(d['shape']) == 4 and d['shape'][0] == 32]
  assert kernels and all(d['dtype'] == np.int8 for d in kernels)  # the first convolution's weights


def test_export_writes_only_the_quantized_models_and_onnx_asked_for(exported, tmp_path):
  """export.quantize=('int8',) and export.onnx=false: model_int8.tflite alone beside the float exports, with
  the same int8 numbers as the full export's (same calibration images, same converter)."""
  config, workdir, summary = exported
  run = str(tmp_path / 'run')
  shutil.copytree(workdir, run, ignore=shutil.ignore_patterns('export'))
  only = export.export_checkpoint(_config(config.dataset.folder, **{'export.quantize': ('int8',),
                                                                    'export.onnx': False}), run)
  names = set(os.listdir(os.path.join(run, 'export')))
  assert {'model.tflite', 'model_int8.tflite', 'saved_model'} <= names
  assert not names & {'model_fp16.tflite', 'model.onnx'}
  assert set(only['tflite_models']) - {'float32', 'int8'} == set(summary['tflite_models']) - {
      'float32', 'int8', 'fp16'}  # the same bookkeeping, fp16 left out
  assert only['tflite_models']['int8']['bytes'] == summary['tflite_models']['int8']['bytes']
  assert only['tflite_models']['int8']['eval_accuracy'] == summary['tflite_models']['int8']['eval_accuracy']
  assert (only['onnx'], only['onnx_error']) == (None, 'not asked for (export.onnx=false)')
  card = open(os.path.join(run, 'export', 'README.md'), encoding='utf-8').read()
  assert '| TFLite int8 |' in card and 'TFLite fp16' not in card and 'onnxruntime' not in card


@pytest.mark.parametrize('quantize, message', [
    (('int4',), r"'int4' is not one"), (('int8', 'int8'), 'one is repeated')])
def test_a_wrong_quantize_list_is_one_line(quantize, message):
  from flaxtpu.validation import config as config_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(UserError, match=r"^config.export.quantize=\(.*\) names quantized TFLite models from "
                                      rf"\('fp16', 'int8'\), each once \({message}\); \(\) writes none$"):
    config_lib.validate(_config('/nowhere', **{'export.quantize': quantize}), 'export')


def test_int8_drop_beyond_the_margin_is_kept_with_one_warning(exported, tmp_path, caplog):
  config, workdir, _ = exported
  directory = os.path.join(workdir, 'export')
  shutil.copy(os.path.join(directory, 'model.tflite'), tmp_path)
  images, _ = _eval_split(config)
  float_top = tflite_export.tflite_runner(os.path.join(directory, 'model.tflite'))(images).argmax(-1)
  # Calibrated on black images, the int8 ranges miss every real activation: the model breaks.
  black = np.zeros((8, 8, 8, 3), np.uint8)
  with caplog.at_level(logging.WARNING):
    models, _ = tflite_export.write_quantized(
        os.path.join(directory, 'saved_model'), str(tmp_path), black, images, float_top,
        multilabel=False, int8_max_drop=0.01, split='test')
  int8 = models['int8']
  assert models['float32']['eval_accuracy'] == 1.0  # the labels are the float model's own classes
  assert int8['accuracy_drop'] == pytest.approx(1 - int8['top1_agreement_with_float']) and \
      int8['accuracy_drop'] > 0.01
  assert not int8['within_max_drop'] and os.path.isfile(tmp_path / 'model_int8.tflite')
  warnings = [r.getMessage() for r in caplog.records if 'int8 TFLite' in r.getMessage()]
  assert warnings == [f'export: the int8 TFLite model\'s eval accuracy is {100 * int8["accuracy_drop"]:.2f} '
                      f'points below the float model\'s (100.00% -> {100 * int8["eval_accuracy"]:.2f}% on 21 '
                      'test images), more than export.int8_max_drop=0.01; model_int8.tflite is kept: '
                      'check it before deploying it, or deploy model_fp16.tflite']


def test_a_quantizer_that_kills_its_process_costs_that_model_only(exported, tmp_path, monkeypatch, caplog):
  """TensorFlow's int8 quantizer segfaults on some graphs (an EfficientNet-B0: "scale out of expressed type
  range"): each quantized model is made in a child process, so the crash is recorded and fp16 still lands."""
  config, workdir, summary = exported
  directory = os.path.join(workdir, 'export')
  shutil.copy(os.path.join(directory, 'model.tflite'), tmp_path)
  images, labels = _eval_split(config)
  monkeypatch.setattr(tflite_export, 'CHILD_CODE', 'import os, signal, sys\nif sys.argv[3] == "int8": '
                      'os.kill(os.getpid(), signal.SIGSEGV)\n' + tflite_export.CHILD_CODE)
  with caplog.at_level(logging.WARNING):
    models, _ = tflite_export.write_quantized(
        os.path.join(directory, 'saved_model'), str(tmp_path), images[:8], images, labels,
        multilabel=False, int8_max_drop=0.02, split='test')
  assert models['int8'] == {'file': None,
                            'error': 'TensorFlow stopped with signal SIGSEGV converting the int8 model'}
  assert [r.getMessage() for r in caplog.records if 'int8' in r.getMessage()] == [
      'export: no int8 TFLite model: TensorFlow stopped with signal SIGSEGV converting the int8 model']
  assert models['fp16']['bytes'] == summary['tflite_models']['fp16']['bytes']  # the same converter output
  assert models['fp16']['eval_accuracy'] == summary['tflite_models']['fp16']['eval_accuracy']
  assert sorted(os.listdir(tmp_path)) == ['model.tflite', 'model_fp16.tflite']


def test_model_card_lists_classes_metrics_and_checks(exported, tmp_path):
  config, workdir, summary = exported
  with open(os.path.join(workdir, 'export', 'README.md'), encoding='utf-8') as f:
    card = f.read()
  with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
    results = json.load(f)
  assert '## Classes (3)\n\n`cat`, `dog`, `frog`\n' in card
  assert f'| accuracy | {100 * results["eval_accuracy"]:.2f}% |' in card
  assert f'| loss | {results["eval_loss"]:.4f} |' in card
  assert f'image folder `{config.dataset.folder}`: train split `train` (72 images), eval split `test` (21 ' \
      'images)' in card
  assert '- optimizer: `adam`, learning rate 0.01' in card and 'batch size 16' in card
  check = summary['check']
  assert f'max_abs_diff {check["saved_model"]["max_abs_diff"]:.3g}' in card
  assert f'max_abs_diff {check["tflite"]["max_abs_diff"]:.3g}' in card
  int8 = summary['tflite_models']['int8']
  assert (f'| TFLite int8 | top-1 agreement with the float model, accuracy on 21 test images | agreement '
          f'{100 * int8["top1_agreement_with_float"]:.2f}%') in card
  assert f"tf.saved_model.load('{workdir}/export/saved_model')" in card
  assert 'Per-class accuracy (support), from the run\'s per_class.csv' in card
  assert '- expected calibration error (ECE, 15 bins): ' in card
  onnx = os.path.exists(os.path.join(workdir, 'export', 'model.onnx'))  # jax2onnx installed (Python 3.11+)
  assert ("session.run(['logits', 'probabilities']" in card) == onnx
  assert 'timm.create_model' not in card  # the cnn has no timm twin
  # calibration.json (temperature scaling) and a timm folder: the hub card with its metadata block.
  run = tmp_path / 'run'
  shutil.copytree(workdir, run, ignore=shutil.ignore_patterns('checkpoints'))
  (run / 'calibration.json').write_text(json.dumps({
      'temperature': 1.5, 'ece_before': 0.1, 'ece_after': 0.05, 'nll_before': 0.9, 'nll_after': 0.8,
      'split': 'test', 'step': 40, 'coverage': 0.9, 'set_threshold': 0.2}))
  os.makedirs(run / 'export' / 'timm')
  config.export.license = 'apache-2.0'
  model_card.write(str(run / 'export'), summary, config, str(run))
  hub_card = (run / 'export' / 'timm' / 'README.md').read_text()
  front, body = hub_card.split('---\n')[1:3]
  assert yaml.safe_load(front) == {
      'tags': ['image-classification', 'timm', 'flaxtpu'], 'library_name': 'timm', 'license': 'apache-2.0',
      'datasets': [os.path.basename(config.dataset.folder)], 'metrics': ['accuracy']}
  assert body == (run / 'export' / 'README.md').read_text()
  assert 'T = 1.5000; ECE 0.1000 -> 0.0500, NLL 0.9000 -> 0.8000; prediction sets: coverage 0.900' in body


class _FakeHub(http.server.ThreadingHTTPServer):
  """The part of the Hugging Face hub API that create_repo + upload_folder use, on loopback: repos/create,
  validate-yaml, preupload (every file 'regular': its bytes travel base64 in the commit) and commit."""

  def __init__(self):
    super().__init__(('127.0.0.1', 0), _FakeHubHandler)
    self.repos, self.files, self.cards, self.tokens = [], {}, [], set()
    self.url = f'http://127.0.0.1:{self.server_address[1]}'
    threading.Thread(target=self.serve_forever, daemon=True).start()


class _FakeHubHandler(http.server.BaseHTTPRequestHandler):

  def log_message(self, *args):
    pass

  def _reply(self, status, payload):
    body = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header('Content-Type', 'application/json')
    self.send_header('Content-Length', str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def do_GET(self):  # noqa: N802
    self._reply(404, {'error': 'not served here'})

  def do_POST(self):  # noqa: N802
    body = self.rfile.read(int(self.headers.get('Content-Length', 0)))
    if self.headers.get('Content-Encoding') == 'gzip':
      body = gzip.decompress(body)
    self.server.tokens.add(self.headers.get('authorization'))
    parts = self.path.split('?')[0].strip('/').split('/')
    if parts == ['api', 'repos', 'create']:
      payload = json.loads(body)
      self.server.repos.append(f'{payload.get("organization")}/{payload["name"]}')
      return self._reply(200, {'url': f'{self.server.url}/{self.server.repos[-1]}'})
    if parts == ['api', 'validate-yaml']:
      self.server.cards.append(json.loads(body)['content'])
      return self._reply(200, {'errors': [], 'warnings': []})
    if parts[:2] == ['api', 'models'] and parts[4:] == ['preupload', 'main']:
      return self._reply(200, {'files': [{'path': f['path'], 'uploadMode': 'regular', 'shouldIgnore': False}
                                         for f in json.loads(body)['files']]})
    if parts[:2] == ['api', 'models'] and parts[4:] == ['commit', 'main']:
      for line in body.decode().splitlines():
        item = json.loads(line)
        if item['key'] == 'file':
          self.server.files[item['value']['path']] = base64.b64decode(item['value']['content'])
      return self._reply(200, {'commitUrl': f'{self.server.url}/{"/".join(parts[2:4])}/commit/{"0" * 40}',
                               'commitOid': '0' * 40, 'pullRequestUrl': None})
    self._reply(404, {'error': f'not served here: {self.path}'})


@pytest.fixture
def fake_hub(monkeypatch):
  server = _FakeHub()
  monkeypatch.setenv('HF_ENDPOINT', server.url)
  monkeypatch.setenv('HF_TOKEN', 'hf_test_token')
  monkeypatch.delenv('HF_HUB_OFFLINE', raising=False)
  yield server
  server.shutdown()


def test_hub_upload_to_a_local_fake_hub(exported, fake_hub, tmp_path):
  _, workdir, _ = exported
  folder = tmp_path / 'export'
  os.makedirs(folder / 'timm')
  for name, content in (('README.md', b'---\nlibrary_name: timm\n---\n# card\n'), ('config.json', b'{}'),
                        ('model.safetensors', np.arange(1000, dtype=np.float32).tobytes())):
    (folder / 'timm' / name).write_bytes(content)
  (folder / 'model.tflite').write_bytes(b'not uploaded: the timm folder is')
  assert hub.upload('my-org/cifar-net', str(folder)) == f'{fake_hub.url}/my-org/cifar-net'
  assert fake_hub.repos == ['my-org/cifar-net'] and fake_hub.tokens == {'Bearer hf_test_token'}
  assert fake_hub.files == {name: (folder / 'timm' / name).read_bytes()
                            for name in ('README.md', 'config.json', 'model.safetensors')}
  assert fake_hub.cards == ['---\nlibrary_name: timm\n---\n# card\n']
  # A model without a timm twin (the CNN) uploads its whole export: SavedModel, TFLite, card.
  fake_hub.files.clear()
  hub.upload('my-org/cnn', os.path.join(workdir, 'export'))
  assert {'README.md', 'export.json', 'model.tflite', 'model_int8.tflite',
          'saved_model/saved_model.pb'} <= set(fake_hub.files)
  assert fake_hub.files['model_int8.tflite'] == open(
      os.path.join(workdir, 'export', 'model_int8.tflite'), 'rb').read()


@pytest.mark.parametrize('how', ['HF_HUB_OFFLINE=1', 'endpoint refuses', 'endpoint silent'])
def test_offline_hub_is_refused_within_seconds(how, exported, monkeypatch):
  _, workdir, _ = exported
  monkeypatch.delenv('HF_HUB_OFFLINE', raising=False)
  if how == 'HF_HUB_OFFLINE=1':
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    reason = 'HF_HUB_OFFLINE is set'
  elif how == 'endpoint refuses':
    monkeypatch.setenv('HF_ENDPOINT', 'http://127.0.0.1:9')  # discard: nothing listens
    reason = '127.0.0.1:9 cannot be reached'
  else:  # a connection that never answers (a firewall dropping packets): the probe gives up
    monkeypatch.setenv('HF_ENDPOINT', 'https://hub.example')
    def never_answers(*args, **kwargs):
      time.sleep(30)
      raise TimeoutError('timed out')

    monkeypatch.setattr(hub.socket, 'create_connection', never_answers)
    reason = 'no answer from hub.example:443 within 3 s'
  directory = os.path.join(workdir, 'export')
  started = time.perf_counter()
  with pytest.raises(UserError) as raised:
    hub.upload('my-org/net', directory)
  assert time.perf_counter() - started < 10
  message = str(raised.value)
  assert message.startswith(f'config.export.hub_repo=my-org/net: the hub is offline ({reason}')
  assert message.endswith(f'the export in {directory} is kept and {directory} is ready for '
                          f'`hf upload my-org/net {directory}`')
  assert '\n' not in message and os.path.isfile(os.path.join(directory, 'export.json'))


@contextlib.contextmanager
def _unwritable(directory):
  """`directory` read-only in place: a read-only bind mount onto itself (root), else mode 555."""
  if os.geteuid() != 0:
    os.chmod(directory, 0o555)
    yield 'Permission denied'
    os.chmod(directory, 0o755)
    return
  if subprocess.run(['mount', '--bind', directory, directory], capture_output=True).returncode or \
      subprocess.run(['mount', '-o', 'remount,ro,bind', directory], capture_output=True).returncode:
    subprocess.run(['umount', directory], capture_output=True)
    pytest.skip('no read-only bind mount here')
  try:
    yield 'Read-only file system'
  finally:
    subprocess.run(['umount', directory], check=True)


def test_unwritable_export_folder_is_one_line(exported, tmp_path):
  config, workdir, _ = exported
  run = tmp_path / 'run'
  shutil.copytree(workdir, run)
  before = sorted(os.listdir(run / 'export'))
  with _unwritable(str(run / 'export')) as reason:
    started = time.perf_counter()
    with pytest.raises(UserError) as raised:
      export.export_checkpoint(config, str(run))
    assert time.perf_counter() - started < 10  # refused before any model is built
  assert str(raised.value) == (f'--mode=export replaces {run}/export, but it cannot be replaced ({reason}); '
                               'make it writable or move it away, and run the same command')
  assert sorted(os.listdir(run / 'export')) == before
  assert sorted(os.listdir(run)) == sorted(os.listdir(workdir))  # no staging left
