"""The shape of flaxtpu/ (issue 53): one package per concern, imports flowing one way.

docs/architecture.md is the one place the layering is written: its numbered list names the
packages bottom to top, and the paragraph after it the entry points at the top; this test reads both.
It fails when
- a module lands at the top of flaxtpu/ beside the entry points, or a package exists that the page
  does not list (or the page lists one that does not exist);
- flaxtpu modules import each other in a circle, by any chain: module-level and function-level
  imports both count (a function-level import runs later, but it runs);
- a module imports one of a package above its own. Module-level and function-level imports both
  count; DEFERRED_UPWARD names the function-level imports allowed to reach up, with the reason.
Not counted: imports under `if TYPE_CHECKING:` (never run), and the package `__init__` that Python
runs before any of its modules (an edge counts where a module names another).
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'flaxtpu'
PAGE = ROOT / 'docs' / 'architecture.md'
# Function-level imports allowed to reach a package above their own: (importer, imported): why.
DEFERRED_UPWARD = {
    ('flaxtpu.optimizers.swa', 'flaxtpu.step.bn_recompute'):
        "validation calls swa's checks, so swa sits below the step; recomputing the averaged "
        "weights' BatchNorm statistics runs the step",
}


def layering() -> list[str]:
  """The packages, bottom to top, as docs/architecture.md lists them."""
  return re.findall(r'^\d+\. `(\w+)/`', PAGE.read_text(), re.M)


def entry_points() -> set[str]:
  top = PAGE.read_text().split('At the top of `flaxtpu/`', 1)[1].split('\n\n', 1)[0]
  return set(re.findall(r'`(\w+)\.py`', top))


def modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = list(path.relative_to(ROOT).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts.pop()
    found['.'.join(parts)] = path
  return found


def imports() -> dict[str, list[tuple[str, str, int]]]:
  """{module: [(flaxtpu module it imports, 'module' or 'function', line)]}."""
  known = modules()

  def resolve(name):
    while name and name not in known:
      name = name.rpartition('.')[0]
    return name

  graph = {}
  for module, path in known.items():
    edges = []

    def visit(node, level, module=module, path=path, edges=edges):
      for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and 'TYPE_CHECKING' in ast.unparse(child.test):
          for other in child.orelse:
            visit(ast.Module(body=[other], type_ignores=[]), level)
          continue
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
          visit(child, 'function')
          continue
        if isinstance(child, ast.Import):
          edges.extend((resolve(a.name), level, child.lineno) for a in child.names
                       if a.name.split('.')[0] == 'flaxtpu')
        elif isinstance(child, ast.ImportFrom):
          base = child.module or ''
          if child.level:
            package = module.split('.') if path.name == '__init__.py' else module.split('.')[:-1]
            base = '.'.join(package[:len(package) - child.level + 1] + ([base] if base else []))
          if base.split('.')[0] == 'flaxtpu':
            for alias in child.names:
              full = f'{base}.{alias.name}'
              edges.append((full if full in known else resolve(base), level, child.lineno))
        visit(child, level)

    visit(ast.parse(path.read_text()), 'module')
    graph[module] = sorted({edge for edge in edges if edge[0] and edge[0] != module})
  return graph


def cycles(graph) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted({target for target, _, _ in graph[root]})))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, targets = work[-1]
      for target in targets:
        if target not in index:
          index[target] = low[target] = len(index)
          stack.append(target)
          on_stack.add(target)
          work.append((target, iter(sorted({t for t, _, _ in graph.get(target, ())}))))
          break
        if target in on_stack:
          low[node] = min(low[node], index[target])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = []
          while True:
            member = stack.pop()
            on_stack.discard(member)
            component.append(member)
            if member == node:
              break
          if len(component) > 1:
            found.append(sorted(component))
  return found


def test_only_entry_points_and_listed_packages_at_the_top():
  allowed = entry_points() | {'__init__'}
  assert {'main', 'average'} <= allowed, 'docs/architecture.md names the entry points'
  stray = sorted(path.name for path in PACKAGE.glob('*.py') if path.stem not in allowed)
  assert not stray, (f'{stray} at the top of flaxtpu/: put each in the package of its concern '
                     '(docs/architecture.md), or list a new entry point there')
  packages = sorted(path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.rglob('*.py')))
  assert packages == sorted(layering()), (
      f'packages on disk {packages} != packages in docs/architecture.md {sorted(layering())}')
  for package in packages:
    assert (PACKAGE / package / '__init__.py').is_file(), f'flaxtpu/{package}/ has no __init__.py'
    assert ast.get_docstring(ast.parse((PACKAGE / package / '__init__.py').read_text())), (
        f'flaxtpu/{package}/__init__.py should say what the package offers (a docstring)')


def test_no_import_circle():
  found = cycles(imports())
  assert not found, 'modules that import each other in a circle: ' + '; '.join(' <-> '.join(c) for c in found)


def test_no_module_level_import_circle():
  """The strict core of the rule: without the deferred imports too, nothing is circular."""
  graph = {module: [edge for edge in edges if edge[1] == 'module'] for module, edges in imports().items()}
  assert not cycles(graph)


def test_imports_flow_down_the_layers():
  order = layering()
  rank = {package: i for i, package in enumerate(order)}

  def layer(module):
    parts = module.split('.')
    return len(order) if len(parts) == 1 or parts[1] in entry_points() else rank[parts[1]]

  upward = [f'{source}:{line} ({level}-level) imports {target}'
            for source, edges in imports().items() for target, level, line in edges
            if layer(target) > layer(source)
            and not (level == 'function' and (source, target) in DEFERRED_UPWARD)]
  assert not upward, ('imports of a package above the importer\'s in docs/architecture.md:\n'
                      + '\n'.join(upward))


def test_deferred_upward_imports_are_still_there():
  """An allowance that nothing uses any more goes."""
  edges = {(source, target) for source, found in imports().items() for target, level, _ in found
           if level == 'function'}
  assert set(DEFERRED_UPWARD) <= edges
