"""Model evaluation: the in-training evaluation, Grad-CAM explanations, few-shot probes.

- `evaluate`: the in-training evaluation (every example scored once) and the end-of-run report.
- `explain`: Grad-CAM heatmaps and their overlays.
- `fewshot`: few-shot linear probes of a frozen backbone's features.

Nothing is imported here: `import flaxtpu.evaluation.<module>` loads that module and what it
imports, no more.
"""
