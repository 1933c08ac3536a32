"""Every command in README.md, DEVELOPING.md and docs/*.md still works as written, checked without training.

The commands are the lines of the pages' code blocks that start with `python -m
flaxtpu...`, `python -m benchmarks...`, `make ...` or `pip install ...` (with
their backslash continuations). `flaxtpu.main` commands go through main's own
flags and config-file parser and flaxtpu's config validation; sweeps through
the sweep CLI's parser and override check; benchmarks must exist and take the
flags given; make targets must be in the Makefile; extras in pyproject.toml.
Links to local files (and their #anchors) must resolve.
"""

import copy
import functools
import pathlib
import re
import shlex
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from flaxtpu.main import RESTORING_MODES  # modes whose --config defaults to the run's

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', ROOT / 'DEVELOPING.md', *sorted((ROOT / 'docs').glob('*.md'))]
COMMAND_START = re.compile(r'(\w+=\S+\s+)*(python -m (flaxtpu|benchmarks)\b|make\b|pip install\b)')
REPO_PATH = re.compile(r'^(configs|experiments|benchmarks|flaxtpu|tests|docs)/[\w./-]*$')


def commands_in(text: str) -> list[str]:
  """The commands of a page's code blocks (indented or fenced), continuations joined."""
  commands, lines, fenced, index = [], text.splitlines(), False, 0
  while index < len(lines):
    line = lines[index]
    if line.lstrip().startswith('```'):
      fenced = not fenced
    elif (fenced or line.startswith('    ')) and COMMAND_START.match(line.strip()):
      command = line.strip()
      while command.endswith('\\') and index + 1 < len(lines):
        index += 1
        command = command[:-1] + ' ' + lines[index].strip()
      commands.append(command)
    index += 1
  return commands


def page_commands():
  return [pytest.param(command, id=f'{page.name}:{command[:60]}')
          for page in PAGES for command in commands_in(page.read_text())]


def tokens_of(command: str) -> list[str]:
  """The command's words without its comment and without leading VAR=VALUE settings."""
  words = shlex.split(command, comments=True)
  while words and re.match(r'^\w+=', words[0]):
    words.pop(0)
  return words


def parse_main(argv: list[str]):
  """flaxtpu.main's flags and config parser on a fresh copy of its flags; returns the config."""
  from flaxtpu import main as main_lib  # pylint: disable=g-import-not-at-top
  config_path = main_lib._flag_value(argv, 'config')  # pylint: disable=protected-access
  if config_path is None:
    # eval/predict/export without --config read the run's config.json, which has every key of defaults.py.
    mode = main_lib._flag_value(argv, 'mode')  # pylint: disable=protected-access
    assert mode in RESTORING_MODES, f'{argv}: --config is missing'
    config_path = str(ROOT / 'flaxtpu' / 'settings' / 'defaults.py')
    argv = [argv[0], f'--config={config_path}', *argv[1:]]
  assert (ROOT / config_path.split(':', 1)[0]).is_file(), f'--config={config_path} does not exist'
  argv = [re.sub(r'^--config=(?!/)', f'--config={ROOT}/', arg) for arg in argv]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, '', flag_values=flag_values, lock_config=True,
                                  sys_argv=argv)
  flag_values['config'].parser = main_lib.ConfigFileParser()
  for flag in main_lib.FLAGS.flags_by_module_dict()['flaxtpu.main']:
    if flag.name != 'config':
      flag_values[flag.name] = copy.deepcopy(flag)
  flag_values(argv)
  return flag_values.config


def check_main(words: list[str]) -> None:
  from flaxtpu.validation import config as config_lib  # pylint: disable=g-import-not-at-top
  argv = ['flaxtpu.main', *words[3:]]
  if str(ROOT) not in sys.path:  # experiments import recipes (`from configs import ...`)
    sys.path.insert(0, str(ROOT))
  # Values that cannot work (a model name, a remat policy) fail here as they would at start-up.
  config_lib.validate(parse_main(argv))


def check_sweep(words: list[str]) -> None:
  from flaxtpu.sweep import __main__ as sweep_cli  # pylint: disable=g-import-not-at-top
  from flaxtpu.sweep import runner  # pylint: disable=g-import-not-at-top
  from flaxtpu.sweep import study as studies  # pylint: disable=g-import-not-at-top
  args, config_args = sweep_cli._parse_args(words[3:])  # pylint: disable=protected-access
  assert (ROOT / args.experiment).is_file(), f'{args.experiment} does not exist'
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  if callable(getattr(runner.import_experiment(str(ROOT / args.experiment), ('get_config',)), 'get_sweep',
                      None)):
    config, runs_overrides = runner.load_experiment(str(ROOT / args.experiment))
    swept_keys = {key for overrides in runs_overrides for key in overrides}
  else:  # a study (--trials=N): its keys are drawn by get_search
    config, _ = studies.load_search(str(ROOT / args.experiment))
    swept_keys = set()
  runner.parse_extra_overrides(config, config_args, swept_keys)


