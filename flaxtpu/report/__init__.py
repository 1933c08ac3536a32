"""What the model learned and where the time went: per-class metrics, confusions, calibration and curves.

JAX-free (numpy, and matplotlib only when a picture is drawn), so `python -m flaxtpu.report WORKDIR`
plots a live or finished run's curves without starting JAX:

    python -m flaxtpu.report runs/cifar10        # writes runs/cifar10/curves.png and prints its path

One job per module:

- `metrics`: the numbers (numpy only): per-class precision/recall, top-5 and balanced accuracy, ECE;
  multilabel average precision (sklearn's), mAP macro and micro, best-F1 thresholds, exact match.
- `tables`: per_class.csv and thresholds.json.
- `plots`: every picture, one function each, and `PICTURES`, the list an evaluation draws;
  `write_curves` (curves.png from metrics.jsonl).
- `writer`: `write_eval_report`, an evaluation's files next to eval.json.
- `__main__`: the command line.

Nothing is imported here, so `import flaxtpu.report.metrics` stays as light as numpy.

Also here: `calibration.py`: WORKDIR/calibration.json: the temperature and prediction-set threshold
(scipy).
"""
