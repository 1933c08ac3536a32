"""The modern-recipe parts: gradient accumulation, EMA, mixup/CutMix, several eval splits."""

import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import restore_checkpoint, tiny_dataset
from flaxtpu.augmentation import augment
from flaxtpu.data import loaders
from flaxtpu.loop import train
from flaxtpu.modes import eval as eval_mode
from flaxtpu.optimizers import optim
from flaxtpu.settings import defaults, lengths, metric_names
from flaxtpu.settings.errors import UserError
from flaxtpu.step import steps
from flaxtpu.validation import config as config_lib
from flaxtpu.validation.config import ConfigError


def _config(**overrides):
  config = defaults.get_config()
  config.update_from_flattened_dict({
      'model.name': 'cnn', 'optimizer.name': 'sgd', 'optimizer.learning_rate': 0.05,
      'schedule.name': 'cosine', 'compilation_cache_dir': 'none', **overrides})
  return config


def _task(config, num_examples=64):
  dataset = tiny_dataset()
  return steps.create_task(config, num_classes=3, image_shape=(8, 8, 3), mean=dataset.mean,
                           std=dataset.std, length=lengths.run_length(config, num_examples))


def _run(task, batches, seed=0):
  """The train step on one device over `batches`; the states after each step."""
  state = steps.init_state(task, seed)
  step = jax.jit(lambda state, batch: steps.train_step(state, batch, task=task))
  states = []
  for batch in batches:
    state, _ = step(state, batch)
    states.append(state)
  return states


def _batches(num, size, seed=1):
  dataset = tiny_dataset()
  rng = np.random.default_rng(seed)
  rows = [rng.choice(len(dataset.train), size, replace=False) for _ in range(num)]
  return [(dataset.train.images[r], dataset.train.labels[r]) for r in rows]


# --- gradient accumulation ------------------------------------------------------


def test_accumulating_k_batches_equals_one_batch_k_times_larger():
  big = _batches(3, 16)
  halves = [(images[start:start + 8], labels[start:start + 8])
            for images, labels in big for start in (0, 8)]
  # 3 updates either way: a cosine schedule over 3 updates, counted in updates, not batches.
  one = _task(_config(batch_size=16, num_train_steps=3, **{'optimizer.momentum': 0.9}))
  two = _task(_config(batch_size=8, num_train_steps=6, **{'optimizer.momentum': 0.9,
                                                          'optimizer.accumulate_steps': 2}))
  large = _run(one, big)
  accumulated = _run(two, halves)
  for update in range(3):
    expected, got = large[update], accumulated[2 * update + 1]
    for x, y in zip(jax.tree.leaves(expected.params), jax.tree.leaves(got.params)):
      np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-5)
  # Between updates the parameters stand still; the step counts batches.
  for x, y in zip(jax.tree.leaves(accumulated[2].params), jax.tree.leaves(accumulated[1].params)):
    np.testing.assert_array_equal(x, y)
  assert int(accumulated[-1].step) == 6
  assert [bool(optim.updated(s.opt_state)) for s in accumulated] == [False, True] * 3
  # The logged learning rate of batch s is the schedule at update s // 2.
  assert [float(two.schedule(s)) for s in range(6)] == pytest.approx(
      [float(one.schedule(u)) for u in (0, 0, 1, 1, 2, 2)])
  assert float(one.schedule(1)) != pytest.approx(float(one.schedule(0)))


def test_the_run_length_rounds_up_to_a_whole_update():
  config = _config(batch_size=8, num_epochs=1.0, **{'optimizer.accumulate_steps': 3,
                                                    'schedule.warmup_epochs': 0.5})
  length = lengths.run_length(config, 64)  # 8 batches per epoch -> 9, 3 updates
  assert (length.total_steps, length.total_updates, length.warmup_steps) == (9, 3, 4)
  with pytest.raises(ConfigError, match='accumulate_steps=0 must be > 0'):
    config_lib.validate(_config(**{'optimizer.accumulate_steps': 0}))


# --- EMA ----------------------------------------------------------------------------


