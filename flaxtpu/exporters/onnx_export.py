"""--mode=export's ONNX model: the SavedModel's uint8 -> (logits, probabilities) function as model.onnx.

Why this route: jax2tf now lowers a whole model to ONE TensorFlow op (XlaCallModule), so
tf2onnx has no TensorFlow graph to convert; torch.onnx through the timm folder covers only the
families timm has (not the Keras CNN twin, nor flaxtpu options timm lacks) and converts timm's
PyTorch code, not flaxtpu's. jax2onnx converts the jaxpr itself. Its default mode swaps
flax.linen / jax.numpy calls for its own shims, which misread flaxtpu's calls (positional
max_pool windows, tuple padding); with those shims off ("lax-only") plain JAX traces the model
and jax2onnx converts it primitive by primitive. Every family, present and coming, bottoms out
in the same ~30 lax primitives (conv_general_dilated, dot_general, reduce_*, reduce_window_max,
elementwise ops, reshape/transpose, pad, gather, ...), so a new family needs no converter code;
the check against predict in export.py says when one does.

jax2onnx 0.17.1 (pinned: the fixes reach into its internals; tests/test_onnx.py fails loudly when
they move) needs two of them here:
  - `lax.reduce_window_max` on NHWC becomes a 4-D MaxPool that onnxruntime refuses ('Unsupported
    pooling size'): a plugin override lowers it as Transpose -> 2-D MaxPool -> Transpose;
  - some lax plugins (pad, clamp, ...) put the symbolic batch dimension into `ir.Shape(...)`, which
    int()s it (Swin pads its feature maps to whole windows): those modules get an `ir` whose
    `Shape` converts symbolic dimensions as jax2onnx's own `_to_ir_dim_for_shape` does.

The graph takes `images` uint8 [batch, H, W, C] (batch symbolic) and returns float32 `logits` and
`probabilities` [batch, classes] (softmax; sigmoid per tag for task=multilabel), normalisation and
test-time augmentation inside, as the SavedModel. bfloat16 models are exported as their float32
clone (onnxruntime's CPU kernels lack bfloat16), as for TFLite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import logging
import os
import sys
import time
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from flaxtpu.step import steps

FILE = 'model.onnx'
EXTERNAL_DATA = 'model.onnx.data'  # weights beside the graph once they near protobuf's 2 GiB cap
CONVERTER_VERSION = '0.17.1'  # jax2onnx; pip install --no-deps jax2onnx==0.17.1 (see the Makefile)
OPSET = 23
_SINGLE_FILE_BYTES = 1_800_000_000
_QUIET = ('jax2onnx', 'onnx_ir')  # per-plugin import notes and serialisation warnings during conversion


class Unavailable(Exception):
  """jax2onnx or onnxruntime cannot be used here (missing, or its internals moved)."""


def export(directory: str, task: steps.Task, host_state: steps.ModelState,
           logits_function: Callable[[steps.Task], Callable]) -> dict[str, Any]:
  """Writes `directory`/model.onnx -> export.json's `onnx`, `onnx_error` and `onnx_model` entries.

  `logits_function(task)` is the SavedModel's (variables, uint8 images) -> logits. When jax2onnx or
  onnxruntime is missing, or jax2onnx cannot convert the model, nothing is written and `onnx_error`
  says why in one line (the export goes on, as without TFLite); a failed write (a full disk) raises.
  Checking the file against predict is export.py's (`runner`).
  """
  try:
    jax2onnx = _converter()
  except Unavailable as e:
    return {'onnx': None, 'onnx_error': str(e), 'onnx_model': None}
  if task.model.dtype != jnp.float32:  # the same weights, computing in float32
    task = dataclasses.replace(task, model=task.model.clone(dtype=jnp.float32))
  logits = functools.partial(logits_function(task), {'params': host_state.params,
                                                     'batch_stats': host_state.batch_stats})

  def serve(images):
    values = logits(images)
    return values, jax.nn.sigmoid(values) if task.multilabel else jax.nn.softmax(values, axis=-1)

  height, width, channels = task.image_shape
  path = os.path.join(directory, FILE)
  started = time.perf_counter()
  try:
    with _quiet(), jax.default_device(jax.devices('cpu')[0]):
      model = jax2onnx.to_onnx(serve, [jax.ShapeDtypeStruct(('batch', height, width, channels), jnp.uint8)],
                               model_name='flaxtpu', opset=OPSET, return_mode='ir', input_names=['images'],
                               output_names=['logits', 'probabilities'])
  except Exception as e:  # pylint: disable=broad-except  # a primitive without a plugin, a plugin's bug
    return _failed('could not convert the model', e)
  seconds = time.perf_counter() - started
  weight_bytes = sum(value.const_value.nbytes for value in model.graph.initializers.values()
                     if value.const_value is not None)
  external = weight_bytes > _SINGLE_FILE_BYTES
  with _quiet():
    _save(model, path, EXTERNAL_DATA if external else None)  # a full disk fails the export (export.py)
  import onnx  # pylint: disable=g-import-not-at-top
  try:
    onnx.checker.check_model(path)  # well-formed ONNX, not only what onnxruntime accepts
  except onnx.checker.ValidationError as e:
    for name in (FILE, EXTERNAL_DATA):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, name))
    return _failed('wrote a graph that onnx.checker refuses', e)
  import onnxruntime  # pylint: disable=g-import-not-at-top
  return {'onnx': FILE, 'onnx_error': None, 'onnx_model': {
      'opset': model.opset_imports.get('', OPSET), 'ir_version': int(model.ir_version),
      'converter': f'jax2onnx {CONVERTER_VERSION} (lax primitives only, flaxtpu.onnx_export)',
      'onnx': onnx.__version__, 'onnxruntime': onnxruntime.__version__,
      'nodes': sum(1 for _ in model.graph.all_nodes()), 'convert_seconds': round(seconds, 3),
      'compute_dtype': 'float32', 'external_data': EXTERNAL_DATA if external else None,
      'inputs': {'images': {'dtype': 'uint8', 'shape': ['batch', height, width, channels]}},
      'outputs': {name: {'dtype': 'float32', 'shape': ['batch', task.num_classes]}
                  for name in ('logits', 'probabilities')},
      'load': f"onnxruntime.InferenceSession('{FILE}').run(['logits', 'probabilities'], "
              "{'images': images})"}}


def _failed(what: str, error: Exception) -> dict[str, Any]:
  """export()'s answer when jax2onnx fails: no ONNX model, and why in one line."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  reason = f'{type(error).__name__}: {lines[0][:300] if lines else ""}'
  return {'onnx': None, 'onnx_model': None, 'onnx_error': f'jax2onnx {CONVERTER_VERSION} {what}: {reason}'}


