"""benchmarks/accuracy/precision.py's summary: means and spread per dtype, and the gap between them."""

import pytest

from benchmarks.accuracy import precision


def test_summary_gives_each_dtypes_mean_spread_and_the_gap():
  runs = {'float32': [{'eval_accuracy': 0.70}, {'eval_accuracy': 0.72}, {'eval_accuracy': 0.74}],
          'bfloat16': [{'eval_accuracy': 0.71}, {'eval_accuracy': 0.71}, {'eval_accuracy': 0.74}]}
  summary = precision.summarise(runs)
  assert summary['float32']['mean'] == pytest.approx(0.72)
  assert summary['float32']['stdev'] == pytest.approx(0.02)
  assert summary['bfloat16']['mean'] == pytest.approx(0.72)
  assert summary['bfloat16']['stdev'] == pytest.approx(0.017320508)
  assert summary['bfloat16_minus_float32'] == pytest.approx(0.0, abs=1e-12)
  assert summary['seed_stdev'] == pytest.approx(0.02)


def test_one_dtype_alone_has_no_gap():
  summary = precision.summarise({'bfloat16': [{'eval_accuracy': 0.5}]})
  assert summary == {'bfloat16': {'accuracies': [0.5], 'mean': 0.5, 'stdev': 0.0}}
