"""Published weights: where they come from, what model they are, and how they want images prepared.

`init_from.checkpoint` takes, besides a flaxtpu run:

    hf-hub:ORG/NAME          the Hugging Face hub (timm's layout), through huggingface_hub's cache
    FILE.safetensors|.pth|.pt|.bin   a timm or torchvision state dict
    FILE.npz                 a big_vision / vision_transformer (AugReg) ViT
    FOLDER                   a folder with model.safetensors and timm's config.json (as the hub has,
                             and as `--mode=export` writes)

`describe(spec)` reads the file's tensors and names the flaxtpu model that
computes the same function (`model.name` and its options); a file that holds
more tensors than that model reads, or fewer (its classifier aside: a headless
file has 0 classes), is refused, and one no family recognises is named as what
it looks like (`models/foreign.py`). It names the model's classes and
its preprocessing (mean/std, input size, crop fraction: timm's
`pretrained_cfg` where the file carries one, else timm's defaults for that
family). `apply_defaults(config)` makes those the run's defaults. No JAX here:
the CLI calls it before JAX starts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import urllib.parse
from typing import Optional

import numpy as np

from flaxtpu import models
from flaxtpu.models import foreign, layouts
from flaxtpu.settings import hub_names
from flaxtpu.settings.errors import UserError, join_or, printable

HUB_PREFIX = hub_names.HUB_PREFIX
WEIGHT_SUFFIXES = ('.safetensors', '.pth', '.pt', '.bin', '.npz')
HUB_WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin')  # in timm's order of preference
HUB_TIMEOUT_S = 3.0  # the hub probe; offline or unreachable falls back to the cache at once


def is_published(spec: str) -> bool:
  """Whether `init_from.checkpoint` names published weights rather than a flaxtpu run."""
  if spec.startswith(HUB_PREFIX) or spec.lower().endswith(WEIGHT_SUFFIXES):
    return True
  path = os.path.expanduser(spec)
  return os.path.isfile(os.path.join(path, 'model.safetensors')) and not os.path.isdir(
      os.path.join(path, 'checkpoints'))


@dataclasses.dataclass(frozen=True)
class Published:
  """Published weights and what they imply for a run."""
  spec: str  # what init_from.checkpoint said
  path: str  # the local weights file
  layout: str  # 'timm' | 'big_vision'
  model: str  # the flaxtpu model name
  options: dict  # config.model keys the weights fix (patch_size, pool, gelu, padding)
  num_classes: int
  class_names: Optional[tuple[str, ...]]  # of the published head (None: unnamed)
  mean: tuple[float, ...]
  std: tuple[float, ...]
  image_size: int  # the input size it was trained at
  crop_fraction: float
  native: bool = False  # trained at the native size of its images (a flaxtpu export with image_size 0)
  head: str = ''  # the file's key of the classifier's bias; absent from a headless file (num_classes 0)

  def rules(self) -> list[layouts.Rule]:
    """How the file's tensors become this model's arrays."""
    return models.layout(self.model, self.layout).rules(models.get_spec(self.model), self.options,
                                                        read_tensors(self.path))


# --- finding the file -----------------------------------------------------------------------------


def _hub_problem() -> Optional[str]:
  """Why the hub cannot be reached now (offline mode, no network), or None."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  if constants.HF_HUB_OFFLINE:
    return 'HF_HUB_OFFLINE is set'
  from flaxtpu.io import network  # pylint: disable=g-import-not-at-top
  endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
  address = (endpoint.hostname or 'huggingface.co',
             endpoint.port or (443 if endpoint.scheme == 'https' else 80))
  return network.network_problem(address, HUB_TIMEOUT_S)


