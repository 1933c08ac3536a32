import os
import subprocess
import sys

import pytest

from configs import cifar10, cifar10_fast, cifar10_resnet, digits, finetune, imagenet_resnet50, mnist, photos
from experiments import cifar10_fast_ablation
from flaxtpu import models
from flaxtpu.settings import defaults, lengths
from flaxtpu.validation import config as config_lib


@pytest.mark.parametrize('recipe', [defaults, cifar10, cifar10_resnet, cifar10_fast, digits, mnist,
                                    imagenet_resnet50])
def test_recipes_are_valid(recipe):
  config_lib.validate(recipe.get_config())


def test_every_run_of_the_fast_ablation_is_valid_and_differs_in_one_part():
  runs = cifar10_fast_ablation.get_sweep()
  assert runs[0] == {} and len(runs) == 13
  for overrides in runs:
    config = cifar10_fast_ablation.get_config()
    config.update_from_flattened_dict(overrides)
    config_lib.validate(config)


def test_photos_recipe_needs_only_the_folder():
  config = photos.get_config()
  with pytest.raises(config_lib.ConfigError, match='set --config.dataset.folder='):
    config_lib.validate(config)
  config.dataset.folder = '/any/folder'
  config_lib.validate(config)


def test_imagenet_recipe_is_the_standard_one():
  config = imagenet_resnet50.get_config()
  assert (config.batch_size, config.optimizer.learning_rate, config.num_epochs) == (1024, 0.4, 90.0)
  assert config.optimizer.nesterov and config.schedule.warmup_epochs == 5.0
  assert (config.dataset.image_size, config.label_smoothing, config.dtype) == (224, 0.1, 'bfloat16')


@pytest.mark.parametrize('key, value, message', [
    ('model.name', 'resnet9000', "config.model.name='resnet9000' is not valid; choose one of: 'cnn'"),
    ('optimizer.name', 'lbfgs',
     "config.optimizer.name='lbfgs' is not valid; choose one of: 'sgd', 'adam', 'adamw', 'lamb'"),
    ('schedule.name', 'sawtooth', "config.schedule.name='sawtooth' is not valid"),
    ('model.remat', 'some', "config.model.remat='some' is not valid"),
    ('model.remat_mlps', -1, 'config.model.remat_mlps=-1 must be >= 0'),
    # cifar10.py's model is the Keras CNN: only the Swins have MLP branches to recompute.
    ('model.remat_mlps', 1, "config.model.remat_mlps=1 has no effect on model.name='cnn'; leave it at 0 "
     'or pick a model that takes it: swin_t, swin_s, swin_b'),
    ('dtype', 'float64', "config.dtype='float64' is not valid; choose one of: 'float32', 'bfloat16'"),
    ('parallelism', 'pjit', "config.parallelism='pjit' is not valid; choose one of: 'jit', 'pmap'"),
    ('num_epochs', 0.0, 'config.num_epochs=0.0 must be > 0'),
    ('batch_size', -8, 'config.batch_size=-8 must be > 0'),
    ('num_train_steps', 0, 'config.num_train_steps=0 must be > 0 (or -1)'),
    ('label_smoothing', 1.0, 'config.label_smoothing=1.0 must be in [0, 1)'),
    ('optimizer.weight_decay', -1.0, 'config.optimizer.weight_decay=-1.0 must be >= 0'),
    ('require_platform', 'ipu', "config.require_platform='ipu' is not valid"),
    ('augment.crop_pad_mode', 'wrap',
     "config.augment.crop_pad_mode='wrap' is not valid; choose one of: 'zeros', "),
    ('cpu_convolutions', 'onednn',
     "config.cpu_convolutions='onednn' is not valid; choose one of: 'xla', 'eigen'"),
])
def test_bad_values_name_key_value_and_allowed(key, value, message):
  config = cifar10.get_config()
  config.update_from_flattened_dict({key: value})
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.validate(config)
  assert str(error.value).startswith(message)
  assert '\n' not in str(error.value)