def check_benchmark(words: list[str]) -> None:
  module = words[2]
  path = ROOT / (module.replace('.', '/') + '.py')
  assert path.is_file(), f'python -m {module}: {path.relative_to(ROOT)} does not exist'
  harness = ROOT / 'benchmarks' / 'shared' / 'harness.py'
  source = path.read_text() + harness.read_text()  # harness adds --out
  for word in words[3:]:
    if word.startswith('--'):
      name = word.split('=', 1)[0]
      assert f"'{name}'" in source, f'python -m {module} takes no {name}'


@functools.cache
def make_targets() -> set[str]:
  return set(re.findall(r'^([\w-]+):', (ROOT / 'Makefile').read_text(), re.M))


def check_make(words: list[str]) -> None:
  for word in words[1:]:
    if '=' not in word and not word.startswith('-'):
      assert word in make_targets(), f'make {word}: no such target in the Makefile'


def check_pip(words: list[str]) -> None:
  # Python 3.10 has no tomllib: the extras are the `name = [` lines of their table.
  table = ((ROOT / 'pyproject.toml').read_text()
           .split('[project.optional-dependencies]', 1)[1].split('\n[', 1)[0])
  extras = set(re.findall(r'^([\w-]+)\s*=', table, re.M))
  for word in words[2:]:
    for names in re.findall(r'\[([\w,-]+)\]', word):
      for name in names.split(','):
        assert name in extras, f'{word}: pyproject.toml has no extra {name!r}'


def check_average(words: list[str]) -> None:
  """flaxtpu.average's own flags parse, and at least one run is named."""
  from flaxtpu import average
  runs = copy.deepcopy(average.FLAGS)(['average', *words[3:]])[1:]
  assert runs and not any(run.startswith('-') for run in runs), f'{words}: name the runs to average'


@pytest.mark.parametrize('command', page_commands())
def test_command_works_as_written(command):
  words = tokens_of(command)
  while words and re.fullmatch(r'[A-Z_]+=\S*', words[0]):  # VAR=value before the command
    words = words[1:]
  for word in words:
    value = word.split('=', 1)[1] if word.startswith('--') and '=' in word else word
    value = value.split(':', 1)[0]
    if REPO_PATH.match(value):
      assert (ROOT / value).exists(), f'{command}: {value} does not exist'
  if words[:3] == ['python', '-m', 'flaxtpu.main']:
    check_main(words)
  elif words[:3] == ['python', '-m', 'flaxtpu.sweep']:
    check_sweep(words)
  elif words[:2] == ['python', '-m'] and words[2].startswith('benchmarks.'):
    check_benchmark(words)
  elif words[:3] == ['python', '-m', 'flaxtpu.average']:
    check_average(words)
  elif words[:3] == ['python', '-m', 'flaxtpu.report']:
    assert len(words) == 4 and not words[3].startswith('-'), f'{command}: flaxtpu.report takes one workdir'
  elif words[0] == 'make':
    check_make(words)
  elif words[:2] == ['pip', 'install']:
    check_pip(words)
  else:
    pytest.fail(f'no check for {command}')


def test_readme_keeps_its_commands():
  """The extraction finds the README's commands (an empty list would pass everything)."""
  commands = commands_in((ROOT / 'README.md').read_text())
  assert 'make test' in commands[1] and 'make train' in commands[0]
  assert sum(c.startswith('python -m flaxtpu.main') for c in commands) >= 10
  assert sum(c.startswith('python -m flaxtpu.sweep') for c in commands) >= 3
  assert "pip install -e '.[test]'" in ' '.join(commands)
  assert re.search(r'^## Test\n\n    make test  .*$', (ROOT / 'README.md').read_text(), re.M)


def test_named_modules_exist():
  """`python -m X` anywhere in the pages, prose included, names a module that exists."""
  for page in PAGES:
    for module in re.findall(r'python -m ((?:flaxtpu|benchmarks)(?:\.\w+)*)', page.read_text()):
      path = ROOT / module.replace('.', '/')
      assert path.with_suffix('.py').is_file() or (path / '__main__.py').is_file(), f'{page.name}: {module}'


def anchors(page: pathlib.Path) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
  headings = re.findall(r'^#+\s+(.*)$', page.read_text(), re.M)
  return {re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-') for heading in headings}


def test_local_links_resolve():
  for page in PAGES:
    text = re.sub(r'^    .*$', '', page.read_text(), flags=re.M)  # code blocks hold no links
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
      if re.match(r'^[a-z]+:', target):
        continue
      path, _, anchor = target.partition('#')
      resolved = (page.parent / path).resolve() if path else page
      assert resolved.exists(), f'{page.relative_to(ROOT)}: link {target} does not resolve'
      if anchor and resolved.suffix == '.md':
        assert anchor in anchors(resolved), f'{page.relative_to(ROOT)}: link {target}: no such heading'