def _hub_download(spec: str) -> tuple[str, Optional[str]]:
  """(weights file, config.json or None) of hf-hub:ORG/NAME, from the hub or huggingface_hub's cache."""
  from huggingface_hub import constants, errors, hf_hub_download  # pylint: disable=g-import-not-at-top
  hub_names.check_spec('init_from.checkpoint', spec)  # a repository id, before anything is asked
  repo = spec[len(HUB_PREFIX):]
  # An unreachable hub would cost huggingface_hub's retries (~25 s) per file: ask the cache alone then.
  problem = _hub_problem()
  # huggingface_hub's HTTP client (httpx2; httpx before it) logs each request at INFO: a failure is
  # reported below, in one line.
  for name in ('httpx', 'httpx2'):
    logging.getLogger(name).setLevel(max(logging.getLogger(name).getEffectiveLevel(), logging.WARNING))
  copy_from_elsewhere = (f'on a machine online run `hf download {repo}` and copy its cache folder '
                         f'models--{repo.replace("/", "--")} into {constants.HF_HUB_CACHE} (or set HF_HOME '
                         'to where it is)')

  def fetch(filename: str) -> Optional[str]:
    try:
      return hf_hub_download(repo, filename, local_files_only=bool(problem), etag_timeout=HUB_TIMEOUT_S,
                             library_name='flaxtpu')
    except errors.GatedRepoError as e:  # before RepositoryNotFoundError, of which it is a kind
      raise UserError(f'config.init_from.checkpoint={spec!r} is gated: accept its terms on huggingface.co '
                      'and log in with `hf auth login`') from e
    except errors.RepositoryNotFoundError as e:
      raise UserError(f'config.init_from.checkpoint={spec!r}: the hub has no model {repo!r} (or it is '
                      'private: log in with `hf auth login`); check the name on huggingface.co') from e
    except errors.LocalEntryNotFoundError as e:
      if problem:  # not in the cache, and no way to ask
        raise UserError(
            f'config.init_from.checkpoint={spec!r} is not in the Hugging Face cache '
            f'({constants.HF_HUB_CACHE}) and the hub cannot be reached ({problem}): '
            f'{copy_from_elsewhere}') from None
      # The hub answered the probe but not this request (a timeout, a connection cut), and the cache
      # lacks the file: not a file the model lacks.
      raise UserError(f'config.init_from.checkpoint={spec!r}: {filename} could not be fetched from '
                      f'{constants.ENDPOINT} ({_cause(e.__cause__ or e)}) and is not in the Hugging Face '
                      f'cache; try again, or {copy_from_elsewhere}') from None
    except errors.EntryNotFoundError:  # the repository has no such file
      return None
    except errors.RevisionNotFoundError as e:
      raise UserError(f'config.init_from.checkpoint={spec!r}: the hub model {repo!r} has no main revision; '
                      'check the name on huggingface.co') from e
    except errors.HfHubHTTPError as e:  # a server error, a disabled repository, rate limits
      status = getattr(getattr(e, 'response', None), 'status_code', None)
      raise UserError(f'config.init_from.checkpoint={spec!r}: the hub answered {status or "an error"} for '
                      f'{filename} ({_cause(e)}); try again later, or {copy_from_elsewhere}') from None
    except OSError as e:  # a connection refused or cut before any answer; a cache that cannot be written
      raise UserError(f'config.init_from.checkpoint={spec!r}: {filename} could not be fetched '
                      f'({_cause(e)}); check the connection to {constants.ENDPOINT} and that '
                      f'{constants.HF_HUB_CACHE} is writable, or {copy_from_elsewhere}') from None

  config_path = fetch('config.json')
  for filename in HUB_WEIGHT_FILES:
    if (weights := fetch(filename)) is not None:
      return weights, config_path
  raise UserError(f'config.init_from.checkpoint={spec!r}: the hub model has none of '
                  f'{", ".join(HUB_WEIGHT_FILES)}; '
                  'give a timm model (hf-hub:timm/...) or a local weights file')


def _cause(error: BaseException) -> str:
  """A library error's first line (huggingface_hub's put the status first), short enough for one line."""
  text = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
  return printable(text[:160] + ('...' if len(text) > 160 else ''))


def locate(spec: str) -> tuple[str, Optional[dict]]:
  """(local weights file, timm's config.json as a dict or None) for `init_from.checkpoint`."""
  if spec.startswith(HUB_PREFIX):
    weights, config_path = _hub_download(spec)
  else:
    path = os.path.abspath(os.path.expanduser(spec))
    weights, config_path = path, None
    if os.path.isdir(path):
      weights, config_path = os.path.join(path, 'model.safetensors'), os.path.join(path, 'config.json')
    elif os.path.isfile(os.path.join(os.path.dirname(path), 'config.json')):
      config_path = os.path.join(os.path.dirname(path), 'config.json')
    if not os.path.isfile(weights):
      raise UserError(f'config.init_from.checkpoint={spec!r} does not exist; give a weights file '
                      f'({", ".join(WEIGHT_SUFFIXES)}), hf-hub:ORG/NAME or a flaxtpu workdir')
  metadata = None
  if config_path and os.path.isfile(config_path):
    try:
      with open(config_path, encoding='utf-8') as f:
        metadata = json.load(f)
    except (OSError, ValueError) as e:
      raise UserError(f'{config_path} (the weights\' config) is not readable JSON ({e}); '
                      'fix or remove it') from e
    if not isinstance(metadata, dict):
      raise UserError(f'{config_path} (the weights\' config) holds a JSON {type(metadata).__name__}, not an '
                      'object; fix or remove it')
  return weights, metadata


