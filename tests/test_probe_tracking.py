"""An outside probe of MLflow tracking (issue 70): a tracker that answers while the workdir cannot keep
the run's id (a folder in place of mlflow_run.json). The tracker never stops training: one warning, and
the folder is left as it was (it was IsADirectoryError and its traceback, out of the trainer)."""

import logging
import os

from flaxtpu.io import tracking


def test_a_run_id_that_cannot_be_kept_is_one_warning_and_training_goes_on(tmp_path, caplog):
  (tmp_path / tracking.RUN_FILE / 'kept').mkdir(parents=True)
  tracker = tracking.Tracker('http://tracker.invalid:5000', 'probe')
  tracker.call = lambda what, function: 'run-7'  # a tracker that answers
  with caplog.at_level(logging.WARNING):
    assert tracking.open_run(tracker, str(tmp_path)) == ('run-7', False)
  assert [record.getMessage() for record in caplog.records] == [
      f"mlflow: cannot keep the run's id in {tmp_path}/{tracking.RUN_FILE} (Is a directory); training goes "
      'on, and a resumed run starts another MLflow run']
  assert os.listdir(tmp_path / tracking.RUN_FILE) == ['kept']