@pytest.mark.parametrize('warmup', [False, True])
def test_ema_is_the_stated_average_of_the_weights_after_each_update(warmup):
  task = _task(_config(batch_size=8, num_train_steps=4, **{'ema.decay': 0.9, 'ema.warmup': warmup}))
  initial = steps.init_state(task, 0)
  states = _run(task, _batches(4, 8))
  expected = jax.tree.map(np.asarray, {'params': initial.params, 'batch_stats': initial.batch_stats})
  for n, state in enumerate(states):
    decay = min(0.9, (1 + n) / (10 + n)) if warmup else 0.9
    expected = jax.tree.map(lambda e, p: decay * e + (1 - decay) * np.asarray(p), expected,
                            {'params': state.params, 'batch_stats': state.batch_stats})
    for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(state.ema)):
      np.testing.assert_allclose(x, y, atol=1e-7, rtol=1e-5)
  # The average trails the weights: it differs from them, and from the start.
  first = jax.tree.leaves(states[-1].params)[0]
  assert not np.allclose(jax.tree.leaves(states[-1].ema['params'])[0], first)


def test_ema_moves_only_on_updates_when_accumulating():
  task = _task(_config(batch_size=8, num_train_steps=4, **{
      'ema.decay': 0.5, 'ema.warmup': False, 'optimizer.accumulate_steps': 2}))
  states = _run(task, _batches(4, 8))
  leaf = lambda state: np.asarray(jax.tree.leaves(state.ema['params'])[-1])
  np.testing.assert_array_equal(leaf(states[0]),
                                np.asarray(jax.tree.leaves(steps.init_state(task, 0).params)[-1]))
  np.testing.assert_array_equal(leaf(states[2]), leaf(states[1]))
  params = lambda state: np.asarray(jax.tree.leaves(state.params)[-1])
  np.testing.assert_allclose(leaf(states[3]), 0.5 * leaf(states[1]) + 0.5 * params(states[3]), rtol=1e-6)


def test_no_ema_keeps_the_state_as_before():
  state = steps.init_state(_task(_config(batch_size=8, num_train_steps=2)), 0)
  assert state.ema == {}


# --- Lookahead and bias weight decay ----------------------------------------------------


def test_lookahead_syncs_every_k_updates_and_at_the_last():
  # Loss x^2 / 2 with plain SGD at 0.1: each fast step multiplies x by 0.9.
  opt = optim.lookahead(optax.sgd(0.1), every=2, decay=lambda n: 0.5, total_updates=5)
  x = {'w': jnp.ones(())}
  state = opt.init(x)
  got = []
  for _ in range(5):
    updates, state = opt.update(x, state, x)
    x = optax.apply_updates(x, updates)
    got.append(float(x['w']))
  # fast 0.9; sync 1 + 0.5 (0.81 - 1); fast; sync; the last update (5) syncs too.
  slow2 = 1 + 0.5 * (0.81 - 1)
  slow4 = slow2 + 0.5 * (0.81 * slow2 - slow2)
  slow5 = slow4 + 0.5 * (0.9 * slow4 - slow4)
  assert got == pytest.approx([0.9, slow2, 0.9 * slow2, slow4, slow5], rel=1e-6)
  assert float(state.slow['w']) == pytest.approx(slow5, rel=1e-6) and int(state.updates) == 5


def test_lookahead_slow_weights_start_at_the_first_update_not_at_init():
  # Fine-tuning builds the optimizer on fresh weights, then loads others: the slow weights follow.
  opt = optim.lookahead(optax.sgd(0.1), every=1, decay=lambda n: 0.9, total_updates=10)
  state = opt.init({'w': jnp.zeros(())})
  loaded = {'w': jnp.full((), 2.0)}
  updates, state = opt.update({'w': jnp.zeros(())}, state, loaded)  # a zero gradient: nothing to learn
  assert float(optax.apply_updates(loaded, updates)['w']) == 2.0 and float(state.slow['w']) == 2.0