@functools.lru_cache(maxsize=2)
def read_tensors(path: str) -> dict[str, np.ndarray]:
  """{key: numpy array} of a .safetensors (no torch), .pth/.pt/.bin (torch) or .npz file."""
  suffix = os.path.splitext(path)[1].lower()
  try:
    if suffix == '.safetensors':
      from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
      return load_file(path)
    if suffix == '.npz':
      with np.load(path, allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f'{path} cannot be read as {suffix} weights ({type(e).__name__}: {e}); '
                    're-download it') from e
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError(f'reading {path} needs PyTorch (pip install torch), or convert it to .safetensors '
                    '(safetensors.torch.save_file) on a machine that has it') from None
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f'{path} cannot be read by torch.load ({type(e).__name__}: {str(e)[:200]}); '
                    're-download it') from e
  for key in ('state_dict', 'model', 'state_dict_ema', 'model_ema'):  # training checkpoints wrap it
    if isinstance(state, dict) and isinstance(state.get(key), dict):
      state = state[key]
      break
  if not isinstance(state, dict):
    raise UserError(f'{path} holds a {type(state).__name__}, not a state dict of tensors; save '
                    'model.state_dict() instead')
  tensors = {re.sub(r'^(module\.|_orig_mod\.)', '', key): value for key, value in state.items()
             if hasattr(value, 'numpy')}
  return {key: value.float().numpy() if value.is_floating_point() else value.numpy()
          for key, value in tensors.items()}


# --- what the tensors are --------------------------------------------------------------------------


def infer_model(tensors: dict, where: str) -> tuple[str, str, dict]:
  """(layout, flaxtpu model name, model options) of a state dict or .npz: the first registered family
  layout that recognises its tensors."""
  for family in models.families():
    for layout in family.layouts:
      try:
        found = layout.recognise(tensors, where)
      except KeyError as e:  # a tensor the layout always has, absent: a damaged file
        raise UserError(f'{where} lacks tensor {e.args[0]!r}, which every {family.title} in '
                        f'{join_or(list(layout.sources))}\'s layout holds: the file is incomplete or '
                        'damaged; download it again or save the whole model.state_dict()') from None
      if found is not None:
        return layout.name, found[0], found[1]
  shown = ', '.join(sorted(tensors)[:4])
  if looks := foreign.identify(tensors):
    raise UserError(f'{where} looks like {looks}, which flaxtpu has no model for; supported: {_supported()}')
  titles = [family.title for family in models.families() if family.layouts]
  raise UserError(f'{where} is not a {join_or(titles)} in {_sources()} layout (its tensors: {shown}, ...); '
                  'flaxtpu imports those')


def _supported() -> str:
  """'ResNet (resnet18-152), ViT (vit_ti/s/b) or ConvNeXt (convnext_t) in timm's, ... layout'."""
  titles = [f'{family.title} ({family.listed()})' for family in models.families() if family.layouts]
  return f'{join_or(titles)} in {_sources()} layout'


def _sources() -> str:
  """Whose layouts the registered families read: "timm's, torchvision's or big_vision's"."""
  return join_or(list(dict.fromkeys(f"{source}'s" for family in models.families()
                                    for layout in family.layouts for source in layout.sources)))


def check_tensors(tensors: dict, layout: str, model: str, options: dict, where: str) -> bool:
  """That the file holds exactly the tensors of `model` in `layout` (its classifier may be absent: a
  headless file), as a UserError naming the first missing or extra tensor; returns whether it is headless."""
  table = models.layout(model, layout)
  rules = table.rules(models.get_spec(model), options, tensors)
  return layouts.check_coverage(rules, tensors, table.head(tensors), table.unread(tensors), where,
                                f"{model} ({layout}'s layout)", foreign.identify)


def _head(tensors: dict, layout: str, model: str) -> np.ndarray:
  """The bias of the published classifier (its length is the class count)."""
  return tensors[models.layout(model, layout).head(tensors)]


