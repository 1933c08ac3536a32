"""flaxtpu: train image classifiers with JAX and Flax on TPU, GPU or CPU."""

__version__ = '0.1.0'


# Issue 53 moved the top-level modules into packages (docs/architecture.md). Their old names still
# import, as the same module objects: `import flaxtpu.optim`, `from flaxtpu import optim` and
# `from flaxtpu.optim import X` give `flaxtpu.optimizers.optim` itself (`flaxtpu.optim is
# flaxtpu.optimizers.optim`), with no file at the old place. Nothing is imported until an old name
# is asked for, so `import flaxtpu` stays free of JAX.
import importlib as _importlib
import importlib.machinery as _machinery
import sys as _sys

_MOVED = {  # old module name -> the package it is in now
    'audit': 'data',
    'audit_folds': 'modes',
    'aug_checks': 'augmentation',
    'augment': 'augmentation',
    'augmix': 'augmentation',
    'bce': 'loss',
    'bn_recompute': 'step',
    'calibration': 'report',
    'checkpoint': 'weights',
    'compile_plan': 'step',
    'config': 'validation',
    'defaults': 'settings',
    'distill': 'transfer',
    'divergence': 'loop',
    'early_stopping': 'loop',
    'errors': 'settings',
    'evaluate': 'evaluation',
    'events': 'io',
    'explain': 'evaluation',
    'export': 'exporters',
    'export_options': 'validation',
    'fewshot': 'evaluation',
    'files': 'io',
    'finetune': 'transfer',
    'gradients': 'step',
    'hub': 'exporters',
    'hub_names': 'settings',
    'image_sizes': 'augmentation',
    'lengths': 'settings',
    'lock': 'io',
    'loss_scale': 'optimizers',
    'losses': 'loss',
    'memory': 'data',
    'metric_names': 'settings',
    'metrics': 'io',
    'model_card': 'exporters',
    'network': 'io',
    'onnx_export': 'exporters',
    'optim': 'optimizers',
    'optim_checks': 'optimizers',
    'optim_contrib': 'optimizers',
    'optim_wrappers': 'optimizers',
    'parallel': 'step',
    'param_patterns': 'optimizers',
    'photometric': 'augmentation',
    'plateau': 'optimizers',
    'pretrained': 'weights',
    'profiling': 'loop',
    'progress': 'loop',
    'pruning': 'loop',
    'randaugment': 'augmentation',
    'resolution': 'validation',
    'run_log': 'loop',
    'sam': 'optimizers',
    'saved': 'weights',
    'signals': 'loop',
    'soup': 'modes',
    'steps': 'step',
    'storage': 'io',
    'swa': 'optimizers',
    'tflite_export': 'exporters',
    'time_budget': 'loop',
    'tracking': 'io',
    'train': 'loop',
    'workdir_config': 'validation',
}


class _Alias:
  """A loader that answers an old name with the moved module itself."""

  def __init__(self, target: str):
    self.target, self.spec = target, None

  def create_module(self, spec):
    module = _importlib.import_module(self.target)
    self.spec = module.__spec__
    return module

  def exec_module(self, module):
    module.__spec__ = self.spec  # importing set the old name's spec on it: the module keeps its own


class _MovedModuleFinder:
  """`flaxtpu.<old name>` -> the moved module (importlib.abc.MetaPathFinder's protocol). It sits right
  after the path finder on sys.meta_path: a module that exists under a name wins, and no later
  finder (such as an editable install's, which maps `flaxtpu.*` onto its own checkout) answers an
  old name first."""

  @staticmethod
  def find_spec(fullname, path=None, target=None):
    package, _, name = fullname.rpartition('.')
    if package != __name__ or name not in _MOVED:
      return None
    return _machinery.ModuleSpec(fullname, _Alias(f'{__name__}.{_MOVED[name]}.{name}'))


if not any(type(finder).__name__ == '_MovedModuleFinder' for finder in _sys.meta_path):
  _after = [i + 1 for i, finder in enumerate(_sys.meta_path) if finder is _machinery.PathFinder]
  _sys.meta_path.insert(_after[0] if _after else len(_sys.meta_path), _MovedModuleFinder())