def test_lookahead_from_the_config_ramps_its_decay_and_counts_updates_not_batches():
  config = _config(batch_size=8, num_train_steps=8, **{
      'schedule.name': 'constant', 'optimizer.learning_rate': 0.1, 'optimizer.momentum': 0.0,
      'optimizer.accumulate_steps': 2, 'optimizer.lookahead_every': 1, 'optimizer.lookahead_decay': 0.5,
      'optimizer.lookahead_decay_power': 1.0})
  opt, _ = optim.create_optimizer(config, lengths.run_length(config, 64))  # 4 updates
  x = {'w': jnp.ones(())}
  state = opt.init(x)
  got = []
  for _ in range(8):
    updates, state = opt.update(x, state, x)  # the gradient of x^2 / 2, the same in each half-batch
    x = optax.apply_updates(x, updates)
    got.append(float(x['w']))
  expected, value = [], 1.0
  for n in range(1, 5):  # every update syncs with decay 0.5 n / 4: x += (1 - decay) (0.9 x - x)
    value += (1 - 0.5 * n / 4) * (0.9 * value - value)
    expected += [expected[-1] if expected else 1.0, value]
  assert got == pytest.approx(expected, rel=1e-6)
  assert int(state.updates) == 4


def test_a_run_with_lookahead_ends_on_its_slow_weights(tmp_path):
  config = _config(batch_size=8, num_train_steps=6, **{'optimizer.lookahead_every': 4,
                                                      'optimizer.lookahead_decay': 0.6})
  task = _task(config)
  states = _run(task, _batches(6, 8))
  slow = lambda state: state.opt_state.slow
  leaf = lambda tree: np.asarray(jax.tree.leaves(tree)[-1])
  # Between syncs the slow weights stand still and the parameters move; at 4 and 6 they are the same.
  np.testing.assert_array_equal(leaf(slow(states[2])), leaf(slow(states[0])))
  assert not np.array_equal(leaf(states[2].params), leaf(slow(states[2])))
  for update in (3, 5):
    np.testing.assert_allclose(leaf(states[update].params), leaf(slow(states[update])), atol=1e-7)
  assert not np.array_equal(leaf(slow(states[5])), leaf(slow(states[3])))


def test_a_run_with_lookahead_resumes_bit_for_bit(tmp_path):
  import shutil
  config = _config(**{'dataset.name': 'digits', 'dataset.train_split': 'train[:256]', 'batch_size': 32,
                      'eval_every_steps': 100, 'checkpoint_every_steps': 3, 'num_train_steps': 7,
                      'optimizer.lookahead_every': 2, 'optimizer.lookahead_decay': 0.7,
                      'optimizer.lookahead_decay_power': 1.0})
  whole, resumed = str(tmp_path / 'whole'), str(tmp_path / 'resumed')
  train.train_and_evaluate(config, whole)
  # The same run stopped after its step-6 checkpoint: the slow weights and update count come back.
  shutil.copytree(whole, resumed)
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '7'))
  os.remove(os.path.join(resumed, 'results.json'))
  assert int(restore_checkpoint(resumed, 6)['opt_state']['updates']) == 6
  train.train_and_evaluate(config, resumed)
  for x, y in zip(jax.tree.leaves(restore_checkpoint(whole, 7)),
                  jax.tree.leaves(restore_checkpoint(resumed, 7)), strict=True):
    np.testing.assert_array_equal(x, y)


def test_bias_weight_decay_is_its_own_coefficient():
  params = {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones((2,))}
  zero = jax.tree.map(jnp.zeros_like, params)
  for name in ('sgd', 'adamw'):
    config = _config(batch_size=8, num_train_steps=4, **{
        'optimizer.name': name, 'optimizer.learning_rate': 1.0, 'optimizer.momentum': 0.0,
        'schedule.name': 'constant', 'optimizer.weight_decay': 0.1, 'optimizer.bias_weight_decay': 0.01})
    opt, _ = optim.create_optimizer(config, lengths.run_length(config, 64))
    updates, _ = opt.update(zero, opt.init(params), params)
    np.testing.assert_allclose(updates['kernel'], -0.1 * np.ones((2, 2)), rtol=1e-6)
    np.testing.assert_allclose(updates['bias'], -0.01 * np.ones(2), rtol=1e-6)
  config.optimizer.bias_weight_decay = 0.0  # the default: biases never decay
  opt, _ = optim.create_optimizer(config, lengths.run_length(config, 64))
  assert float(jnp.abs(opt.update(zero, opt.init(params), params)[0]['bias']).max()) == 0.0


