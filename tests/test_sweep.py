"""flaxtpu.sweep: sweep expansion, run names, commands, reports, and a tiny sweep run end to end."""

import csv
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from PIL import Image

from flaxtpu import sweep
from flaxtpu.sweep import __main__ as cli
from flaxtpu.sweep import processes as sweep_processes
from flaxtpu.sweep import report as sweep_report
from flaxtpu.sweep import runner, slurm

REPO_ROOT = Path(__file__).resolve().parents[1]

# A tiny experiment over two keys (4 runs); the report test fakes its run directories.
TWO_KEY_EXPERIMENT = '''
from flaxtpu import sweep
from flaxtpu.settings import defaults

def get_config():
  return defaults.get_config()

def get_sweep():
  return sweep.product(sweep.sweep('optimizer.learning_rate', [0.1, 0.2]),
                       sweep.sweep('schedule.name', ['cosine', 'constant']))
'''


@pytest.fixture
def in_repo_root(monkeypatch):
  # Experiment files import `configs`, found from the working directory as on the command line.
  monkeypatch.chdir(REPO_ROOT)


def write_experiment(directory: Path, source: str, name: str = 'experiment.py') -> Path:
  path = directory / name
  path.write_text(textwrap.dedent(source))
  return path


# --- expansion ---------------------------------------------------------------------


def test_sweep_product_zip_chain_expand_to_exact_lists():
  learning_rates = sweep.sweep('optimizer.learning_rate', [0.1, 0.2])
  schedules = sweep.sweep('schedule.name', ['cosine', 'constant'])
  assert learning_rates == [{'optimizer.learning_rate': 0.1}, {'optimizer.learning_rate': 0.2}]
  assert sweep.product(learning_rates, schedules) == [
      {'optimizer.learning_rate': 0.1, 'schedule.name': 'cosine'},
      {'optimizer.learning_rate': 0.1, 'schedule.name': 'constant'},
      {'optimizer.learning_rate': 0.2, 'schedule.name': 'cosine'},
      {'optimizer.learning_rate': 0.2, 'schedule.name': 'constant'},
  ]
  assert sweep.zip_(learning_rates, schedules) == [
      {'optimizer.learning_rate': 0.1, 'schedule.name': 'cosine'},
      {'optimizer.learning_rate': 0.2, 'schedule.name': 'constant'},
  ]
  assert sweep.chain(learning_rates, [{'model.name': 'cnn'}], schedules) == [
      {'optimizer.learning_rate': 0.1},
      {'optimizer.learning_rate': 0.2},
      {'model.name': 'cnn'},
      {'schedule.name': 'cosine'},
      {'schedule.name': 'constant'},
  ]
  # Nesting: seeds x (zipped model + learning rate pairs).
  models = sweep.zip_(sweep.sweep('model.name', ['cnn', 'resnet20']),
                      sweep.sweep('optimizer.learning_rate', [1e-3, 0.1]))
  assert sweep.product(sweep.sweep('seed', [0, 1]), models) == [
      {'seed': 0, 'model.name': 'cnn', 'optimizer.learning_rate': 1e-3},
      {'seed': 0, 'model.name': 'resnet20', 'optimizer.learning_rate': 0.1},
      {'seed': 1, 'model.name': 'cnn', 'optimizer.learning_rate': 1e-3},
      {'seed': 1, 'model.name': 'resnet20', 'optimizer.learning_rate': 0.1},
  ]
  assert sweep.product() == [{}]


def test_sweep_helpers_reject_ambiguous_definitions():
  with pytest.raises(sweep.SweepError, match=r'different lengths \[2, 1\]'):
    sweep.zip_(sweep.sweep('seed', [0, 1]), sweep.sweep('batch_size', [8]))
  with pytest.raises(sweep.SweepError, match="'seed' is set by more than one"):
    sweep.product(sweep.sweep('seed', [0, 1]), sweep.sweep('seed', [2]))
  with pytest.raises(sweep.SweepError, match='needs a list of values'):
    sweep.sweep('model.name', 'cnn')


# --- run names and commands ------------------------------------------------------------