def runner(path: str) -> Callable[[np.ndarray], np.ndarray]:
  """model.onnx on onnxruntime's CPU provider as uint8 images -> logits."""
  import onnxruntime  # pylint: disable=g-import-not-at-top
  session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
  return lambda images: session.run(['logits'], {'images': images})[0]


def _save(model, path: str, external_data: str | None) -> None:
  import onnx_ir  # pylint: disable=g-import-not-at-top
  onnx_ir.save(model, path, external_data=external_data)


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _not_jax2onnx_info(record: logging.LogRecord) -> bool:
  """jax2onnx also logs to the root logger (a line with every to_onnx argument): below warnings, dropped."""
  return record.levelno >= logging.WARNING or f'{os.sep}jax2onnx{os.sep}' not in record.pathname


@contextlib.contextmanager
def _quiet():
  loggers = [logging.getLogger(name) for name in _QUIET]
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.setLevel(logging.ERROR)
  logging.getLogger().addFilter(_not_jax2onnx_info)
  try:
    yield
  finally:
    logging.getLogger().removeFilter(_not_jax2onnx_info)
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


def _converter() -> types.ModuleType:
  """jax2onnx with only its lax primitive plugins on, and flaxtpu's two fixes; Unavailable says why not."""
  if sys.version_info < (3, 11):
    raise Unavailable(f'jax2onnx needs Python 3.11+, this is '
                      f'{sys.version_info.major}.{sys.version_info.minor}')
  missing = [name for name in ('jax2onnx', 'onnx', 'onnx_ir', 'onnxruntime')
             if importlib.util.find_spec(name) is None]
  if missing:
    raise Unavailable(f'{" and ".join(missing)} not installed (pip install \'flaxtpu[onnx]\' and '
                      f'pip install --no-deps jax2onnx=={CONVERTER_VERSION})')
  if (found := _version('jax2onnx')) != CONVERTER_VERSION:
    raise Unavailable(f'jax2onnx {found} is installed; flaxtpu\'s fixes to it need exactly '
                      f'{CONVERTER_VERSION} (pip install --no-deps jax2onnx=={CONVERTER_VERSION})')
  try:
    with _quiet():
      return _patched()
  except (ImportError, AttributeError) as e:
    raise Unavailable(f'jax2onnx {CONVERTER_VERSION} cannot be patched here ({type(e).__name__}: {e})') from e