@functools.lru_cache(maxsize=4)
def describe(spec: str) -> Published:
  """What `init_from.checkpoint=spec` (published weights) is: model, classes, preprocessing."""
  path, metadata = locate(spec)
  tensors = read_tensors(path)
  layout, model, options = infer_model(tensors, path)
  metadata = metadata or {}
  pretrained_cfg = metadata.get('pretrained_cfg', {})
  # timm's config can say more than the tensors: a model built with the tanh GELU (as flaxtpu exports one),
  # or OpenAI CLIP's QuickGELU (timm's *_clip_quickgelu_* architectures).
  activation = metadata.get('model_args', {}).get('act_layer') or (
      'quick_gelu' if 'quickgelu' in metadata.get('architecture', '') else '')
  if activation in _GELUS and 'gelu' in options:
    options['gelu'] = _GELUS[activation]
  # timm's TensorFlow ports (tf_efficientnet_b0, ...) hold their PyTorch twins' tensors; the padding differs.
  if str(metadata.get('architecture', '')).startswith('tf_') and 'padding' in options:
    options['padding'] = 'same'
  # A headless file (timm's num_classes=0) has 0 classes: a run that trains a new head reads it.
  headless = check_tensors(tensors, layout, model, options, path)
  head = models.layout(model, layout).head(tensors)
  num_classes = 0 if headless else int(tensors[head].shape[0])
  # timm's defaults for the family where the file says nothing (ViTs: AugReg's, at their embeddings' size).
  family_defaults = models.get_family(model).preprocessing(tensors, layout, options)
  mean = tuple(pretrained_cfg.get('mean', family_defaults.mean))
  std = tuple(pretrained_cfg.get('std', family_defaults.std))
  crop_fraction = float(pretrained_cfg.get('crop_pct', family_defaults.crop_fraction))
  image_size = family_defaults.image_size
  if 'input_size' in pretrained_cfg:
    image_size = int(pretrained_cfg['input_size'][-1])
  # A flaxtpu export of a run trained at the images' native size (dataset.image_size=0): runs from it too.
  native = metadata.get('flaxtpu', {}).get('image_size') == 0
  class_names = metadata.get('label_names')
  if class_names is None and num_classes == 1000:
    class_names = imagenet_class_names()
  if class_names is not None and len(class_names) != num_classes and not headless:
    logging.warning('%s names %d classes for a %d-class head; using class_N', spec, len(class_names),
                    num_classes)
    class_names = None
  if headless:
    class_names = None
  if not pretrained_cfg:
    logging.info('%s carries no preprocessing; assuming timm\'s defaults for %s: mean %s, std %s, %d px, '
                 'crop %.3f (override with dataset.normalize=fixed, dataset.mean/std, dataset.image_size, '
                 'dataset.crop_fraction)', spec, model, mean, std, image_size, crop_fraction)
  return Published(spec=spec, path=path, layout=layout, model=model, options=options,
                   num_classes=num_classes, class_names=tuple(class_names) if class_names else None,
                   mean=mean, std=std, image_size=image_size, crop_fraction=crop_fraction, native=native,
                   head=head)


def imagenet_class_names() -> tuple[str, ...]:
  """The 1,000 ImageNet-1k class names in label order."""
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'datasets', 'imagenet_classes.txt')
  with open(path, encoding='utf-8') as f:
    return tuple(line.rstrip('\n') for line in f)


def class_names(published: Published) -> tuple[str, ...]:
  return published.class_names or tuple(f'class_{index}' for index in range(published.num_classes))


# --- the run's defaults --------------------------------------------------------------------------


