"""The shape of the package: no import cycle, and pricing never imports the runtime.

Imports are read from the source (``ast``), module-level and inside functions alike: an
import inside a function that closes a cycle is still a cycle, only a deferred one.
"""

from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxcoll"


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


MODULES = _modules()


def imports(name: str) -> set[str]:
  """The jaxcoll modules ``name`` imports (``from X import Y``: X.Y if a module, else X)."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name in MODULES}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
      for a in node.names:
        out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
  return (out & MODULES.keys()) - {name}


def test_the_reader_sees_every_module():
  assert {"jaxcoll", "jaxcoll._src.executor", "jaxcoll._src.algorithms.ring"} <= MODULES.keys()
  assert "jaxcoll._src.algorithms.registry" in imports("jaxcoll._src.algorithms.ring")


def test_no_import_cycle():
  graph = {name: imports(name) for name in MODULES}
  try:
    graphlib.TopologicalSorter(graph).prepare()
  except graphlib.CycleError as err:
    pytest.fail(f"import cycle: {' -> '.join(err.args[1])}")


def reachable(name: str) -> set[str]:
  seen, todo = set(), [name]
  while todo:
    for dep in imports(todo.pop()) - seen:
      seen.add(dep)
      todo.append(dep)
  return seen


@pytest.mark.parametrize("module", ["jaxcoll._src.cost", "jaxcoll._src.plan",
                                    "jaxcoll._src.schedule", "jaxcoll._src.algorithms"])
def test_pricing_and_schedules_never_import_the_runtime(module):
  """Schedules, their plan and their price are NumPy: no executor, no collectives."""
  assert not reachable(module) & {"jaxcoll._src.executor", "jaxcoll._src.collectives"}