def test_run_names_are_readable_safe_and_distinct():
  assert runner.run_name({'optimizer.learning_rate': 0.1, 'schedule.name': 'cosine'}) == (
      'optimizer.learning_rate=0.1,schedule.name=cosine')
  assert runner.run_name({'optimizer.learning_rate': 1e-05, 'augment.flip': True}) == (
      'optimizer.learning_rate=1e-05,augment.flip=true')
  assert runner.run_name({'dataset.folder': '/data/my images'}) == 'dataset.folder=_data_my_images'
  assert runner.run_name({}) == 'base'
  long_a = runner.run_name({'dataset.folder': 'x' * 300 + 'a'})
  long_b = runner.run_name({'dataset.folder': 'x' * 300 + 'b'})
  assert len(long_a) == runner.MAX_RUN_NAME_LENGTH and long_a != long_b

  # Values that sanitise to one name get numbered directories; identical runs are a mistake.
  runs = runner.make_runs('e.py', 'out', [{'dataset.folder': 'a/b'}, {'dataset.folder': 'a_b'}])
  assert [run.name for run in runs] == ['dataset.folder=a_b', 'dataset.folder=a_b-2']
  with pytest.raises(sweep.SweepError, match='more than once'):
    runner.make_runs('e.py', 'out', [{'seed': 1}, {'seed': 1}])


def test_dry_run_prints_the_exact_commands_and_runs_nothing(tmp_path, in_repo_root, capsys):
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  workdir = tmp_path / 'sweep'
  status = cli.main([str(experiment), f'--workdir={workdir}', '--dry-run',
                     '--config.batch_size=16', '--config.augment.flip', 'true'])
  assert status == 0
  lines = capsys.readouterr().out.splitlines()
  expected = []
  for learning_rate in ('0.1', '0.2'):
    for schedule in ('cosine', 'constant'):
      name = f'optimizer.learning_rate={learning_rate},schedule.name={schedule}'
      expected.append(shlex.join([
          sys.executable, '-m', 'flaxtpu.main', f'--config={experiment}', f'--workdir={workdir / name}',
          f'--config.optimizer.learning_rate={learning_rate}', f'--config.schedule.name={schedule}',
          '--config.batch_size=16', '--config.augment.flip=true']))
  assert lines == expected
  assert not workdir.exists()


@pytest.mark.parametrize('sweep_source, message', [
    ("sweep.sweep('optimizer.lr', [0.1])",
     "sweep key 'optimizer.lr' is not a config key (did you mean 'optimizer.learning_rate'?)"),
    ("sweep.product(sweep.sweep('seed', [0]), sweep.sweep('model.nmae', ['cnn']))",
     "sweep key 'model.nmae' is not a config key (did you mean 'model.name'?)"),
    ("sweep.sweep('batch_size', ['large'])", "sweep key 'batch_size': value 'large' has the wrong type"),
])
def test_a_bad_sweep_key_is_one_error_line_before_anything_runs(tmp_path, in_repo_root, capsys,
                                                                 sweep_source, message):
  experiment = write_experiment(tmp_path, f'''
      from flaxtpu import sweep
      from flaxtpu.settings import defaults
      get_config = defaults.get_config
      def get_sweep():
        return {sweep_source}
      ''')
  workdir = tmp_path / 'sweep'
  assert cli.main([str(experiment), f'--workdir={workdir}']) == 2
  stderr = capsys.readouterr().err
  assert stderr.startswith('error: ') and message in stderr and stderr.count('\n') == 1
  assert not workdir.exists()