def apply_defaults(config, workdir: str = '') -> bool:
  """Makes the published source's model and preprocessing the run's, where the config left them open.

  Open means: model.name at its default (a model no published weights
  are), model options at their defaults, dataset.normalize 'auto',
  dataset.image_size 0 and dataset.crop_fraction 0. A run in `workdir` that
  already started from the same weights keeps what its config.json resolved
  (a resume never reads the weights again). Returns whether init_from names
  published weights. Idempotent.
  """
  from flaxtpu.io import files  # pylint: disable=g-import-not-at-top
  from flaxtpu.settings import defaults  # pylint: disable=g-import-not-at-top
  spec = config.init_from.checkpoint
  if not spec or not is_published(spec):
    return False
  started = files.read_json(os.path.join(workdir, 'config.json')) if workdir else None
  if started and started.get('init_from', {}).get('checkpoint') == spec:
    resolved = {('model', key): started['model'].get(key) for key in ('name', *MODEL_OPTIONS)}
    resolved.update({('dataset', key): started['dataset'].get(key) for key in
                     ('normalize', 'mean', 'std', 'image_size', 'crop_fraction')})
  else:
    published = describe(spec)
    resolved = {('model', 'name'): published.model,
                **{('model', key): value for key, value in published.options.items()},
                ('dataset', 'normalize'): 'fixed', ('dataset', 'mean'): published.mean,
                ('dataset', 'std'): published.std,
                ('dataset', 'image_size'): 0 if published.native else published.image_size,
                ('dataset', 'crop_fraction'): published.crop_fraction}
  default = defaults.get_config()
  if config.model.name == default.model.name and resolved.get(('model', 'name')):
    config.model.name = resolved[('model', 'name')]
  if config.dataset.normalize == 'auto' and resolved[('dataset', 'normalize')] not in (None, 'auto'):
    config.dataset.normalize = resolved[('dataset', 'normalize')]
    config.dataset.mean, config.dataset.std = (tuple(resolved[('dataset', key)] or ())
                                               for key in ('mean', 'std'))
  for (section, key), value in resolved.items():
    if value is None or key in ('name', 'normalize', 'mean', 'std'):
      continue
    if section == 'model' and config.model.name != resolved[('model', 'name')]:
      continue  # another model than the weights': its options stay the config's
    if config[section][key] == default[section][key]:
      config[section][key] = value
  return True


# The model options that change what a model's weights are or compute: they follow the weights.
MODEL_OPTIONS = ('patch_size', 'pool', 'gelu', 'padding', 'downsample')
_GELUS = {'gelu_tanh': 'tanh', 'quick_gelu': 'quick'}  # timm's act_layer -> model.gelu


# --- and back out: timm's layout ------------------------------------------------------------------

def timm_architecture(model: str, options: dict, image_shape: tuple[int, int, int],
                      num_classes: int) -> tuple[str, dict]:
  """(timm architecture name, timm.create_model keyword arguments) computing flaxtpu's `model` on
  images of `image_shape` (height, width, channels)."""
  family = models.get_family(model)
  model_args = {'num_classes': num_classes, 'in_chans': image_shape[2]}
  if family.timm_architecture is None:
    raise UserError(models.no_timm_twin(model))
  return family.timm_architecture(model, models.get_spec(model), options, image_shape, model_args)


def timm_rules(model: str, options: dict) -> list[layouts.Rule]:
  """The timm-layout table of flaxtpu's `model` with these options (a UserError when it has none)."""
  return models.layout(model, 'timm').rules(models.get_spec(model), options, ())


def write_timm(directory: str, *, model: str, options: dict, arrays: dict, class_names, mean, std,
               image_shape: tuple[int, int, int], crop_fraction: float, image_size_key: int) -> dict:
  """model.safetensors (timm's keys) + config.json (timm's hub config) in `directory`; returns the config.

  `arrays` maps 'params/NAME' and 'batch_stats/NAME' to numpy arrays;
  `image_size_key` is the run's dataset.image_size (0: trained at the
  images' native size, which a run that starts from the export keeps).
  `timm.create_model('local-dir:DIRECTORY', pretrained=True)` loads it, and
  so does flaxtpu's init_from (DIRECTORY or its model.safetensors).
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  architecture, model_args = timm_architecture(model, options, image_shape, len(class_names))
  tensors = layouts.save(timm_rules(model, options), arrays)
  for key in [key for key in tensors if key.endswith('.running_mean')]:  # torch's BatchNorm counts updates
    tensors[key[:-len('running_mean')] + 'num_batches_tracked'] = np.zeros((), np.int64)
  save_file(tensors, os.path.join(directory, 'model.safetensors'))
  config = {'architecture': architecture, 'num_classes': len(class_names), 'model_args': model_args,
            'label_names': list(class_names),
            'pretrained_cfg': {'input_size': [image_shape[2], *image_shape[:2]], 'crop_pct': crop_fraction,
                               'crop_mode': 'center', 'interpolation': 'bicubic', 'mean': list(mean),
                               'std': list(std), 'num_classes': len(class_names)},
            'flaxtpu': {'model': model, 'image_size': image_size_key}}
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
  return config
