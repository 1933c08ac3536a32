"""Run I/O: what a run reads and leaves behind: atomic files, object stores, the workdir lock,
TensorBoard events, the metric writers and MLflow tracking.

- `files`: atomic JSON, JSONL and CSV files, durations; a failed write as one line.
- `storage`: object stores (`gs://`, `s3://`) as workdirs and data; the storage emulator.
- `network`: whether a host is reachable, asked before a library retries for minutes.
- `lock`: one live trainer per workdir (and one sweep per sweep directory).
- `events`: TensorBoard event files, written without TensorFlow.
- `metrics`: the clu metric collections the steps accumulate.
- `writers`: where metrics go (TensorBoard, metrics.jsonl, W&B, MLflow).
- `tracking`: which MLflow run a workdir or a sweep logs to, and its artifacts.

Nothing is imported here: `import flaxtpu.io.<module>` loads that module and what it imports, no
more.
"""