# Each mistake an experiment file can make while it is imported or builds its runs' configs, and the one
# line it gets: FILE is the file's path, LINE the line number that failed.
BROKEN_EXPERIMENTS = {
    'syntax error': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def get_sweep(:
          return []
        """, 'FILE, line 5: SyntaxError: invalid syntax (while importing it); fix the experiment file '
             '(nothing ran)'),
    'name error at import': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        LEARNING_RATES = [0.1, learning_rate]
        def get_sweep():
          return sweep.sweep('optimizer.learning_rate', LEARNING_RATES)
        """, "FILE, line 5: NameError: name 'learning_rate' is not defined (while importing it); fix the "
             'experiment file (nothing ran)'),
    'get_sweep raises': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def rates():
          raise ValueError('no rates for this budget')
        def get_sweep():
          return sweep.sweep('optimizer.learning_rate', rates())
        """, 'FILE, line 6: ValueError: no rates for this budget (while get_sweep() listed the runs); fix '
             'the experiment file (nothing ran)'),
    'get_config sets a key that does not exist': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        def get_config():
          config = defaults.get_config()
          config.model.nmae = 'resnet20'
          return config
        def get_sweep():
          return sweep.sweep('seed', [0, 1])
        """, "FILE, line 6: sets config key 'nmae', which does not exist (did you mean 'name'?) (while "
             'get_config() built the base config); fix the experiment file (nothing ran)'),
    'get_config returns nothing': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        def get_config():
          config = defaults.get_config()
        def get_sweep():
          return sweep.sweep('seed', [0, 1])
        """, 'FILE: get_config() returned None (no return statement?), not an ml_collections ConfigDict; '
             'return flaxtpu.settings.defaults.get_config() with your changes'),
    'get_sweep returns a dict': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def get_sweep():
          return {'seed': [0, 1]}
        """, "FILE: get_sweep() returned a dict ({'seed': [0, 1]}), not a list of {config key: value} dicts "
             '(one per run)'),
    'a run that is not a dict': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def get_sweep():
          return [{'seed': 0}, 'seed=1']
        """, "FILE: get_sweep() item 1 is a str ('seed=1'), not a {config key: value} dict"),
    'a key that does not exist': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def get_sweep():
          return sweep.product(sweep.sweep('seed', [0]), sweep.sweep('model.nmae', ['cnn', 'resnet20']))
        """, "FILE: run 1 of 2 (seed=0,model.nmae=cnn): sweep key 'model.nmae' is not a config key (did you "
             "mean 'model.name'?)"),
    'a value of the wrong type': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def get_sweep():
          return sweep.sweep('batch_size', [64, 'large'])
        """, "FILE: run 2 of 2 (batch_size=large): sweep key 'batch_size': value 'large' has the wrong "
             "type (Could not override field 'batch_size' (reference). large is of original type "
             "<class 'str'> and cannot be casted to type <class 'int'>)"),
    'a value config validation refuses': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def get_sweep():
          return sweep.product(sweep.sweep('optimizer.learning_rate', [0.1, 0.2]),
                               sweep.sweep('schedule.name', ['cosine', 'cosin']))
        """, "FILE: run 2 of 4 (optimizer.learning_rate=0.1,schedule.name=cosin): "
             "config.schedule.name='cosin' is not valid; choose one of: 'constant', 'cosine', 'linear', "
             "'onecycle', 'step', 'exponential', 'rsqrt', 'plateau'"),
    'values that cannot work together': ("""
        from flaxtpu import sweep
        from flaxtpu.settings import defaults
        get_config = defaults.get_config
        def get_sweep():
          return sweep.chain(sweep.sweep('optimizer.name', ['sgd']), [{'optimizer.nesterov': True}])
        """, 'FILE: run 2 of 2 (optimizer.nesterov=true): config.optimizer.nesterov=True has no effect on '
             "optimizer.name='adam'; leave it at False or pick one that reads it: sgd, lars, rmsprop, muon"),
}


def _run_sweep_command(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'flaxtpu.sweep', *args], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def assert_one_line(result: subprocess.CompletedProcess, expected: str, workdir: Path) -> None:
  """Exit status 2, stderr the one `error:` line (no traceback), nothing on stdout or in the workdir."""
  assert (result.returncode, result.stderr, result.stdout) == (2, f'error: {expected}\n', ''), result.stderr
  assert not workdir.exists()


@pytest.mark.parametrize('case', sorted(BROKEN_EXPERIMENTS))
def test_every_mistake_of_an_experiment_file_is_one_line_and_runs_nothing(tmp_path, case):
  """Issue 52 part 3: whatever an experiment file raises or gets wrong while it is imported or builds and
  validates its runs' configs is one line naming the file (its line) and the run; nothing is created."""
  source, message = BROKEN_EXPERIMENTS[case]
  experiment = write_experiment(tmp_path, source)
  workdir = tmp_path / 'sweep'
  result = _run_sweep_command(str(experiment), f'--workdir={workdir}')
  assert_one_line(result, message.replace('FILE', str(experiment)), workdir)
  if 'run ' in message:  # the runs' checks need no data and no weights: a dry run makes them too
    assert_one_line(_run_sweep_command(str(experiment), f'--workdir={workdir}', '--dry-run'),
                    message.replace('FILE', str(experiment)), workdir)


def test_a_folder_for_an_experiment_file_names_the_files_in_it(tmp_path):
  (tmp_path / 'experiments').mkdir()
  write_experiment(tmp_path / 'experiments', TWO_KEY_EXPERIMENT)
  named = sorted(str(path) for path in (tmp_path / 'experiments').glob('*.py'))
  workdir, folder = tmp_path / 'sweep', tmp_path / 'experiments'
  assert_one_line(_run_sweep_command(str(folder), f'--workdir={workdir}'),
                  f"'{folder}' is a folder, not an experiment file; experiment files in it: "
                  + ', '.join(named), workdir)


@pytest.mark.parametrize('trials, why', [('0', '0: a study runs at least 1 trial'),
                                         ('-3', '-3: a study runs at least 1 trial'),
                                         ('x', "'x' is not a whole number")])
