"""The modes that read a trained run, one file each (`--mode=...` in main.py).

- `eval`: score a checkpoint on a split -> eval.json, per_class.csv and the pictures.
- `predict`: classes or tags of images -> stdout and predict.output_csv.
- `calibrate`: a temperature and a prediction-set threshold -> WORKDIR/calibration.json (restore applies it).
- `thresholds`: the per-tag thresholds predict and the export apply, from an evaluation's thresholds*.json.
- `restore`: the checkpoint's model on these devices, parameters only (every mode starts here).

The in-training evaluation (also the end-of-run report) is `flaxtpu.evaluation.evaluate`; `--mode=export` is
`flaxtpu.exporters.export`. A new mode is a new file here with its line in main.py's dispatch.

Also here: `soup.py`: `python -m flaxtpu.average`'s arrays side: ingredients restored, averaged,
scored; `audit_folds.py`: out-of-fold probabilities for the audit's mislabel search (fold runs), and
`audit_features.py` its linear probes on frozen features.
"""
