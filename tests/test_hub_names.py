"""Hub-style weight names: one line for a malformed, unknown or unreachable name (issue 52 part 3).

`init_from.checkpoint` and `distill.teacher` read `hf-hub:ORG/NAME` (and local files or flaxtpu runs);
`export.hub_repo` names ORG/NAME. Malformed names are huggingface_hub's validate_repo_id's call and are
asserted exactly; unknown and gated repositories come from a fake hub on loopback (HF_ENDPOINT), offline
from HF_HUB_OFFLINE=1: this machine has no network to the hub, and the tests need none.
"""

import http.server
import os
import subprocess
import sys
import threading

import pytest

from flaxtpu.settings import defaults, hub_names
from flaxtpu.settings.errors import ConfigError, UserError
from flaxtpu.validation import config as config_lib
from flaxtpu.validation import resolution

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = 'write hf-hub:ORG/NAME as huggingface.co shows it, e.g. hf-hub:timm/resnet50.a1_in1k'

ONLY = '(the hub allows letters, digits, -, _ and . only)'
EDGES = '(hub names start and end with a letter, digit or _)'
MALFORMED = [
    ('hf-hub:', 'it is empty'),
    ('hf-hub:resnet50', 'it has no ORG/ before the name'),
    ('hf-hub:timm/resnet50/extra', 'it has 2 slashes, not one'),
    ('hf-hub:/resnet50', 'its ORG is empty'),
    ('hf-hub:timm/', 'its NAME is empty'),
    ('hf-hub:timm/res net50', f"its NAME 'res net50' has ' ' {ONLY}"),
    ('hf-hub:timm/resnet50@main', f"its NAME 'resnet50@main' has '@' {ONLY}"),
    ('hf-hub:timm/resnet50\n', f"its NAME 'resnet50\\n' has '\\n' {ONLY}"),
    ('hf-hub:timm/..resnet50', f"its NAME '..resnet50' starts with '.' {EDGES}"),
    ('hf-hub:timm-/resnet50', f"its ORG 'timm-' ends with '-' {EDGES}"),
    ('hf-hub:timm/resnet..50', "its NAME 'resnet..50' has '..' (the hub forbids -- and ..)"),
    ('hf-hub:timm/resnet--50', "its NAME 'resnet--50' has '--' (the hub forbids -- and ..)"),
    ('hf-hub:timm/' + 'r' * 97, 'its NAME is 97 characters long (the hub allows at most 96)'),
    ('hf-hub:timm/resnet50.git', 'it ends in .git (name the model without it)'),
]


def shown(spec: str) -> str:
  return spec.replace('\n', '\\n')


@pytest.mark.parametrize('spec, problem', MALFORMED)
@pytest.mark.parametrize('key', ['init_from.checkpoint', 'distill.teacher'])
def test_a_malformed_hub_name_is_one_line_naming_the_rule_and_the_fix(key, spec, problem):
  config = defaults.get_config()
  config[key.split('.')[0]][key.split('.')[1]] = spec
  with pytest.raises(ConfigError) as raised:
    config_lib.validate(config)
  assert str(raised.value) == f"config.{key}='{shown(spec)}' is not a hub model name: {problem}; {FIX}"


def test_a_valid_name_passes_as_huggingface_hub_validates_it():
  from huggingface_hub.utils import validate_repo_id  # pylint: disable=g-import-not-at-top
  for repo in ('timm/resnet50.a1_in1k', 'my-org/cifar10_resnet20', 'A/' + 'b' * 96):
    validate_repo_id(repo)
    assert hub_names.repo_problem(repo) is None
    hub_names.check_spec('init_from.checkpoint', f'hf-hub:{repo}')


@pytest.mark.parametrize('spec', ['hf_hub:timm/resnet50.a1_in1k', 'hf://timm/resnet50.a1_in1k',
                                  'hf://models/timm/resnet50.a1_in1k', 'hub:timm/resnet50.a1_in1k',
                                  'https://huggingface.co/timm/resnet50.a1_in1k',
                                  'https://huggingface.co/timm/resnet50.a1_in1k/tree/main'])
def test_a_hub_name_written_another_way_names_the_spelling_flaxtpu_reads(spec):
  config = defaults.get_config()
  config.init_from.checkpoint = spec
  with pytest.raises(ConfigError) as raised:
    config_lib.validate(config)
  assert str(raised.value) == (f"config.init_from.checkpoint='{spec}': hub models are written "
                               'hf-hub:ORG/NAME; use init_from.checkpoint=hf-hub:timm/resnet50.a1_in1k')
  # Resolution reads the source before validation: it says the same.
  with pytest.raises(UserError, match='use init_from.checkpoint=hf-hub:timm/resnet50.a1_in1k'):
    resolution.source_location(config)


