"""How often a run checkpoints: once an epoch by default, at least checkpoint.min_interval_secs apart (the
CIFAR recipes: a minute, where a checkpoint after each ~1 s epoch slowed a TPU's steps by a third); an
explicit checkpoint_every_steps, the last step and a stop always save."""

import pytest

from configs import cifar10, cifar10_resnet, digits
from flaxtpu.loop import train
from flaxtpu.settings.errors import ConfigError
from flaxtpu.validation import config as config_lib
from flaxtpu.weights import checkpoint


def _saved_steps(tmp_path, monkeypatch, **overrides) -> tuple[list[int], int]:
  """The steps a 3-epoch digits run saved at, and its steps per epoch."""
  saved, real_save = [], checkpoint.Checkpoints.save

  def save(self, step, *args, **kwargs):
    saved.append(step)
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.Checkpoints, 'save', save)
  config = digits.get_config()
  config.compilation_cache_dir = 'none'
  config.num_epochs = 3.0
  config.update_from_flattened_dict(overrides)
  results = train.train_and_evaluate(config, str(tmp_path))
  return saved, results['step'] // 3


@pytest.mark.parametrize('interval, explicit', [(0.0, False), (3600.0, False), (3600.0, True)])
def test_epoch_checkpoints_wait_for_the_interval_and_explicit_ones_do_not(tmp_path, monkeypatch, interval,
                                                                          explicit):
  overrides = {'checkpoint.min_interval_secs': interval}
  if explicit:
    overrides['checkpoint_every_steps'] = 5
  saved, per_epoch = _saved_steps(tmp_path, monkeypatch, **overrides)
  total = 3 * per_epoch
  if explicit:  # every 5 steps, and the last
    assert saved == sorted({*range(5, total + 1, 5), total})
  elif interval:  # a 3-epoch run of seconds: only its last step
    assert saved == [total]
  else:
    assert saved == [per_epoch, 2 * per_epoch, total]


def test_the_cifar_recipes_checkpoint_at_most_once_a_minute_and_a_negative_interval_is_refused():
  assert cifar10.get_config().checkpoint.min_interval_secs == 60.0
  assert cifar10_resnet.get_config().checkpoint.min_interval_secs == 60.0
  config = digits.get_config()
  config.checkpoint.min_interval_secs = -1.0
  with pytest.raises(ConfigError, match=r'checkpoint.min_interval_secs=-1.0 must be >= 0'):
    config_lib.validate(config, 'train')