def test_a_study_of_no_trials_is_refused_as_such(tmp_path, trials, why):
  """--trials=0 ran the grid (and asked for get_sweep), --trials=-3 said the study flags needed --trials."""
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  result = _run_sweep_command(str(experiment), f'--workdir={tmp_path / "sweep"}', f'--trials={trials}')
  assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
      f'python -m flaxtpu.sweep: error: argument --trials: {why}'), result.stderr
  assert not (tmp_path / 'sweep').exists()


def test_a_report_of_a_sweep_that_never_ran_is_one_line_and_writes_nothing(tmp_path):
  """--report on a WORKDIR that does not exist made it and wrote an empty table there."""
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  workdir = tmp_path / 'sweep'
  assert_one_line(_run_sweep_command(str(experiment), f'--workdir={workdir}', '--report'),
                  f'--report: {workdir} holds no sweep yet (no such directory); run it first: the same '
                  'command without --report', workdir)


def test_a_command_line_value_of_the_wrong_type_is_one_line(tmp_path):
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  workdir = tmp_path / 'sweep'
  assert_one_line(_run_sweep_command(str(experiment), f'--workdir={workdir}', '--config.batch_size=large'),
                  "--config.batch_size=large: invalid literal for int() with base 10: 'large'; fix the value "
                  'given on the command line', workdir)
  # Valid alone, refused with the runs' values: the run that cannot work is named.
  assert_one_line(_run_sweep_command(str(experiment), f'--workdir={workdir}', '--config.optimizer.name=sgd',
                                     '--config.optimizer.b1=0.5'),
                  f'{experiment}: run 1 of 4 (optimizer.learning_rate=0.1,schedule.name=cosine): '
                  "config.optimizer.b1=0.5 has no effect on optimizer.name='sgd'; leave it at 0.9 or pick "
                  'one that reads it: adam, adamw, lamb, lion, muon, schedule_free_adamw, schedule_free_sgd',
                  workdir)


def test_runs_are_checked_with_their_init_from_source_resolved(tmp_path, in_repo_root, capsys):
  """A run's config is checked as its trainer resolves it: a source it cannot read is one line naming
  the run, before any run starts; a dry run, which reads no weights, lists it."""
  experiment = write_experiment(tmp_path, """
      from flaxtpu import sweep
      from flaxtpu.settings import defaults
      get_config = defaults.get_config
      def get_sweep():
        return sweep.sweep('init_from.checkpoint', ['', '/no/such/run'])
      """)
  workdir = tmp_path / 'sweep'
  assert cli.main([str(experiment), f'--workdir={workdir}']) == 2
  assert capsys.readouterr().err == (
      f"error: {experiment}: run 2 of 2 (init_from.checkpoint=_no_such_run): config.init_from.checkpoint="
      "'/no/such/run' holds no flaxtpu checkpoint; point it at the --workdir of a finished run (or its "
      'WORKDIR/checkpoints/STEP)\n')
  assert not workdir.exists()
  assert cli.main([str(experiment), f'--workdir={workdir}', '--dry-run']) == 0
  assert len(capsys.readouterr().out.splitlines()) == 2


def test_command_line_overrides_are_checked(tmp_path, in_repo_root, capsys):
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  workdir = tmp_path / 'sweep'
  assert cli.main([str(experiment), f'--workdir={workdir}', '--config.batch_sise=8']) == 2
  assert "--config.batch_sise: not a config key (did you mean 'batch_size'?)" in capsys.readouterr().err
  assert cli.main([str(experiment), f'--workdir={workdir}', '--config.schedule.name=linear']) == 2
  assert 'the experiment sweeps this key' in capsys.readouterr().err
  assert not workdir.exists()


def test_progress_line_counts_runs_and_estimates_the_remaining_time():
  runs = [runner.Run(name=str(index), overrides={}, command=[], status=status)
          for index, status in enumerate(['done', 'running', 'failed', 'pending', 'pending'])]
  started = {'1': time.monotonic() - 30.0}
  line = sweep_processes.progress_line(runs, started, parallel=2, finished_durations=[60.0], elapsed_s=95.0)
  # Two pending runs of 60 s plus the 30 s the running one has left, over 2 workers: 75 s.
  assert line == '[sweep] 1/5 done, 1 running, 1 failed, 2 pending, elapsed 0:01:35, ETA 0:01:15'


