"""Export formats: --mode=export: SavedModel, TFLite, ONNX, timm folder, model card, hub upload;
each checked before it lands.

- `export`: `--mode=export`: SavedModel, TFLite, timm folder, each checked against predict.
- `onnx_export`: `model.onnx`, through jax2onnx.
- `tflite_export`: the TFLite models (float32, fp16, int8), each scored on the eval split.
- `model_card`: the model cards (`export/README.md`, `export/timm/README.md`).
- `hub`: the `export.hub_repo` upload.

Nothing is imported here: `import flaxtpu.exporters.<module>` loads that module and what it imports,
no more.
"""
