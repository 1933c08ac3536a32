"""Two processes x 4 CPU devices over loopback (gloo) train like one process x 8 devices.

Both stream from disk (no cache), so each process reads and decodes only its own rows.
"""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, cli_env, restore_checkpoint

pytestmark = pytest.mark.multiprocess

ARGS = ['--config=configs/cifar10_resnet.py', '--config.batch_size=16', '--config.num_train_steps=4',
        '--config.log_every_steps=2', '--config.eval_every_steps=4', '--config.checkpoint_every_steps=4',
        '--config.compilation_cache_dir=none', '--config.schedule.warmup_epochs=0',
        '--config.dataset.cache=none', '--config.input.workers=1']


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env():
  return cli_env()


def test_two_processes_end_with_the_parameters_of_one(image_folder, tmp_path):
  single, multi = str(tmp_path / 'single'), str(tmp_path / 'multi')
  common = ARGS + [f'--config.dataset.folder={image_folder}']
  # The one process and the two at once (they share nothing but the image folder).
  single_log = open(tmp_path / 'single.log', 'w+')  # pylint: disable=consider-using-with
  one_process = subprocess.Popen([sys.executable, '-m', 'flaxtpu.main', *common, f'--workdir={single}',
                                  '--config.cpu_devices=8'],
                                 cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=single_log)
  port = _free_port()
  processes = [subprocess.Popen(
      [sys.executable, '-m', 'flaxtpu.main', *common, f'--workdir={multi}', '--config.cpu_devices=4',
       f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', f'--process_id={i}'],
      cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = [p.communicate(timeout=300) for p in processes]
  one_process.wait(timeout=300)
  single_log.seek(0)
  assert one_process.returncode == 0, single_log.read()[-3000:]
  single_log.close()
  for process, (_, stderr) in zip(processes, outputs):
    assert process.returncode == 0, stderr[-3000:]
  assert 'devices=8 (local 4) process=0/2' in outputs[0][1]
  assert 'process=1/2' in outputs[1][1]
  # Only process 0 writes logs and results.
  assert os.path.exists(os.path.join(multi, 'results.json'))
  assert len([f for f in os.listdir(multi) if f.startswith('events.out')]) == 1
  one, two = restore_checkpoint(single, 4), restore_checkpoint(multi, 4)
  assert int(one['step']) == int(two['step']) == 4
  # Tolerance: the same sums reduced in a different order across processes (float32).
  for x, y in zip(jax.tree.leaves(one['params']), jax.tree.leaves(two['params'])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
  for x, y in zip(jax.tree.leaves(one['batch_stats']), jax.tree.leaves(two['batch_stats'])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