def test_shipped_experiments_expand_against_their_configs(in_repo_root):
  config, runs_overrides = runner.load_experiment('experiments/cifar10_lr.py')
  assert len(runs_overrides) == 9
  assert {overrides['schedule.name'] for overrides in runs_overrides} == {'cosine', 'onecycle'}
  assert (config.dataset.name, config.dataset.folder) == ('cifar10', '')  # TFDS; a folder comes from the CLI
  config, runs_overrides = runner.load_experiment('experiments/cifar10_models.py')
  models = [overrides['model.name'] for overrides in runs_overrides]
  assert models == ['cnn', 'resnet20', 'resnet32']


def test_error_line_comes_from_the_latest_attempt(tmp_path):
  log = tmp_path / 'log.txt'
  log.write_text(f'{runner.LAUNCH_MARKER} 1\nerror: old problem\n'
                 f'{runner.LAUNCH_MARKER} 2\nTraceback\nerror: new problem\nmore traceback\n')
  assert sweep_processes.error_line(str(log)) == 'error: new problem'
  log.write_text(f'{runner.LAUNCH_MARKER} 1\nerror: old problem\n{runner.LAUNCH_MARKER} 2\nKilled\n')
  assert sweep_processes.error_line(str(log)) == 'Killed'


# --- report --------------------------------------------------------------------------


def fake_run(run_dir: Path, results: dict, eval_accuracies: list, train_losses: list) -> None:
  """A run directory as the trainer leaves it: results.json and metrics.jsonl."""
  run_dir.mkdir(parents=True)
  (run_dir / 'results.json').write_text(json.dumps(results))
  lines = []
  for step, (accuracy, loss) in enumerate(zip(eval_accuracies, train_losses), start=1):
    lines.append(json.dumps({'step': step * 10, 'train_loss': loss, 'learning_rate': 0.1}))
    lines.append(json.dumps({'step': step * 10, 'eval_accuracy': accuracy, 'eval_loss': 2.0 - accuracy}))
  (run_dir / 'metrics.jsonl').write_text('\n'.join(lines) + '\n')


def test_report_tables_and_plots_hold_each_runs_numbers(tmp_path, in_repo_root):
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  workdir = tmp_path / 'sweep'
  numbers = {
      'optimizer.learning_rate=0.1,schedule.name=cosine': dict(
          step=40, eval_accuracy=0.8123456789, eval_loss=0.61234567, train_loss=0.4321,
          train_images_per_sec=1234.5678, wall_time_s=61.25, eval_accuracy_ema=0.83456),
      'optimizer.learning_rate=0.1,schedule.name=constant': dict(
          step=40, eval_accuracy=0.7012345, eval_loss=0.8, train_loss=0.5,
          train_images_per_sec=1200.0, wall_time_s=60.0),
      'optimizer.learning_rate=0.2,schedule.name=cosine': dict(
          step=40, eval_accuracy=0.75, eval_loss=0.7, train_loss=0.45,
          train_images_per_sec=1210.0, wall_time_s=62.0),
  }
  best_accuracies = {}
  for index, (name, results) in enumerate(numbers.items()):
    # The best eval accuracy is mid-run, above the final one, for the first run only.
    curve = [0.5, results['eval_accuracy'] + (0.01 if index == 0 else -0.1), results['eval_accuracy']]
    best_accuracies[name] = max(curve)
    fake_run(workdir / name, results, curve, [2.0, 1.0, results['train_loss']])
  failed = 'optimizer.learning_rate=0.2,schedule.name=constant'
  (workdir / failed).mkdir()
  (workdir / 'sweep.json').write_text(json.dumps({'runs': [
      {'name': failed, 'status': 'failed', 'error': "error: model.name='x' is unknown"}]}))

  assert cli.main([str(experiment), f'--workdir={workdir}', '--report']) == 0

  with open(workdir / 'results.csv') as f:
    rows = list(csv.DictReader(f))
  assert [row['run'] for row in rows] == [
      'optimizer.learning_rate=0.1,schedule.name=cosine', 'optimizer.learning_rate=0.2,schedule.name=cosine',
      'optimizer.learning_rate=0.1,schedule.name=constant', failed]
  for row in rows[:3]:
    results = numbers[row['run']]
    for key in ('eval_accuracy', 'eval_loss', 'train_loss', 'train_images_per_sec', 'wall_time_s'):
      assert float(row[key]) == results[key], key
    assert int(row['step']) == results['step']
    assert float(row['best_eval_accuracy']) == best_accuracies[row['run']]
    assert row['status'] == 'done' and row['error'] == ''
  assert (rows[3]['status'], rows[3]['error'], rows[3]['eval_accuracy']) == (
      'failed', "error: model.name='x' is unknown", '')
  assert (rows[0]['optimizer.learning_rate'], rows[0]['schedule.name']) == ('0.1', 'cosine')

  markdown = (workdir / 'results.md').read_text()
  first_row = next(line for line in markdown.splitlines() if line.startswith('| 0.1 | cosine'))
  # A run with EMA weights adds their column, next to eval accuracy ('-' for runs without).
  assert first_row == '| 0.1 | cosine | 0.8123 | 0.8346 | 0.8223 | 0.6123 | 0.4321 | 40 | 1235 | 61 | done |'
  assert '| 0.2 | cosine | 0.7500 | - | ' in markdown
  assert float(rows[0]['eval_accuracy_ema']) == 0.83456 and rows[1]['eval_accuracy_ema'] == ''
  assert f"- `{failed}`: error: model.name='x' is unknown" in markdown

  plots = sorted(path.name for path in (workdir / 'plots').iterdir())
  assert plots == ['eval_accuracy.png', 'eval_accuracy_vs_optimizer.learning_rate.png',
                   'eval_accuracy_vs_schedule.name.png', 'final_eval_accuracy.png', 'train_loss.png']
  for plot in plots:
    with Image.open(workdir / 'plots' / plot) as image:
      # 6 x 4 inches at 80 dpi; the ranking of the 3 finished runs 8 x (1.2 + 3 x 0.25).
      assert image.size == ((640, 156) if plot == 'final_eval_accuracy.png' else (480, 320)), plot

  # report.html: the same table and every plot on one self-contained page.
  page = (workdir / 'report.html').read_text()
  assert all(f'<section id="{ident}">' in page for ident in ('results', 'plots', 'errors'))
  assert page.count('<img src="data:image/png;base64,') == len(plots) and 'http' not in page
  assert '<td>0.8123</td><td>0.8346</td>' in page and "model.name=&#x27;x&#x27; is unknown" in page


