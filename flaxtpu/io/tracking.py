"""MLflow tracking (config.mlflow.tracking_uri): which MLflow run a workdir logs to, and its end.

The metric writer itself (`writers.MlflowWriter`) sits beside TensorBoard's and
W&B's; this module holds what it shares with the sweep command, and no JAX:

- One MLflow run per workdir, its id kept in WORKDIR/mlflow_run.json, so a
  resumed run continues the same MLflow run.
- A sweep or study is a parent run (DIR/mlflow_run.json); its runs are its
  children, told their parent by the FLAXTPU_MLFLOW_PARENT environment variable
  (so a run's command line stays the one that reproduces it).
- At the end: results.json, per_class.csv, the report pictures and report.html
  as artifacts.

A tracker that is down or refuses never stops or slows training: its first
failure is one warning line, then nothing more is sent and the run logs locally
(TensorBoard, metrics.jsonl) as always.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from flaxtpu.io import files

TRACKER_NAMES = {'wandb': 'Weights & Biases', 'mlflow': 'MLflow', 'optuna': 'Optuna'}

RUN_FILE = 'mlflow_run.json'
PARENT_ENV = 'FLAXTPU_MLFLOW_PARENT'
MAX_PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch
MAX_PARAM_LENGTH = 6000  # MLflow's limit for one parameter's value
ARTIFACTS = ('results.json', 'per_class*.csv', '*.png', 'report.html')


class Tracker:
  """An MLflow client that, at its first failure, warns once and stops sending."""

  def __init__(self, tracking_uri: str, experiment: str):
    # Fail fast: MLflow would retry a refused connection for minutes, the training loop waiting.
    os.environ.setdefault('MLFLOW_HTTP_REQUEST_MAX_RETRIES', '0')
    os.environ.setdefault('MLFLOW_HTTP_REQUEST_TIMEOUT', '10')
    self.uri, self.experiment = tracking_uri, experiment
    self.broken = False
    self._client = None

  def call(self, what: str, function: Callable[[Any], Any]) -> Any:
    """`function(client)`, or None once the tracker has failed."""
    if self.broken:
      return None
    try:
      if self._client is None:
        from mlflow import MlflowClient  # pylint: disable=g-import-not-at-top
        self._client = MlflowClient(tracking_uri=self.uri)
      return function(self._client)
    except Exception as error:  # the server is down, refuses, or times out: never the run's problem
      self.broken = True
      message = str(error).strip().splitlines()[0] if str(error).strip() else ''
      logging.warning('mlflow: %s at %s failed (%s: %s); training goes on, logged locally only',
                      what, self.uri, type(error).__name__, message[:200])
      return None


_TRACKERS: dict[tuple[str, str], Tracker] = {}


def tracker(tracking_uri: str, experiment: str) -> Tracker:
  """One tracker per server in a process: a server that failed once is not asked again."""
  return _TRACKERS.setdefault((tracking_uri, experiment), Tracker(tracking_uri, experiment))


def _experiment_id(client, name: str) -> str:
  experiment = client.get_experiment_by_name(name)
  if experiment is not None:
    return experiment.experiment_id
  try:
    return client.create_experiment(name)
  except Exception:  # created meanwhile by a parallel run
    return client.get_experiment_by_name(name).experiment_id


def open_run(tracking: Tracker, workdir: str, parent: str = '') -> tuple[Optional[str], bool]:
  """(run id, resumed): the run recorded in WORKDIR/mlflow_run.json, set running again, else a new one
  (a child of `parent` where given). (None, False) where the tracker failed."""
  path = os.path.join(workdir, RUN_FILE)
  saved = files.read_json(path) or {}
  if saved.get('run_id') and saved.get('tracking_uri') == tracking.uri:
    run_id = saved['run_id']
    tracking.call('resuming its run', lambda client: client.update_run(run_id, status='RUNNING'))
    return run_id, True
  name = os.path.basename(os.path.abspath(workdir).rstrip('/'))

  def create(client) -> str:
    tags = {'mlflow.parentRunId': parent} if parent else {}
    return client.create_run(_experiment_id(client, tracking.experiment), run_name=name,
                             tags=tags).info.run_id

  run_id = tracking.call('starting a run', create)
  if run_id:
    try:
      files.write_json(path, {'tracking_uri': tracking.uri, 'experiment': tracking.experiment,
                              'run_id': run_id, 'parent_run_id': parent})
    except OSError as error:  # a folder in its place, a full disk: the record, not the run, is lost
      logging.warning('mlflow: cannot keep the run\'s id in %s (%s); training goes on, and a resumed run '
                      'starts another MLflow run', path, error.strerror or error)
  return run_id, False


def log_params(tracking: Tracker, run_id: str, params: Mapping[str, Any]) -> None:
  """The config's flattened keys as parameters, in batches MLflow takes."""
  if tracking.broken:
    return
  from mlflow.entities import Param  # pylint: disable=g-import-not-at-top
  items = [Param(key, str(value)[:MAX_PARAM_LENGTH]) for key, value in params.items()]
  for start in range(0, len(items), MAX_PARAMS_PER_CALL):
    batch = items[start:start + MAX_PARAMS_PER_CALL]
    tracking.call('logging the config', lambda client, batch=batch: client.log_batch(run_id, params=batch))


