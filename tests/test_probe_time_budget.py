"""An outside probe of a budgeted run resumed (issue 70): its plan file (WORKDIR/time_budget.json, the
length its checkpoints were trained for) cut off by a crash of the disk, edited, or missing a re-plan's
numbers. The resume stops in one line (a ConfigError: `error: ...`, exit 2) that names the file and what
to do, and the file stays as it was; a sound plan still resumes."""

import json

import pytest

from flaxtpu.loop import budget_probe, time_budget
from flaxtpu.settings import defaults
from flaxtpu.settings.errors import ConfigError

MEASURED = {'elapsed_s': 5.0, 'init_s': 0.5, 'compile_s': 1.0, 'eval_first_s': 0.7, 'eval_s': 0.2,
            'save_first_s': 0.15, 'save_s': 0.05, 'save_write_s': 0.1, 'end_s': 1.25, 'step_s': 0.004}


def _config():
  config = defaults.get_config()
  config.update_from_flattened_dict({'time_budget': '90s', 'batch_size': 32, 'schedule.name': 'cosine'})
  return config


def _never_probed():
  raise AssertionError('a resumed run keeps its plan: it is not probed again')


def _saved_plan(tmp_path) -> dict:
  plan = time_budget.solve(_config(), 1438, 90.0, MEASURED)
  plan['check'] = {**plan['check'], 'steps_before': plan['steps'] + 400}  # re-planned at its check
  (tmp_path / time_budget.PLAN_FILE).write_text(json.dumps(plan))
  return plan


def _resume(tmp_path):
  return time_budget.plan(_config(), str(tmp_path), 1438, resuming=True, started=0.0, probe=_never_probed)


def test_a_sound_plan_resumes_on_its_schedule(tmp_path):
  plan = _saved_plan(tmp_path)
  budget = _resume(tmp_path)
  assert budget.length.total_steps == plan['steps'] and budget.schedule is not None


CUT = 'it is cut off or edited: no planned number of steps'


@pytest.mark.parametrize('damage, reason', [
    (lambda text, plan: text[:len(text) // 2], CUT),
    (lambda text, plan: json.dumps({**plan, 'steps': None}), CUT),
    (lambda text, plan: json.dumps([plan]), CUT),
    (lambda text, plan: json.dumps({key: value for key, value in plan.items() if key != 'steps'}), CUT),
    (lambda text, plan: json.dumps({**plan, 'check': {'steps_before': 9000}}),
     'its re-plan lacks the step it was made at or the steps planned before it'),
])
def test_a_damaged_plan_stops_the_resume_in_one_line_and_stays(tmp_path, damage, reason):
  plan = _saved_plan(tmp_path)
  path = tmp_path / time_budget.PLAN_FILE
  path.write_text(damage(path.read_text(), plan))
  before = path.read_bytes()
  with pytest.raises(ConfigError) as raised:
    _resume(tmp_path)
  assert str(raised.value) == (
      f"config.time_budget='90s': {path} cannot be read back ({reason}); it holds the length the checkpoints "
      f'in {tmp_path} were trained for: restore it from a copy, or train afresh in another --workdir')
  assert '\n' not in str(raised.value) and path.read_bytes() == before


def test_a_missing_plan_still_says_the_run_had_no_budget(tmp_path):
  with pytest.raises(ConfigError, match=r'started without a budget \(time_budget.json is missing\)'):
    _resume(tmp_path)


def test_a_sigterm_during_the_probe_ends_its_timed_steps_and_skips_its_report():
  """The probe timed up to 1-3% of the budget in steps (minutes for a budget of hours) and the end's report
  before the run could stop: a preemption's grace ran out meanwhile."""
  clock, calls = [0.0], []

  def part(name, seconds):
    def run(*args):
      calls.append(name)
      clock[0] += seconds
    return run

  parts = budget_probe.Parts(init=part('init', 1), compile=part('compile', 1), step=part('step', 0.01),
                            wait=lambda: None, evaluate=part('evaluate', 0.1), save=part('save', 0.1),
                            written=lambda: None, report=part('report', 3))
  stop_after = 2 + 5  # two untimed warm steps, then five timed
  measured = budget_probe.timed(parts, 3600.0, 0.0, clock=lambda: clock[0],
                               stopping=lambda: calls.count('step') >= stop_after)
  assert measured['steps_timed'] == 5 and 'report' not in calls and measured['end_s'] == 0.0
  unstopped = budget_probe.timed(parts, 3600.0, 0.0, clock=lambda: clock[0])
  assert unstopped['steps_timed'] == budget_probe.PROBE_MAX_STEPS and calls[-1] == 'report'


def test_the_probe_asks_the_cli_s_stop_request():
  import os
  import signal

  from flaxtpu.loop import signals
  assert not signals.requested()
  with signals.StopRequest():
    assert not signals.requested()
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.requested()
  assert not signals.requested()