def test_freeze_after_stops_a_parameter_after_its_epochs_counting_updates():
  # 64 examples at batch 8: 8 steps an epoch; 2 batches an update, so 0.5 epochs is 2 updates.
  config = _config(batch_size=8, num_train_steps=12, **{
      'schedule.name': 'constant', 'optimizer.learning_rate': 0.1, 'optimizer.momentum': 0.9,
      'optimizer.accumulate_steps': 2, 'optimizer.freeze_after': ('^bias$=0.5',)})
  opt, _ = optim.create_optimizer(config, lengths.run_length(config, 64))
  x = {'kernel': jnp.ones(()), 'bias': jnp.ones(())}
  state, got = opt.init(x), []
  for _ in range(12):
    updates, state = opt.update(x, state, x)  # the gradient of (kernel^2 + bias^2) / 2
    x = optax.apply_updates(x, updates)
    got.append((float(x['kernel']), float(x['bias'])))
  # Heavy-ball SGD on x^2 / 2 at 0.1 and momentum 0.9, one update per two batches: the kernel all
  # six updates, the bias its first two, then it stays where those left it.
  kernel, velocity, expected = 1.0, 0.0, []
  for _ in range(6):
    velocity = 0.9 * velocity + kernel
    kernel -= 0.1 * velocity
    expected.append(kernel)
  assert [k for k, _ in got[1::2]] == pytest.approx(expected, abs=1e-6)
  assert [b for _, b in got[1::2]] == pytest.approx(expected[:2] + [expected[1]] * 4, abs=1e-6)


def test_a_run_with_alternate_flip_has_the_host_mirror_its_batches(tmp_path, monkeypatch):
  from flaxtpu.data import loaders
  calls, plain = [], loaders.train_batches

  def recording(*args, **kwargs):
    calls.append(kwargs.get('alternate_flip'))
    return plain(*args, **kwargs)

  monkeypatch.setattr(loaders, 'train_batches', recording)
  config = _config(**{'dataset.name': 'digits', 'dataset.train_split': 'train[:256]', 'batch_size': 32,
                      'num_train_steps': 2, 'augment.flip': True, 'augment.alternate_flip': True})
  train.train_and_evaluate(config, str(tmp_path))
  assert calls and all(calls)  # the batches trained on and the TensorBoard sample alike


def test_freeze_after_names_a_bad_entry_and_a_pattern_that_matches_nothing():
  with pytest.raises(ConfigError, match=r"config.optimizer.freeze_after entry 'stem' must be 'regex=epochs' "
                                        r"with epochs >= 0, e.g. --config.optimizer.freeze_after="):
    config_lib.validate(_config(**{'optimizer.freeze_after': ('stem',)}))
  groups = optim.ParamGroups.from_config(_config(**{'optimizer.freeze_after': ('^nowhere=1',)}))
  with pytest.raises(UserError,
                     match=r"config.optimizer.freeze_after pattern '\^nowhere' matches no parameter"):
    groups.check({'stem': {'bias': jnp.zeros(2)}})


# --- mixup / CutMix -------------------------------------------------------------------


def _mix_config(**overrides):
  config = defaults.get_config().augment
  config.update_from_flattened_dict(overrides)
  return config


def _one_hot_batch(size=8, side=6, num_classes=4):
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(size, side, side, 3)).astype(np.float32))
  labels = rng.integers(0, num_classes, size)
  return images, jax.nn.one_hot(labels, num_classes)