@functools.lru_cache(maxsize=None)
def _patched() -> types.ModuleType:
  # pylint: disable=g-import-not-at-top
  import jax2onnx
  import onnx_ir as ir
  from jax2onnx.converter.ir_builder import _dtype_to_ir
  from jax2onnx.plugins import plugin_system
  from jax2onnx.plugins._ir_shapes import _ensure_value_metadata, _stamp_type_and_shape, _to_ir_dim_for_shape
  from jax2onnx.plugins.jax.lax import reduce_window_max

  plugin_system.import_all_plugins()
  # Lax-only: no flax.linen / nnx / jax.numpy / jax.nn shims; the lax plugins convert the plain jaxpr.
  for entry in plugin_system.PLUGIN_REGISTRY.values():
    if not type(entry).__module__.startswith('jax2onnx.plugins.jax.lax'):
      type(entry).binding_specs = classmethod(lambda cls: [])
      if getattr(entry, 'patch_info', None) is not None:
        entry.patch_info = None

  # Fix 2: symbolic batch dimensions inside ir.Shape(...) in the lax plugins.
  symbolic_safe = types.ModuleType('onnx_ir_symbolic_safe')
  symbolic_safe.__dict__.update({key: value for key, value in vars(ir).items() if not key.startswith('__')})
  symbolic_safe.Shape = lambda dims, *args, **kwargs: ir.Shape([_to_ir_dim_for_shape(d) for d in dims],
                                                                *args, **kwargs)
  for name, module in list(sys.modules.items()):
    if name.startswith('jax2onnx.plugins.jax.') and getattr(module, 'ir', None) is ir:
      module.ir = symbolic_safe

  # Fix 1: NHWC max pooling as Transpose -> 2-D MaxPool -> Transpose (the last registration wins).
  @plugin_system.register_primitive(
      jaxpr_primitive=jax.lax.reduce_window_max_p.name, context='primitives.lax',
      component='reduce_window_max', since='flaxtpu', onnx=[{'component': 'MaxPool'}], testcases=[])
  class NHWCMaxPool(reduce_window_max.ReduceWindowMaxPrimitivePlugin):  # pylint: disable=unused-variable
    """A 1 x kh x kw x 1 window over [N, H, W, C]; other windows keep jax2onnx's lowering."""

    def lower(self, ctx: Any, eqn: Any) -> None:
      p = eqn.params
      window, strides = tuple(p['window_dimensions']), tuple(p['window_strides'])
      pads, dilation = tuple(tuple(q) for q in p['padding']), tuple(p['window_dilation'])
      if not (len(window) == 4 and window[0] == window[3] == strides[0] == strides[3] == 1
              and pads[0] == pads[3] == (0, 0) and all(d == 1 for d in p['base_dilation'])):
        return super().lower(ctx, eqn)
      x_var, y_var = eqn.invars[0], eqn.outvars[0]
      dtype = _dtype_to_ir(np.dtype(x_var.aval.dtype), ctx.builder.enable_double_precision)
      x = ctx.get_value_for_var(x_var, name_hint=ctx.fresh_name('mp_in'))
      y_spec = ctx.get_value_for_var(y_var, name_hint=ctx.fresh_name('mp_out'))
      n, h, w, c = x_var.aval.shape
      on, oh, ow, oc = y_var.aval.shape

      def stamp(value, shape):
        value.type = ir.TensorType(dtype)
        _stamp_type_and_shape(value, shape)
        _ensure_value_metadata(ctx, value)
        return value

      nchw = stamp(ctx.builder.Transpose(x, perm=(0, 3, 1, 2), _outputs=[ctx.fresh_name('mp_nchw')]),
                   (n, c, h, w))
      kwargs = dict(kernel_shape=window[1:3], strides=strides[1:3],
                    pads=(pads[1][0], pads[2][0], pads[1][1], pads[2][1]))
      if any(d != 1 for d in dilation):
        kwargs['dilations'] = dilation[1:3]
      pooled = stamp(ctx.builder.MaxPool(nchw, _outputs=[ctx.fresh_name('mp_pool')], **kwargs),
                     (on, oc, oh, ow))
      out = stamp(ctx.builder.Transpose(pooled, perm=(0, 2, 3, 1),
                                        _outputs=[getattr(y_spec, 'name', None) or ctx.fresh_name('mp')]),
                  (on, oh, ow, oc))
      ctx.bind_value_for_var(y_var, out)

  return jax2onnx