def test_ranking_puts_the_best_run_on_top_and_keeps_long_names_apart():
  long_name = 'a' * 100 + '-12345678'  # as runner.run_name shortens a long name: its start and a hash
  rows = [{'run': 'best', 'eval_accuracy': 0.9}, {'run': long_name, 'eval_accuracy': 0.5},
          {'run': 'failed', 'eval_accuracy': None}, {'run': 'middle', 'eval_accuracy': 0.7}]
  labels, accuracies = sweep_report.ranked_runs(rows, width=30)
  assert accuracies == [0.5, 0.7, 0.9]  # a plot's y axis grows upward: the best is drawn on top
  assert labels == ['a' * 20 + '…-12345678', 'middle', 'best']


def test_the_ranking_of_a_big_sweep_shows_its_best_runs(tmp_path, in_repo_root):
  experiment = write_experiment(tmp_path, '''
      from flaxtpu import sweep
      from flaxtpu.settings import defaults

      def get_config():
        return defaults.get_config()

      def get_sweep():
        return sweep.sweep('seed', list(range(60)))
      ''')
  workdir = tmp_path / 'sweep'
  for seed in range(60):
    fake_run(workdir / f'seed={seed}', dict(step=10, eval_accuracy=seed / 100, eval_loss=1.0, train_loss=1.0),
             [seed / 100], [1.0])
  assert cli.main([str(experiment), f'--workdir={workdir}', '--report']) == 0
  with Image.open(workdir / 'plots' / 'final_eval_accuracy.png') as image:
    assert image.size == (640, int(80 * (1.2 + 0.25 * sweep_report.MAX_RANKED_RUNS)))  # 50 rows, not 60


def test_report_plots_runs_whose_overrides_hold_dollar_signs(tmp_path, in_repo_root):
  # A regex override ('^stem/bias$') in a legend label or tick was read as TeX math, which failed to
  # parse: the sweep's 13 runs finished and the sweep still exited 1, without plots.
  experiment = write_experiment(tmp_path, '''
      from flaxtpu.settings import defaults

      def get_config():
        return defaults.get_config()

      def get_sweep():
        return [{'optimizer.freeze_after': ('^stem/bias$=0.6',), 'optimizer.learning_rate': 0.1},
                {'optimizer.freeze_after': ('^b$=2', 'BatchNorm_\\d+/bias$=1'),
                 'optimizer.learning_rate': 0.2},
                {'optimizer.freeze_after': (), 'optimizer.learning_rate': 0.3}]
      ''')
  workdir = tmp_path / 'sweep'
  _, overrides = runner.load_experiment(str(experiment))
  for index, run_overrides in enumerate(overrides):
    accuracy = 0.5 + 0.1 * index
    fake_run(workdir / runner.run_name(run_overrides), dict(step=20, eval_accuracy=accuracy, eval_loss=1.0,
                                                             train_loss=1.0), [0.4, accuracy], [2.0, 1.0])

  assert cli.main([str(experiment), f'--workdir={workdir}', '--report']) == 0

  plots = sorted(path.name for path in (workdir / 'plots').iterdir())
  assert plots == ['eval_accuracy.png', 'eval_accuracy_vs_optimizer.freeze_after.png',
                   'eval_accuracy_vs_optimizer.learning_rate.png', 'final_eval_accuracy.png',
                   'train_loss.png']
  with open(workdir / 'results.csv') as f:
    assert [float(row['eval_accuracy']) for row in csv.DictReader(f)] == [0.7, 0.6, 0.5]