def test_mixup_blends_each_example_with_its_neighbour_and_its_labels_alike():
  images, targets = _one_hot_batch()
  mixed, mixed_targets = augment.mix_batch(jax.random.PRNGKey(3), images, targets, jnp.arange(8),
                                           _mix_config(mixup_alpha=0.4))
  np.testing.assert_allclose(mixed_targets.sum(-1), 1.0, rtol=1e-6)
  partner = np.array([1, 0, 3, 2, 5, 4, 7, 6])
  for i in range(8):
    # The image is lam * own + (1 - lam) * partner's, with the lam its label mass gives.
    lam = float(jnp.sum(mixed_targets[i] * targets[i]) if not np.array_equal(targets[i], targets[partner[i]])
                else np.nan)
    if np.isnan(lam):
      continue
    np.testing.assert_allclose(mixed[i], lam * images[i] + (1 - lam) * images[partner[i]], atol=1e-5)
    assert 0.0 < lam < 1.0


def test_cutmix_pastes_a_box_and_weighs_the_labels_by_the_area_kept():
  images, targets = _one_hot_batch(side=10)
  mixed, mixed_targets = augment.mix_batch(jax.random.PRNGKey(5), images, targets, jnp.arange(8),
                                           _mix_config(cutmix_alpha=1.0))
  np.testing.assert_allclose(mixed_targets.sum(-1), 1.0, rtol=1e-6)
  partner = [1, 0, 3, 2, 5, 4, 7, 6]
  boxes = 0
  for i in range(8):
    from_partner = np.all(np.asarray(mixed[i]) == np.asarray(images[partner[i]]), axis=-1)
    from_self = np.all(np.asarray(mixed[i]) == np.asarray(images[i]), axis=-1)
    assert np.all(from_partner | from_self)  # every pixel is one image's or the other's
    kept = 1.0 - from_partner.mean()
    expected = kept * targets[i] + (1 - kept) * targets[partner[i]]
    np.testing.assert_allclose(mixed_targets[i], expected, atol=1e-6)
    rows, cols = np.nonzero(from_partner)
    if len(rows):  # a rectangle
      boxes += 1
      assert from_partner[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
  assert boxes >= 4


def test_mixing_is_deterministic_per_example_and_off_by_probability():
  images, targets = _one_hot_batch()
  config = _mix_config(mixup_alpha=0.4, cutmix_alpha=1.0)
  first = augment.mix_batch(jax.random.PRNGKey(1), images, targets, jnp.arange(8), config)
  again = augment.mix_batch(jax.random.PRNGKey(1), images, targets, jnp.arange(8), config)
  np.testing.assert_array_equal(first[0], again[0])
  # Rows 2-3 of a batch seen as positions 2-3 of the global batch (one pmap shard) mix the same.
  shard = augment.mix_batch(jax.random.PRNGKey(1), images[2:4], targets[2:4], jnp.arange(2, 4), config)
  np.testing.assert_array_equal(shard[0], first[0][2:4])
  np.testing.assert_array_equal(shard[1], first[1][2:4])
  unmixed = augment.mix_batch(jax.random.PRNGKey(1), images, targets, jnp.arange(8),
                              _mix_config(mixup_alpha=0.4, mix_prob=0.0))
  np.testing.assert_array_equal(unmixed[0], images)
  np.testing.assert_array_equal(unmixed[1], targets)


def test_mixing_needs_an_even_batch():
  with pytest.raises(ConfigError, match='batch_size=15 must be even with mixup/CutMix'):
    config_lib.validate(_config(batch_size=15, **{'augment.mixup_alpha': 0.2}))
  with pytest.raises(ConfigError, match='mix_prob=1.5 must be a probability'):
    config_lib.validate(_config(**{'augment.mix_prob': 1.5}))


# --- training with all of it; several eval splits; EMA for eval/predict ------------------


def test_a_run_with_ema_mixing_accumulation_and_two_eval_splits(tmp_path, monkeypatch):
  real_eval_batches = loaders.eval_batches
  config = _config(**{
      'dataset.name': 'digits', 'dataset.train_split': 'train[:512]', 'dataset.eval_split': 'test',
      'dataset.eval_splits': ('train[:100]',), 'batch_size': 32, 'num_train_steps': 16,
      'optimizer.name': 'adam', 'optimizer.learning_rate': 3e-3, 'optimizer.accumulate_steps': 2,
      'ema.decay': 0.9, 'augment.mixup_alpha': 0.2, 'augment.cutmix_alpha': 1.0,
      'augment.policy': 'trivialaugment', 'eval_every_steps': 8, 'checkpoint_every_steps': 8,
      'checkpoint.best_metric': 'eval_accuracy_ema', 'eval.ema': True})
  config_lib.validate(config)
  workdir = str(tmp_path)
  passes = []  # every pass over an eval split
  monkeypatch.setattr(loaders, 'eval_batches', lambda dataset, **kwargs: passes.append(dataset) or
                      real_eval_batches(dataset, **kwargs))
  results = train.train_and_evaluate(config, workdir)
  monkeypatch.undo()
  # 2 evaluations x 2 splits x (raw, EMA) weights; the per-class report reuses the last one's logits.
  assert len(passes) == 8
  with open(os.path.join(workdir, 'per_class.csv'), newline='') as f:
    rows = list(csv.DictReader(f))
  correct, support = sum(int(row['correct']) for row in rows), sum(int(row['support']) for row in rows)
  assert correct / support == pytest.approx(results['eval_accuracy_ema'], abs=1e-6)  # eval.ema: EMA weights
  for name in ('eval_accuracy', 'eval_accuracy_ema', 'eval_loss_ema', 'eval_top5_accuracy_ema',
               'eval_train_100_accuracy', 'eval_train_100_accuracy_ema', 'eval_train_100_loss'):
    assert 0.0 <= results[name] <= (1.0 if 'accuracy' in name else 10.0), name
  assert results['eval_accuracy_ema'] != results['eval_accuracy']
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert [row['step'] for row in rows if 'eval_train_100_accuracy' in row] == [8, 16]
  # 8 updates of an effective batch of 64: the schedule is that of 8 updates.
  saved = restore_checkpoint(workdir, 16)
  assert int(saved['step']) == 16 and set(saved['ema']) == {'params', 'batch_stats'}

  # --mode=eval with the EMA weights scores what training logged for them.
  config.eval.ema = True
  scored = eval_mode.evaluate_checkpoint(config, workdir)
  assert scored['eval_accuracy'] == pytest.approx(results['eval_accuracy_ema'], abs=1e-6)
  assert scored['weights'] == 'ema'
  with open(os.path.join(workdir, 'eval.json')) as f:
    assert set(json.load(f)['splits']) == {'test:ema'}
  assert 'per_class.csv' in scored['report_files']  # the same view as training's report: its names
  config.eval.ema = False
  raw = eval_mode.evaluate_checkpoint(config, workdir)
  assert raw['eval_accuracy'] == pytest.approx(results['eval_accuracy'], abs=1e-6)
  assert 'per_class-raw.csv' in raw['report_files']  # the raw weights beside the run's EMA report
  with open(os.path.join(workdir, 'per_class.csv'), newline='') as f:
    rows = list(csv.DictReader(f))
  assert sum(int(row['correct']) for row in rows) / sum(int(row['support']) for row in rows) == pytest.approx(
      results['eval_accuracy_ema'], abs=1e-6)
  with open(os.path.join(workdir, 'eval.json')) as f:
    assert set(json.load(f)['splits']) == {'test:ema', 'test'}


def test_eval_ema_of_a_run_without_ema_is_one_line(tmp_path):
  config = _config(**{'dataset.name': 'digits', 'dataset.train_split': 'train[:64]', 'batch_size': 32,
                      'num_train_steps': 2})
  workdir = str(tmp_path)
  train.train_and_evaluate(config, workdir)
  config.eval.ema = True
  with pytest.raises(Exception, match=r'config.eval.ema=True but the run in .* was trained without an EMA'):
    eval_mode.evaluate_checkpoint(config, workdir)


def test_eval_split_names_and_a_bad_one():
  assert metric_names.eval_metric_prefix('train[:5000]', first=False) == 'eval_train_5000_'
  assert metric_names.eval_metric_prefix('test', first=True) == 'eval_'
  with pytest.raises(ConfigError, match=r"entry 'train\[50%:\]' would log as eval_train_50_accuracy, "
                                        r"which clashes with 'train\[:50%\]'"):
    config_lib.validate(_config(**{'dataset.eval_splits': ('train[:50%]', 'train[50%:]')}))
  with pytest.raises(ConfigError, match='clashes with another metric'):
    config_lib.validate(_config(**{'dataset.eval_splits': ('top5',)}))
  with pytest.raises(ConfigError, match=r'config.eval.ema=True needs an EMA of the weights'):
    config_lib.validate(_config(**{'eval.ema': True}))
  with pytest.raises(ConfigError, match='eval_splits'):
    config_lib.validate(_config(**{'dataset.eval_splits': ('',)}))
  with pytest.raises(ConfigError, match='needs an EMA of the weights'):
    config_lib.validate(_config(**{'checkpoint.best_metric': 'eval_accuracy_ema'}))


def test_flip_tta_averages_the_logits_of_each_image_and_its_mirror():
  plain = _task(_config(batch_size=8, num_train_steps=2))
  tta = _task(_config(batch_size=8, num_train_steps=2, **{'eval.flip_tta': True}))
  state = steps.init_model(plain, 0)
  images, _ = _batches(1, 8)[0]
  expected = 0.5 * (steps.logits_fn(state, images, task=plain)
                    + steps.logits_fn(state, images[:, :, ::-1], task=plain))
  np.testing.assert_allclose(steps.logits_fn(state, images, task=tta), expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(expected, steps.logits_fn(state, images, task=plain), atol=1e-6)
  symmetric = np.concatenate([images[:, :, :4], images[:, :, :4][:, :, ::-1]], axis=2)
  np.testing.assert_allclose(steps.logits_fn(state, symmetric, task=tta),
                             steps.logits_fn(state, symmetric, task=plain), rtol=1e-5, atol=1e-6)


def test_translate_tta_adds_two_reflected_shifts_at_a_quarter_each():
  plain = _task(_config(batch_size=8, num_train_steps=2))
  both = _task(_config(batch_size=8, num_train_steps=2, **{'eval.flip_tta': True, 'eval.translate_tta': 1}))
  flip = _task(_config(batch_size=8, num_train_steps=2, **{'eval.flip_tta': True}))
  state = steps.init_model(plain, 0)
  images, _ = _batches(1, 8)[0]
  padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)), mode='reflect')  # uint8: exact
  down_right, up_left = padded[:, :8, :8], padded[:, 2:, 2:]
  assert ((down_right[:, 1:, 1:] == images[:, :-1, :-1]).all()
          and (down_right[:, 0] == images[:, 1, [1, *range(7)]]).all())
  logits = lambda x, task: np.asarray(steps.logits_fn(state, x, task=task))
  expected = 0.5 * logits(images, flip) + 0.25 * (logits(down_right, flip) + logits(up_left, flip))
  np.testing.assert_allclose(logits(images, both), expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(expected, logits(images, flip), atol=1e-6)
  with pytest.raises(UserError, match='translate_tta=8 must be smaller than the 8x8 images'):
    _task(_config(batch_size=8, num_train_steps=2, **{'eval.translate_tta': 8}))


def test_the_mnist_recipe_learns_the_embedded_digits(tmp_path):
  """configs/mnist.py's model, optimizer and schedule on the 8x8 digits (MNIST itself needs a download)."""
  from configs import mnist
  config = mnist.get_config()
  config.update_from_flattened_dict({'dataset.name': 'digits', 'num_epochs': 15.0,
                                     'augment.crop_padding': 1, 'compilation_cache_dir': 'none'})
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results['eval_accuracy'] >= 0.93, results


def test_a_run_can_turn_its_ema_off_but_not_on_when_resuming(tmp_path):
  from flaxtpu.weights.checkpoint import CheckpointError
  base = {'dataset.name': 'digits', 'dataset.train_split': 'train[:256]', 'batch_size': 32,
          'checkpoint_every_steps': 3, 'eval_every_steps': 100}
  with_ema = str(tmp_path / 'with_ema')
  train.train_and_evaluate(_config(**base, num_train_steps=3, **{'ema.decay': 0.9}), with_ema)
  # Off: the saved EMA is left unread (as are checkpoints written before flaxtpu had one).
  resumed = train.train_and_evaluate(_config(**base, num_train_steps=6), with_ema)
  assert resumed['step'] == 6 and 'eval_accuracy_ema' not in resumed
  assert restore_checkpoint(with_ema, 6)['ema'] == {}
  # On: there is no average to continue from; the changed key is named.
  without = str(tmp_path / 'without')
  train.train_and_evaluate(_config(**base, num_train_steps=3), without)
  with pytest.raises(CheckpointError, match=r'other settings \(ema.decay=0.0 -> 0.9\)'):
    train.train_and_evaluate(_config(**base, num_train_steps=6, **{'ema.decay': 0.9}), without)


def test_fine_tuning_with_ema_starts_the_average_at_the_loaded_weights(tmp_path):
  base = {'dataset.name': 'digits', 'dataset.train_split': 'train[:256]', 'batch_size': 32,
          'eval_every_steps': 100}
  source = str(tmp_path / 'source')
  train.train_and_evaluate(_config(**base, num_train_steps=3), source)
  tuned = str(tmp_path / 'tuned')
  # One step at a zero learning rate: the weights stay the loaded ones, and so must their average.
  config = _config(**base, num_train_steps=1, **{'init_from.checkpoint': source, 'ema.decay': 0.9,
                                                 'optimizer.freeze': ('.',)})
  results = train.train_and_evaluate(config, tuned)
  loaded, saved = restore_checkpoint(source, 3), restore_checkpoint(tuned, 1)
  for x, y in zip(jax.tree.leaves(loaded['params']), jax.tree.leaves(saved['ema']['params'])):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  assert results['eval_accuracy_ema'] == pytest.approx(results['eval_accuracy'])


def test_resuming_with_another_accumulation_is_one_line(tmp_path):
  from flaxtpu.weights.checkpoint import CheckpointError
  base = {'dataset.name': 'digits', 'dataset.train_split': 'train[:256]', 'batch_size': 32,
          'eval_every_steps': 100, 'checkpoint_every_steps': 2}
  workdir = str(tmp_path)
  train.train_and_evaluate(_config(**base, num_train_steps=2, **{'optimizer.accumulate_steps': 2}), workdir)
  with pytest.raises(CheckpointError, match=r'was trained with optimizer.accumulate_steps=2.*resume with '
                                            r'--config.optimizer.accumulate_steps=2'):
    train.train_and_evaluate(_config(**base, num_train_steps=8, **{'optimizer.accumulate_steps': 4}), workdir)


def test_a_checkpoint_written_before_the_ema_existed_resumes(tmp_path):
  from flaxtpu.weights import checkpoint
  config = _config(**{'dataset.name': 'digits', 'dataset.train_split': 'train[:256]', 'batch_size': 32,
                      'eval_every_steps': 100, 'num_train_steps': 2})
  new = str(tmp_path / 'new')
  train.train_and_evaluate(config, new)
  # The same state as the code before the EMA saved it: no `ema` field at all (nor `swa`, added later).
  state = restore_checkpoint(new, 2)
  del state['ema'], state['swa']
  record = checkpoint.Checkpoints(new, config, read_only=True).read_record(2)
  old = str(tmp_path / 'old')
  writer = checkpoint.Checkpoints(old, config)
  writer.save(2, state, record)
  writer.wait()
  writer.close()
  config.num_train_steps = 4
  assert train.train_and_evaluate(config, old)['step'] == 4
  # Turning the EMA on for it names the key, as for any run without one.
  config.ema.decay, config.num_train_steps = 0.9, 6
  with pytest.raises(checkpoint.CheckpointError, match=r'other settings \(ema.decay=0.0 -> 0.9\)'):
    train.train_and_evaluate(config, old)