def test_alternate_flip_needs_the_flip():
  config = cifar10.get_config()
  config.augment.flip, config.augment.alternate_flip = False, True
  with pytest.raises(config_lib.ConfigError, match=r'alternate_flip=True alternates the flip, which is off; '
                     r'set --config.augment.flip=true'):
    config_lib.validate(config)
  config.augment.flip = True
  config_lib.validate(config)


def test_empty_dataset_source_is_an_error():
  config = cifar10.get_config()
  config.dataset.name = ''
  with pytest.raises(config_lib.ConfigError,
                     match='config.dataset.folder and config.dataset.name are both empty; '
                           'set --config.dataset.folder='):
    config_lib.validate(config)


def test_pmap_with_fsdp_is_an_error():
  config = cifar10.get_config()
  config.parallelism, config.mesh.fsdp = 'pmap', 2
  with pytest.raises(config_lib.ConfigError, match='config.mesh.fsdp=2 needs parallelism=jit'):
    config_lib.validate(config)


def test_defaults_are_locked_and_unknown_keys_get_a_suggestion():
  config = defaults.get_config()
  with pytest.raises(AttributeError, match='nme'):
    config.model.nme = 'resnet20'  # a typo in a recipe must not add a key
  known = config_lib.config_keys(config)
  assert 'optimizer.learning_rate' in known and len(known) == len(set(known))
  assert config_lib.did_you_mean('optimizer.lr', known) == " (did you mean 'optimizer.learning_rate'?)"
  assert config_lib.did_you_mean('batchsize', known) == " (did you mean 'batch_size'?)"
  assert config_lib.did_you_mean('zzz', known) == ''


def test_model_names_come_from_the_registry():
  config = defaults.get_config()
  for name in models.NAMES:
    config.model.name = name
    config_lib.validate(config)


def test_run_length_from_epochs_and_steps():
  config = cifar10.get_config()  # batch 128, 5 epochs
  length = lengths.run_length(config, 50_000)
  assert (length.steps_per_epoch, length.total_steps) == (390, 1950)
  assert length.eval_every_steps == length.checkpoint_every_steps == 390
  config.num_train_steps, config.eval_every_steps = 100, 40
  config.schedule.warmup_epochs = 0.5
  length = lengths.run_length(config, 50_000)
  assert (length.total_steps, length.eval_every_steps, length.warmup_steps) == (100, 40, 195)


def test_batch_larger_than_dataset_is_an_error():
  config = cifar10.get_config()
  with pytest.raises(config_lib.ConfigError, match='larger than the train split'):
    lengths.run_length(config, 100)


def test_a_config_outside_the_repo_builds_on_the_installed_defaults(tmp_path):
  (tmp_path / 'mine.py').write_text(
      'from flaxtpu.settings import defaults\n\n'
      'def get_config():\n'
      '  config = defaults.get_config()\n'
      '  config.model.name = "resnet20"\n'
      '  return config\n')
  code = ('from ml_collections import config_flags; from absl import flags; import sys; '
          'config_flags.DEFINE_config_file("config"); flags.FLAGS(sys.argv); '
          'print(flags.FLAGS.config.model.name)')
  result = subprocess.run([sys.executable, '-c', code, f'--config={tmp_path}/mine.py'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != 'PYTHONPATH'})
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == 'resnet20'


def test_predict_needs_no_dataset_source():
  """Issue 43, class 8: --mode=predict from a published head with --config=configs/finetune.py (no
  dataset.folder) or a recipe whose training folder is gone: predict reads predict.input only."""
  config = finetune.get_config()
  config.init_from.keep_head = True
  config.predict.input = '/photos/cat.jpg'
  config_lib.validate(config, 'predict')
  with pytest.raises(config_lib.ConfigError, match='dataset.folder and config.dataset.name are both empty'):
    config_lib.validate(config, 'train')
  config.dataset.parquet = '/no/such/training/files/*.parquet'
  config.dataset.image_column = 'photo'
  config_lib.validate(config, 'predict')