def test_a_bare_org_name_that_is_no_run_here_suggests_the_hub_spelling(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = defaults.get_config()
  config.init_from.checkpoint = 'timm/resnet50.a1_in1k'
  with pytest.raises(UserError) as raised:
    resolution.source_location(config)
  assert str(raised.value) == (
      "config.init_from.checkpoint='timm/resnet50.a1_in1k' holds no flaxtpu checkpoint; point it at the "
      '--workdir of a finished run (or its WORKDIR/checkpoints/STEP) (or, for the hub model '
      'timm/resnet50.a1_in1k, write hf-hub:timm/resnet50.a1_in1k)')
  (tmp_path / 'timm' / 'resnet50.a1_in1k').mkdir(parents=True)  # a folder of that name: no hub hint
  with pytest.raises(UserError) as raised:
    resolution.source_location(config)
  assert 'hf-hub:' not in str(raised.value)


@pytest.mark.parametrize('repo, problem', [
    ('my-org', 'it has no ORG/ before the name'),
    ('my-org/cifar10 resnet', f"its NAME 'cifar10 resnet' has ' ' {ONLY}"),
    ('my-org/cifar10--resnet', "its NAME 'cifar10--resnet' has '--' (the hub forbids -- and ..)"),
    ('my-org/cifar10.', f"its NAME 'cifar10.' ends with '.' {EDGES}"),
])
def test_a_malformed_export_hub_repo_is_one_line(repo, problem):
  config = defaults.get_config()
  config.export.hub_repo = repo
  with pytest.raises(ConfigError) as raised:
    config_lib.validate(config)
  assert str(raised.value) == (f"config.export.hub_repo='{repo}' is not a hub repository name: {problem}; "
                               'give ORG/NAME, e.g. my-org/cifar10-resnet20')


def test_a_teacher_that_cannot_be_read_is_named_before_the_run_starts(tmp_path):
  config = defaults.get_config()
  config.distill.teacher = str(tmp_path / 'no_run')
  with pytest.raises(UserError) as raised:
    resolution.resolve(config, str(tmp_path / 'student'), 'train')
  assert str(raised.value) == (
      f"config.distill.teacher='{tmp_path / 'no_run'}' holds no flaxtpu checkpoint; point it at the "
      '--workdir of a finished run (or its WORKDIR/checkpoints/STEP)')
  assert not (tmp_path / 'student').exists()


# --- the command line: unknown, gated, offline -----------------------------------------------------


class FakeHub(http.server.BaseHTTPRequestHandler):
  """Answers every request as the hub answers for a repository it refuses (401 RepoNotFound: unknown or
  private) or a gated one (403 GatedRepo), by the path's organisation."""

  def _answer(self):
    gated = self.path.startswith('/gated/')
    self.send_response(403 if gated else 401)
    self.send_header('X-Error-Code', 'GatedRepo' if gated else 'RepoNotFound')
    self.send_header('Content-Length', '0')
    self.end_headers()

  do_HEAD = do_GET = _answer

  def log_message(self, *args):
    del args


@pytest.fixture(scope='module')
def fake_hub():
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), FakeHub)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f'http://127.0.0.1:{server.server_address[1]}'
  server.shutdown()


def train(tmp_path, *overrides, env=None) -> subprocess.CompletedProcess:
  environment = {**os.environ, 'HF_HOME': str(tmp_path / 'hf'), **(env or {})}
  return subprocess.run([sys.executable, '-m', 'flaxtpu.main', '--config=configs/digits.py',
                         f'--workdir={tmp_path / "run"}', *overrides], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=environment)


def assert_one_line(result: subprocess.CompletedProcess, expected: str, tmp_path) -> None:
  """Exit status 2 and stderr exactly the one `error:` line, before the workdir is made."""
  assert (result.returncode, result.stderr) == (2, f'error: {expected}\n'), result.stderr[-3000:]
  assert not (tmp_path / 'run').exists()


def test_malformed_names_stop_the_command_in_one_line(tmp_path):
  spec = 'hf-hub:timm/res net50'
  assert_one_line(train(tmp_path, f'--config.init_from.checkpoint={spec}'),
                  f"config.init_from.checkpoint='{spec}' is not a hub model name: its NAME 'res net50' has "
                  f"' ' {ONLY}; {FIX}", tmp_path)
  assert_one_line(train(tmp_path, '--config.distill.teacher=hf_hub:timm/resnet18.a1_in1k'),
                  "config.distill.teacher='hf_hub:timm/resnet18.a1_in1k': hub models are written "
                  'hf-hub:ORG/NAME; use distill.teacher=hf-hub:timm/resnet18.a1_in1k', tmp_path)


def test_an_unknown_or_gated_repository_is_one_line(tmp_path, fake_hub):
  env = {'HF_ENDPOINT': fake_hub, 'HF_HUB_OFFLINE': '0'}
  assert_one_line(train(tmp_path, '--config.init_from.checkpoint=hf-hub:timm/no_such_model', env=env),
                  "config.init_from.checkpoint='hf-hub:timm/no_such_model': the hub has no model "
                  "'timm/no_such_model' (or it is private: log in with `hf auth login`); check the name on "
                  'huggingface.co', tmp_path)
  assert_one_line(train(tmp_path, '--config.distill.teacher=hf-hub:gated/model', env=env),
                  "config.distill.teacher='hf-hub:gated/model' is gated: accept its terms on huggingface.co "
                  'and log in with `hf auth login`', tmp_path)


def test_a_name_not_cached_offline_is_one_line(tmp_path):
  cache = tmp_path / 'hf' / 'hub'
  for key in ('init_from.checkpoint', 'distill.teacher'):
    result = train(tmp_path, f'--config.{key}=hf-hub:timm/resnet18.a1_in1k', env={'HF_HUB_OFFLINE': '1'})
    assert_one_line(result,
                    f"config.{key}='hf-hub:timm/resnet18.a1_in1k' is not in the Hugging Face cache ({cache}) "
                    'and the hub cannot be reached (HF_HUB_OFFLINE is set): on a machine online run '
                    '`hf download timm/resnet18.a1_in1k` and copy its cache folder '
                    f'models--timm--resnet18.a1_in1k into {cache} (or set HF_HOME to where it is)', tmp_path)