# --- end to end ------------------------------------------------------------------------


def launches(run_dir: Path) -> int:
  return (run_dir / 'log.txt').read_text().count(runner.LAUNCH_MARKER)


def test_tiny_sweep_end_to_end_records_a_failure_and_skips_finished_runs_on_rerun(tmp_path, image_folder):
  experiment = write_experiment(tmp_path, '''
      from flaxtpu import sweep
      from flaxtpu.settings import defaults

      def get_config():
        config = defaults.get_config()
        config.model.name = 'cnn'
        return config

      def get_sweep():
        # The last run passes every check the sweep makes before it starts; its trainer finds no split.
        return sweep.chain(sweep.sweep('optimizer.learning_rate', [1e-3, 1e-2]),
                           [{'dataset.train_split': 'nosuchsplit'}])
      ''')
  workdir = tmp_path / 'sweep'
  command = [sys.executable, '-m', 'flaxtpu.sweep', str(experiment), f'--workdir={workdir}', '--parallel=2',
             f'--config.dataset.folder={image_folder}', '--config.num_train_steps=2', '--config.batch_size=8',
             '--config.log_every_steps=1', '--config.cpu_devices=1']
  environment = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  first = subprocess.run(command, cwd=REPO_ROOT, env=environment,
                         capture_output=True, text=True, timeout=300)
  assert first.returncode == 1, first.stdout + first.stderr
  assert '1 of 3 runs failed' in first.stderr

  record = {run['name']: run for run in json.loads((workdir / 'sweep.json').read_text())['runs']}
  finished = ['optimizer.learning_rate=0.001', 'optimizer.learning_rate=0.01']
  failing = 'dataset.train_split=nosuchsplit'
  assert sorted(record) == sorted(finished + [failing])
  assert record[failing]['status'] == 'failed'
  assert record[failing]['error'].startswith('error: ')
  assert 'nosuchsplit' in record[failing]['error']
  results = {}
  for name in finished:
    assert record[name]['status'] == 'done' and record[name]['returncode'] == 0
    results[name] = json.loads((workdir / name / 'results.json').read_text())
    assert results[name]['step'] == 2
  with open(workdir / 'results.csv') as f:
    rows = {row['run']: row for row in csv.DictReader(f)}
  for name in finished:
    assert float(rows[name]['eval_accuracy']) == results[name]['eval_accuracy']
    assert float(rows[name]['eval_loss']) == results[name]['eval_loss']
  assert rows[failing]['status'] == 'failed'
  assert (workdir / 'plots' / 'eval_accuracy.png').exists()
  assert (workdir / 'plots' / 'train_loss.png').exists()

  modified = {name: (workdir / name / 'results.json').stat().st_mtime_ns for name in finished}
  second = subprocess.run(command, cwd=REPO_ROOT, env=environment,
                          capture_output=True, text=True, timeout=300)
  assert second.returncode == 1, second.stdout + second.stderr
  assert '2 run(s) already finished, skipping them' in second.stdout
  for name in finished:
    assert (workdir / name / 'results.json').stat().st_mtime_ns == modified[name]
    assert launches(workdir / name) == 1
  # The failed run is launched again (the trainer would resume it) and fails again.
  assert launches(workdir / failing) == 2


def test_a_missing_data_folder_stops_the_sweep_before_any_run(tmp_path, in_repo_root, capsys, image_folder):
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  workdir = tmp_path / 'sweep'
  assert cli.main([str(experiment), f'--workdir={workdir}', '--config.dataset.folder=/no/such/dir']) == 2
  assert capsys.readouterr().err == ("error: dataset.folder='/no/such/dir' is not a directory; pass an image "
                                     'folder laid out as split/class/image with '
                                     '--config.dataset.folder=PATH\n')
  assert not workdir.exists()
  config, runs_overrides = runner.load_experiment(str(experiment))
  runner.check_data_folders(config, runs_overrides, [f'--config.dataset.folder={image_folder}'])