def log_metrics(tracking: Tracker, run_id: str, step: int, scalars: Mapping[str, float],
                timestamp_ms: int) -> None:
  if tracking.broken:
    return
  from mlflow.entities import Metric  # pylint: disable=g-import-not-at-top
  metrics = [Metric(key, float(value), timestamp_ms, int(step)) for key, value in scalars.items()]
  tracking.call('logging metrics', lambda client: client.log_batch(run_id, metrics=metrics))


def end_run(tracking: Tracker, run_id: str, status: str) -> None:
  tracking.call('ending its run', lambda client: client.set_terminated(run_id, status))


def log_results(config, workdir: str, results: Mapping[str, Any]) -> None:
  """A finished run's artifacts (results, per-class table, pictures, report.html) and its end."""
  if not config.mlflow.tracking_uri:
    return
  tracking = tracker(config.mlflow.tracking_uri, config.mlflow.experiment)
  run_id = (files.read_json(os.path.join(workdir, RUN_FILE)) or {}).get('run_id')
  if not run_id:
    return
  if results.get('pruned'):
    tracking.call('tagging it pruned', lambda client: client.set_tag(run_id, 'pruned', 'true'))
  for pattern in ARTIFACTS:
    for path in sorted(glob.glob(os.path.join(workdir, pattern))):
      tracking.call(f'uploading {os.path.basename(path)}', lambda client, path=path: client.log_artifact(
          run_id, path))
  end_run(tracking, run_id, 'FINISHED')


# --- sweeps and studies: the parent run ------------------------------------------------


def configured_uri(config, extra_overrides: Sequence[str]) -> tuple[str, str]:
  """(tracking URI, experiment) of a sweep's runs: the experiment's config, then --config.mlflow.*."""
  values = {'tracking_uri': config.mlflow.tracking_uri, 'experiment': config.mlflow.experiment}
  for arg in extra_overrides:
    key, _, value = arg[len('--config.'):].partition('=')
    if key in ('mlflow.tracking_uri', 'mlflow.experiment'):
      values[key.split('.')[1]] = value
  return values['tracking_uri'], values['experiment']


def parent_environment(config, extra_overrides: Sequence[str], workdir: str) -> dict[str, str]:
  """The environment that makes a sweep's runs children of its parent run (DIR/mlflow_run.json);
  {} without MLflow or where the tracker fails (the runs then log as runs of their own)."""
  uri, experiment = configured_uri(config, extra_overrides)
  if not uri:
    return {}
  run_id, _ = open_run(tracker(uri, experiment), workdir)
  return {PARENT_ENV: run_id} if run_id else {}


def end_parent(config, extra_overrides: Sequence[str], workdir: str, summary: Mapping[str, Any]) -> None:
  """The parent run's summary (a study's best value and parameters, as `best.*` parameters) and its end."""
  uri, experiment = configured_uri(config, extra_overrides)
  run_id = (files.read_json(os.path.join(workdir, RUN_FILE)) or {}).get('run_id')
  if not uri or not run_id:
    return
  tracking = tracker(uri, experiment)
  for key, value in summary.items():
    tracking.call('logging the summary', lambda client, key=key, value=value: client.set_tag(
        run_id, key, str(value)))
  end_run(tracking, run_id, 'FINISHED')


def check_config(config) -> None:
  """config.wandb, config.mlflow and config.search: a tracker or a study asked for is installed."""
  from flaxtpu.settings.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if config.wandb.mode not in ('online', 'offline'):
    raise ConfigError(f'config.wandb.mode={config.wandb.mode!r} is not valid; choose one of: \'online\', '
                      "'offline'")
  for key, value, module, extra in (('wandb.project', config.wandb.project, 'wandb', 'wandb'),
                                    ('mlflow.tracking_uri', config.mlflow.tracking_uri, 'mlflow', 'mlflow'),
                                    ('search.storage', config.search.storage, 'optuna', 'search')):
    if value and importlib.util.find_spec(module) is None:
      raise ConfigError(f'config.{key}={value!r} needs {TRACKER_NAMES[module]}: '
                        f"pip install 'flaxtpu[{extra}]' (or leave {key} empty)")
