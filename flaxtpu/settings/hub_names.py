"""Names of Hugging Face hub models as users write them, checked before anything is fetched.

`init_from.checkpoint` and `distill.teacher` read a hub model written
`hf-hub:ORG/NAME` (timm's spelling); `export.hub_repo` names one as
`ORG/NAME`. Whether ORG/NAME is a repository id at all is huggingface_hub's
own rule (`huggingface_hub.utils.validate_repo_id`: letters, digits, `-`,
`_`, `.`, at most 96 characters, no `--` or `..`, not starting or ending
with `-` or `.`, not ending in `.git`); this module only says in one line
which part breaks it. Other spellings of a hub name (timm's `hf_hub:`,
huggingface_hub's `hf://`, a huggingface.co address) are named with the
spelling flaxtpu reads. Nothing here touches the network or imports more
than huggingface_hub's validators: config validation runs before JAX starts.
"""

from __future__ import annotations

import os
import re
import string
from typing import Optional

from flaxtpu.settings.errors import ConfigError, printable

HUB_PREFIX = 'hf-hub:'
EXAMPLE = 'hf-hub:timm/resnet50.a1_in1k'
MAX_PART = 96  # huggingface_hub's REPO_ID_REGEX: each of ORG and NAME
ALLOWED = frozenset(string.ascii_letters + string.digits + '-_.')
# Other ways a hub model is written (timm's underscore, huggingface_hub's file system, the site's address):
# what follows each is ORG/NAME (the address may go on with /tree/main, /blob/..., /resolve/...).
OTHER_SPELLINGS = ('hf_hub:', 'hf://models/', 'hf://', 'hub:', 'huggingface:', 'hf:',
                   'https://huggingface.co/', 'http://huggingface.co/', 'huggingface.co/')


def repo_problem(repo_id: str) -> Optional[str]:
  """Why `repo_id` is not a model repository id ORG/NAME, or None: huggingface_hub's validate_repo_id
  decides; the reason names the part and the rule it breaks."""
  from huggingface_hub.utils import HFValidationError, validate_repo_id  # pylint: disable=g-import-not-at-top
  parts = repo_id.split('/')
  if not repo_id:
    return 'it is empty'
  if len(parts) == 1:
    return 'it has no ORG/ before the name'
  if len(parts) > 2:
    return f'it has {len(parts) - 1} slashes, not one'
  try:
    validate_repo_id(repo_id)
  except HFValidationError as e:
    for label, part in zip(('ORG', 'NAME'), parts):
      if not part:
        return f'its {label} is empty'
      if len(part) > MAX_PART:
        return f'its {label} is {len(part)} characters long (the hub allows at most {MAX_PART})'
      if bad := sorted({char for char in part if char not in ALLOWED}):
        shown = ' '.join(repr(char) for char in bad)
        return (f"its {label} '{printable(part)}' has {shown} (the hub allows letters, digits, -, _ and . "
                'only)')
      for edge, char in (('starts', part[0]), ('ends', part[-1])):
        if char in '-.':
          return (f'its {label} {part!r} {edge} with {char!r} (hub names start and end with a letter, digit '
                  'or _)')
      for pair in ('--', '..'):
        if pair in part:
          return f'its {label} {part!r} has {pair!r} (the hub forbids -- and ..)'
    if repo_id.endswith('.git'):
      return 'it ends in .git (name the model without it)'
    return str(e).split(':')[0]
  return None


def check_spec(key: str, spec: str) -> None:
  """For `init_from.checkpoint`/`distill.teacher`: an `hf-hub:` name that is not a repository id, or a hub
  model written another way (that is no file here), is one UserError line naming the fix."""
  if spec.startswith(HUB_PREFIX):
    repo = spec[len(HUB_PREFIX):]
    if problem := repo_problem(repo):
      raise ConfigError(f"config.{key}='{printable(spec)}' is not a hub model name: {problem}; write "
                        f'hf-hub:ORG/NAME as huggingface.co shows it, e.g. {EXAMPLE}')
    return
  if (repo := other_spelling(spec)) is not None:
    raise ConfigError(f"config.{key}='{printable(spec)}': hub models are written {HUB_PREFIX}ORG/NAME; use "
                      f'{key}={HUB_PREFIX}{repo}')


def other_spelling(spec: str) -> Optional[str]:
  """ORG/NAME when `spec` names a hub model in a spelling other than hf-hub: and is no path here."""
  if os.path.exists(os.path.expanduser(spec)):
    return None
  for prefix in OTHER_SPELLINGS:
    if spec.lower().startswith(prefix):
      rest = spec[len(prefix):].strip('/').split('/')
      repo = '/'.join(rest[:2])
      return repo if len(rest) >= 2 and repo_problem(repo) is None else None
  return None


def bare_repo(spec: str) -> Optional[str]:
  """ORG/NAME when `spec` is a valid repository id that is no path here (perhaps a hub model written
  without hf-hub:, perhaps a run directory that does not exist)."""
  if re.fullmatch(r'[^/]+/[^/]+', spec) and not os.path.exists(os.path.expanduser(spec)) and \
      repo_problem(spec) is None:
    return spec
  return None