def test_a_second_sweep_on_one_directory_is_refused_and_changes_nothing(tmp_path, in_repo_root, capsys,
                                                                       image_folder, monkeypatch):
  """Issue 43, class 5: the sweep directory has its own lock; the second sweep is one line, exit 2."""
  from flaxtpu.io import lock
  experiment = write_experiment(tmp_path, TWO_KEY_EXPERIMENT)
  workdir = tmp_path / 'sweep'
  workdir.mkdir()
  (workdir / 'sweep.json').write_text(
      '{"runs": [{"name": "optimizer.learning_rate=0.1,schedule.name=cosine", "status": "done"}]}')
  started = []
  monkeypatch.setattr(sweep_processes, 'run_sweep', lambda *args, **kwargs: started.append(args))
  # --launcher=slurm checks for sbatch and squeue before the lock; this machine need not have SLURM.
  monkeypatch.setattr(slurm, 'check_commands', lambda: None)
  with lock.WorkdirLock(str(workdir), file=runner.LOCK_FILE, who='sweep'):  # the first sweep, alive
    before = {path: path.read_bytes() for path in workdir.iterdir()}
    for launcher in ([], ['--launcher=slurm']):
      assert cli.main([str(experiment), f'--workdir={workdir}', f'--config.dataset.folder={image_folder}',
                       *launcher]) == 2
      error = capsys.readouterr().err
      assert error.startswith(f'error: --workdir={workdir} is in use by a live sweep (pid {os.getpid()} on '
                              'host ') and error.count('\n') == 1, error
    assert started == [] and {path: path.read_bytes() for path in workdir.iterdir()} == before
  # Reports read a live sweep's directory; once the first sweep ends, the next one runs.
  assert cli.main([str(experiment), f'--workdir={workdir}', '--report']) == 0
  capsys.readouterr()
  cli.main([str(experiment), f'--workdir={workdir}', f'--config.dataset.folder={image_folder}'])
  assert len(started) == 1


def test_parallel_runs_split_the_gpus_or_are_refused(monkeypatch):
  monkeypatch.setattr(sweep_processes.glob, 'glob', lambda pattern: [])
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '0,1,2,3')
  assert sweep_processes.device_groups(2) == [{'CUDA_VISIBLE_DEVICES': '0,1'},
                                              {'CUDA_VISIBLE_DEVICES': '2,3'}]
  assert sweep_processes.device_groups(3) == [{'CUDA_VISIBLE_DEVICES': d} for d in ('0', '1', '2')]
  assert sweep_processes.device_groups(1) == [{}]
  with pytest.raises(sweep.SweepError, match=r'--parallel=5 but this host has 4 GPU\(s\)'):
    sweep_processes.device_groups(5)
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
  monkeypatch.setattr(sweep_processes.shutil, 'which', lambda name: None)
  assert sweep_processes.device_groups(2) == [{}, {}]  # CPU only: the runs share the cores
  monkeypatch.setattr(sweep_processes.glob, 'glob',
                      lambda pattern: ['/dev/accel0'] if 'accel' in pattern else [])
  with pytest.raises(sweep.SweepError, match='--parallel=2 on a TPU host'):
    sweep_processes.device_groups(2)


def test_stopping_a_sweep_lets_each_run_save_and_kills_the_ones_that_do_not_stop(tmp_path):
  """What Ctrl-C on a grid sweep or a study does to its runs: SIGTERM, a grace period, then SIGKILL."""
  saves = textwrap.dedent('''
      import signal, sys, time
      signal.signal(signal.SIGTERM, lambda *_: (print('saved', flush=True), sys.exit(0)))
      print('training', flush=True)
      time.sleep(60)''')
  hangs = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "print('training', flush=True); time.sleep(60)")
  processes = {}
  for name, code in (('saves', saves), ('hangs', hangs)):
    (tmp_path / name).mkdir()
    log = open(tmp_path / name / runner.LOG_FILE, 'w')
    process = subprocess.Popen([sys.executable, '-c', code], stdout=log, stderr=subprocess.STDOUT)
    processes[name] = (process, log)
  deadline = time.monotonic() + 60
  while not all('training' in (tmp_path / name / runner.LOG_FILE).read_text() for name in processes):
    assert time.monotonic() < deadline
    time.sleep(0.05)
  started = time.monotonic()
  assert sweep_processes.stop_runs(str(tmp_path), '', processes, grace_s=2) == {'saves': 0, 'hangs': -9}
  assert time.monotonic() - started < 20
  assert (tmp_path / 'saves' / runner.LOG_FILE).read_text() == 'training\nsaved\n'
  assert all(log.closed for _, log in processes.values())
