"""Few-shot linear probes: the ridge solution, the features the head reads, and probes in runs and eval."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.linear_model import Ridge

from configs import digits
from conftest import make_image_folder
from flaxtpu.data import loaders, pipeline
from flaxtpu.evaluation import fewshot
from flaxtpu.loop import train
from flaxtpu.modes import eval as eval_mode
from flaxtpu.settings import lengths
from flaxtpu.step import parallel, placing, steps
from flaxtpu.validation import config as config_lib
from flaxtpu.validation import workdir_config
from flaxtpu.validation.config import ConfigError


@pytest.mark.parametrize('count, dim', [(30, 8), (12, 40)])  # the primal and the dual solve
def test_ridge_accuracy_is_scikit_learns_ridge_on_standardised_features(count, dim):
  rng = np.random.default_rng(count)
  centres = rng.normal(size=(4, dim)) * 2
  train_y, test_y = rng.integers(0, 4, count), rng.integers(0, 4, 200)
  train_x = centres[train_y] + rng.normal(size=(count, dim)) * 3
  test_x = centres[test_y] + rng.normal(size=(200, dim)) * 3
  mean, std = train_x.mean(0), train_x.std(0) + 1e-5
  ridge = Ridge(alpha=5.0).fit((train_x - mean) / std, 2.0 * np.eye(4)[train_y] - 1.0)
  expected = np.mean(np.argmax(ridge.predict((test_x - mean) / std), -1) == test_y)
  got = fewshot.ridge_accuracy(train_x, train_y, test_x, test_y, 4, 5.0)
  assert got == pytest.approx(expected, abs=1e-12)
  assert 0.4 < got < 1.0  # a real problem, neither hopeless nor trivial


@pytest.mark.parametrize('model', ['cnn', 'resnet20', 'vit_ti'])
def test_the_features_are_what_the_classifier_reads(model):
  config = digits.get_config()
  config.model.name = model
  config.model.patch_size = 4 if model == 'vit_ti' else 0
  task = steps.create_task(config, num_classes=5, image_shape=(16, 16, 3), mean=np.zeros(3), std=np.ones(3))
  variables = steps.init_model(task, 0)
  images = jnp.asarray(np.random.default_rng(0).integers(0, 255, (4, 16, 16, 3)), jnp.uint8)
  path = fewshot.head_path(task)
  features = fewshot.features(task, path, variables, images)
  head = variables.params
  for part in path:
    head = head[part]
  logits = task.model.apply({'params': variables.params, 'batch_stats': variables.batch_stats},
                            images.astype(jnp.float32) / 255.0, train=False)
  np.testing.assert_allclose(features @ head['kernel'] + head['bias'], logits, rtol=1e-4, atol=1e-4)


def _config(**overrides):
  config = digits.get_config()  # the small CNN on the embedded 8x8 digits
  config.update_from_flattened_dict({'num_train_steps': 30, 'eval_every_steps': 15,
                                     'checkpoint_every_steps': 15, 'log_every_steps': 15,
                                     'eval.fewshot.shots': (1, 5), 'eval.fewshot.seeds': 2,
                                     'compilation_cache_dir': 'none', **overrides})
  return config


def test_a_run_logs_probe_accuracies_and_eval_mode_reproduces_them(tmp_path):
  folder = make_image_folder(tmp_path / 'photos', train_per_class=12, test_per_class=10)
  bands = make_image_folder(tmp_path / 'bands', classes=('w', 'x', 'y'), train_per_class=8, test_per_class=10,
                            seed=3)
  workdir = str(tmp_path / 'run')
  overrides = {'dataset.name': '', 'dataset.folder': folder, 'eval.fewshot.datasets': (bands,)}
  results = train.train_and_evaluate(_config(**overrides), workdir)
  rows = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  probed = [row for row in rows if 'eval_fewshot_5shot' in row]
  assert [row['step'] for row in probed] == [15, 30]
  final = probed[-1]
  # Classes told apart by brightness: a probe separates them from 5 images each, and from 1.
  assert final['eval_fewshot_5shot'] >= 0.8 and final['eval_fewshot_bands_1shot'] > 0.6  # chance: 1/3
  assert results['eval_fewshot_5shot'] == final['eval_fewshot_5shot']
  # --mode=eval on the same checkpoint: the same probe images, the same features, the same numbers.
  config = workdir_config.get_config(workdir)  # what --mode=eval without --config reads
  config.update_from_flattened_dict({'eval.fewshot.shots': (1, 5), 'eval.fewshot.seeds': 2,
                                     'eval.fewshot.datasets': (bands,)})
  eval_mode.evaluate_checkpoint(config, workdir)
  evaluated = json.load(open(os.path.join(workdir, 'eval.json')))
  for name in ('eval_fewshot_1shot', 'eval_fewshot_5shot', 'eval_fewshot_bands_1shot'):
    assert evaluated[name] == pytest.approx(final[name], abs=1e-9)


def test_trained_features_beat_random_ones():
  config = _config(num_train_steps=60)
  dataset = pipeline.load(config)
  length = lengths.run_length(config, len(dataset.train))
  task = steps.create_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape,
                           mean=dataset.mean, std=dataset.std, length=length)
  placement = placing.place(task, parallel.make_mesh(config), config)
  probe = fewshot.Probe(config, dataset, task, placement)
  state = placing.create_state(task, placement, config.seed)
  random_init = probe(state)
  compiled, _ = placement.compile_train_step(state, placement.put_train_batch(
      tuple(next(iter(loaders.train_batches(dataset, seed=0, batch_size=config.batch_size, first_step=0,
                                            last_step=1))))[:2]))
  for batch in loaders.train_batches(dataset, seed=0, batch_size=config.batch_size, first_step=0,
                                     last_step=length.total_steps):
    state, _ = compiled(state, placement.put_train_batch(tuple(batch)[:2]))
  trained = probe(state)
  assert trained['eval_fewshot_5shot'] > random_init['eval_fewshot_5shot'] + 0.1


@pytest.mark.parametrize('overrides, message', [
    ({'eval.fewshot.shots': (0, 5)}, 'config.eval.fewshot.shots=(0, 5) must be positive'),
    ({'eval.fewshot.shots': (), 'eval.fewshot.datasets': ('cifar100',)}, 'needs shot counts'),
    ({'eval.fewshot.l2_reg': -1.0}, 'eval.fewshot.l2_reg'),
])
def test_bad_fewshot_settings_are_one_line_each(overrides, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    config_lib.validate(_config(**overrides))
