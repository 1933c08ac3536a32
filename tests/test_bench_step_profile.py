"""benchmarks/device/step_profile.py's report, on a trace laid out as a TPU's: the ops' device time per step,
per kind, with the FLOP/s and bytes/s XLA's counts give them; the module runs; host events left out."""

from benchmarks.device import step_profile


def tpu_trace() -> list[dict]:
  """Two steps on /device:TPU:0: a convolution fusion (1 ms, 100 GFLOP, 0.5 GB) and a loop fusion (0.25 ms,
  0.4 GB) each step, inside one 'XLA Modules' run per step; a host thread's event that is not an op."""
  meta = [{'ph': 'M', 'name': 'process_name', 'pid': 1, 'args': {'name': '/device:TPU:0'}},
          {'ph': 'M', 'name': 'thread_name', 'pid': 1, 'tid': 1, 'args': {'name': 'XLA Ops'}},
          {'ph': 'M', 'name': 'thread_name', 'pid': 1, 'tid': 2, 'args': {'name': 'XLA Modules'}},
          {'ph': 'M', 'name': 'process_name', 'pid': 2, 'args': {'name': '/host:CPU'}},
          {'ph': 'M', 'name': 'thread_name', 'pid': 2, 'tid': 1, 'args': {'name': 'python'}}]
  events = []
  for step in range(2):
    start = 10_000 * step
    events += [
        {'ph': 'X', 'pid': 1, 'tid': 2, 'ts': start, 'dur': 1_300, 'name': 'jit_train_step(123)'},
        {'ph': 'X', 'pid': 1, 'tid': 1, 'ts': start, 'dur': 1_000, 'name': 'convolution_fusion.1',
         'args': {'hlo_category': 'convolution fusion', 'model_flops': '100000000000',
                  'bytes_accessed': '500000000',
                  'long_name': '%convolution_fusion.1 = bf16[8,128] fusion(...)'}},
        {'ph': 'X', 'pid': 1, 'tid': 1, 'ts': start + 1_000, 'dur': 250, 'name': 'fusion.2',
         'args': {'hlo_category': 'loop fusion', 'model_flops': '0', 'bytes_accessed': '400000000'}},
        {'ph': 'X', 'pid': 2, 'tid': 1, 'ts': start, 'dur': 5_000, 'name': 'PjitFunction(train_step)'},
    ]
  return meta + events


def test_a_tpu_trace_is_reported_per_step_per_kind_with_its_rates(capsys):
  step_profile.report(tpu_trace(), steps=2, wall_seconds=0.003, top=5)
  out = capsys.readouterr().out
  assert 'device ops: 2.5 ms over 2 steps = 1.25 ms a step; wall 1.50 ms a step' in out
  assert '2 module runs (jit_train_step(123)): 1.30 ms each' in out
  # 100 GFLOP in 1 ms = 100 TFLOP/s; 0.5 GB in 1 ms = 500 GB/s; 200 FLOPs a byte.
  assert '    1.00 ms  80.0%   100.0 TF/s    500 GB/s    200 F/B     1  convolution fusion' in out
  assert '    0.25 ms  20.0%     0.0 TF/s   1600 GB/s      0 F/B     1  loop fusion' in out
  assert '%convolution_fusion.1 = bf16[8,128] fusion(...)' in out
  assert 'PjitFunction' not in out


def test_overrides_are_typed_as_the_config_keys_expect():
  assert step_profile.parse_override('space_to_depth=true') == ('space_to_depth', True)
  assert step_profile.parse_override('patch_size=8') == ('patch_size', 8)
  assert step_profile.parse_override('drop_path=0.1') == ('drop_path', 0.1)
  assert step_profile.parse_override('gelu=tanh') == ('gelu', 'tanh')
