"""The shape of the package: no import cycle, and pricing never imports the runtime.

Imports are read from the source (``ast``), module-level and inside functions alike: an
import inside a function that closes a cycle is still a cycle, only a deferred one.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import inspect
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
  ring = "jaxcoll._src.schedules.algorithms.ring"
  assert {"jaxcoll", "jaxcoll._src.schedules.executor", ring} <= MODULES.keys()
  assert "jaxcoll._src.schedules.algorithms.registry" in imports(ring)


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


@pytest.mark.parametrize("module", ["jaxcoll._src.auto.cost", "jaxcoll._src.schedules.plan",
                                    "jaxcoll._src.schedules.schedule",
                                    "jaxcoll._src.schedules.algorithms"])
def test_pricing_and_schedules_never_import_the_runtime(module):
  """Schedules, their plan and their price are NumPy: no executor, no collectives."""
  assert not reachable(module) & {"jaxcoll._src.schedules.executor", "jaxcoll._src.collectives"}


REPO = ROOT.parent
OUTSIDE = [*sorted((REPO / "benchmarks").glob("*.py")), *sorted((REPO / "examples").glob("*.py")),
           ROOT / "bench.py"]


def private_imports(path: pathlib.Path) -> set[str]:
  """What ``path`` imports from ``jaxcoll._src`` (relative imports resolved from its package)."""
  package = path.relative_to(REPO).parent.parts
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
      names = {base} | {f"{base}.{a.name}" for a in node.names}
    else:
      continue
    out |= {n for n in names if n == "jaxcoll._src" or n.startswith("jaxcoll._src.")}
  return out


def test_the_reader_sees_the_tools_and_private_imports():
  names = {p.relative_to(REPO).as_posix() for p in OUTSIDE}
  assert {"jaxcoll/bench.py", "benchmarks/bench_dispatch.py", "examples/quickstart.py"} <= names
  assert private_imports(ROOT / "_src" / "auto" / "explain.py") >= {"jaxcoll._src.auto.dispatch"}


@pytest.mark.parametrize("path", OUTSIDE, ids=lambda p: p.relative_to(REPO).as_posix())
def test_benchmarks_examples_and_the_bench_use_only_the_public_api(path):
  """They import ``jaxcoll`` and its namespaces (``jaxcoll.tools`` for what benchmarks need),
  never ``jaxcoll._src``: what they do, a user can."""
  assert not private_imports(path), f"{path.name} imports {sorted(private_imports(path))}"


def _algorithm_names() -> set[str]:
  import jaxcoll
  from jaxcoll._src.schedules.algorithms import entries
  return {a.name for p in jaxcoll.PRIMITIVES for a in entries(p)}


def _docstrings(tree: ast.AST) -> set[int]:
  """ids of the string constants that are docstrings."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        out.add(id(body[0].value))
  return out


def algorithm_literals(path: pathlib.Path, names: set[str]) -> list[tuple[int, str]]:
  """(line, text) of every string literal in ``path`` that names an algorithm (docstrings
  aside)."""
  tree = ast.parse(path.read_text())
  skip = _docstrings(tree)
  return [(node.lineno, node.value) for node in ast.walk(tree)
          if isinstance(node, ast.Constant) and isinstance(node.value, str)
          and node.value in names and id(node) not in skip]


def test_the_reader_sees_algorithm_literals():
  names = _algorithm_names()
  assert {"ring", "hierarchical", "direct"} <= names
  assert algorithm_literals(ROOT / "_src" / "schedules" / "algorithms" / "ring.py", names)


NAMING = sorted(p for p in ROOT.rglob("*.py") if "algorithms" not in p.relative_to(ROOT).parts)


@pytest.mark.parametrize("path", NAMING, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_algorithm_is_named_outside_algorithms(path):
  """Only ``jaxcoll/_src/schedules/algorithms/`` names algorithms: everything else reads the
  registry's metadata (stages, native equivalents, what calibrate fits, options auto tries)."""
  assert not algorithm_literals(path, _algorithm_names())


TOPICS = ("use", "training", "moe", "pipeline")   # built on the public API, as a user's code is
INTEGRATIONS = sorted(p for topic in TOPICS for p in (ROOT / "_src" / topic).rglob("*.py"))
VERSION_MODULE = "jaxcoll._src.compat"   # reads jax internals, not jaxcoll's
INTERPRETER = "jaxcoll._src.interpreter"   # the one jaxpr interpreter, jax's jaxprs only
RULE_TABLE = "jaxcoll._src.per_device_rules"   # use's rules by primitive (public: extend)
SHARED = (VERSION_MODULE, INTERPRETER, RULE_TABLE, "jaxcoll._src.declarations")


def internal_names(path: pathlib.Path) -> list[str]:
  """What an integration takes from jaxcoll that the public API (``jaxcoll``,
  ``jaxcoll.extend``) does not offer: whole private modules, or names no public namespace
  exports."""
  import jaxcoll
  public = {id(getattr(ns, n)) for ns in (jaxcoll, jaxcoll.extend) for n in ns.__all__}
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("jaxcoll"):
      continue
    if node.module.startswith((*(f"jaxcoll._src.{t}" for t in TOPICS), "jaxcoll.extend",
                               *SHARED)):
      continue
    module = importlib.import_module(node.module)
    for a in node.names:
      value = getattr(module, a.name)
      if inspect.ismodule(value):
        if value.__name__ not in SHARED and \
            not value.__name__.startswith(tuple(f"jaxcoll._src.{t}" for t in TOPICS)):
          out.append(value.__name__)
      elif id(value) not in public:
        out.append(f"{node.module}.{a.name}")
  return out


def test_the_reader_sees_internal_names():
  assert internal_names(ROOT / "_src" / "auto" / "explain.py")   # explain reads dispatch, cost, ...


@pytest.mark.parametrize("path", INTEGRATIONS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_integrations_use_only_the_public_api(path):
  """Training, MoE and pipelines are built on what a user can import: the collectives, explain,
  config and the building blocks in ``jaxcoll.extend``."""
  assert not internal_names(path)


def test_readme_s_install_command_installs_what_every_example_imports():
  """README's first command must run every example, not only the quickstart: each package an
  example imports is a dependency or in the extra that command installs."""
  import re
  import sys
  import tomllib
  top = ROOT.parent
  command = (top / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
  extras = re.findall(r"pip install -e '\.\[([\w,]+)\]'", command)
  assert extras, command
  project = tomllib.loads((top / "pyproject.toml").read_text())["project"]
  installed = {re.split(r"[<>=\[ ]", d)[0] for d in project["dependencies"]}
  for extra in extras[0].split(","):
    installed |= {re.split(r"[<>=\[ ]", d)[0] for d in project["optional-dependencies"][extra]}
  installed |= {"jaxcoll", "jaxlib"}
  for example in sorted((top / "examples").glob("*.py")):
    for node in ast.walk(ast.parse(example.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
      for name in names:
        root = name.split(".")[0]
        if root not in sys.stdlib_module_names:
          assert root in installed, f"{example.name} imports {root}, not installed by {command}"


# ------------------------------------------------------------------ one decision, one compat

PRICING_TO_PICK = {"candidates", "pick", "choose", "predict", "predict_native",
                   "schedule_times"}
DECIDES = {"jaxcoll._src.auto.dispatch", "jaxcoll._src.auto.cost"}


def _pricing_calls(path: pathlib.Path) -> set[str]:
  """Which of ``PRICING_TO_PICK`` ``path`` reaches: imported by name from the cost model or
  dispatch (or ``jaxcoll.tools``), or read as ``cost.X`` / ``dispatch.X`` / ``tools.X``."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
        ("dispatch", "cost", "tools")):
      out |= {a.name for a in node.names} & PRICING_TO_PICK
    elif isinstance(node, ast.Attribute) and node.attr in PRICING_TO_PICK and \
        isinstance(node.value, (ast.Name, ast.Attribute)) and \
        (getattr(node.value, "id", None) or getattr(node.value, "attr", "")) in (
            "cost", "dispatch", "tools"):
      out.add(node.attr)
  return out


def test_the_reader_sees_pricing_calls():
  assert {"candidates", "pick"} <= _pricing_calls(REPO / "tests" / "test_dispatch.py")


@pytest.mark.parametrize("path", [*(p for n, p in MODULES.items() if n not in DECIDES),
                                  *OUTSIDE], ids=lambda p: p.relative_to(REPO).as_posix())
def test_auto_is_decided_in_one_function(path):
  """What auto runs is computed by ``dispatch.decide`` alone: every other module (the
  collectives, explain, the debug log, jaxcoll-bench, the benchmarks) asks it, and none
  prices candidates to pick one itself (issue: the benchmarks' copy left out topology)."""
  assert not _pricing_calls(path), f"{path.name} prices to pick: {sorted(_pricing_calls(path))}"


def _jax_private(path: pathlib.Path) -> list[str]:
  """``jax._src`` (or any ``_``-named part of a jax module path) imported or read."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      names = [node.module or ""]
    elif isinstance(node, ast.Attribute):
      parts, value = [node.attr], node.value
      while isinstance(value, ast.Attribute):
        parts.insert(0, value.attr)
        value = value.value
      if isinstance(value, ast.Name) and value.id == "jax":
        names = [".".join(["jax", *parts])]
    out += [f"line {node.lineno}: {n}" for n in names
            if n.split(".")[0] in ("jax", "jaxlib")
            and any(part.startswith("_") for part in n.split(".")[1:])]
  return out


def test_the_reader_sees_private_jax_names():
  assert any("jax._src" in n for n in _jax_private(ROOT / "_src" / "compat.py"))


@pytest.mark.parametrize("path", [p for n, p in MODULES.items() if n != "jaxcoll._src.compat"],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_private_jax_names_only_in_compat(path):
  """Every private jax name lives in ``compat.py`` (tested there on both versions)."""
  assert not _jax_private(path), _jax_private(path)


# ---------------------------------------------------- one house: topics, one interpreter

def test_the_topic_packages_hold_their_topics():
  """``use``, training, MoE, auto, the schedules and the wire formats each have a package of
  their own; no flat folder of integrations is left."""
  for topic in ("use", "training", "moe", "auto", "schedules", "wire"):
    assert (ROOT / "_src" / topic / "__init__.py").exists(), topic
  assert not (ROOT / "_src" / "integrations").exists()
  assert {"jaxcoll._src.use.api", "jaxcoll._src.training.fsdp", "jaxcoll._src.moe.layer",
          "jaxcoll._src.auto.dispatch", "jaxcoll._src.schedules.executor",
          "jaxcoll._src.wire.formats"} <= MODULES.keys()


SUB_JAXPR_READERS = {"open_jaxpr", "sub_jaxprs", "scan_counts"}   # compat's, for the interpreter
LOOPS_AND_BRANCHES = {"scan", "while", "cond"}


def _reads(path: pathlib.Path) -> set[str]:
  """The names of ``SUB_JAXPR_READERS`` ``path`` reaches and the loop/branch primitive names
  it spells (string literals, docstrings aside)."""
  tree = ast.parse(path.read_text())
  skip = _docstrings(tree)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr in SUB_JAXPR_READERS:
      out.add(node.attr)
    elif isinstance(node, ast.ImportFrom):
      out |= {a.name for a in node.names} & SUB_JAXPR_READERS
    elif isinstance(node, ast.Constant) and node.value in LOOPS_AND_BRANCHES and \
        id(node) not in skip:
      out.add(node.value)
  return out


def test_the_reader_sees_sub_jaxpr_reads():
  assert {"open_jaxpr", "scan", "while", "cond"} <= _reads(ROOT / "_src" / "interpreter.py")


@pytest.mark.parametrize("path", [p for n, p in MODULES.items()
                                  if n not in ("jaxcoll._src.interpreter", VERSION_MODULE,
                                               "jaxcoll._src.hlo")],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_one_interpreter_reads_every_higher_order_primitive(path):
  """Only ``_src/interpreter.py`` reads a higher-order equation's bodies out of its params
  and names loops and branches: ``use``'s rewrite, its per-device evaluator, the vma
  analysis and the traffic count dispatch on its forms, so a new higher-order primitive is
  one entry in ``interpreter.FORMS``. (``_src/hlo.py`` reads compiled modules, not jaxprs:
  its ``while`` is an HLO opcode, named there alone.)"""
  assert not _reads(path), sorted(_reads(path))


# ------------------------------------------------------------------ each decision once

DISPATCH = "jaxcoll._src.auto.dispatch"
REGISTRY = "jaxcoll._src.schedules.algorithms.registry"   # checks a name, decides nothing


def _margin_arithmetic(path: pathlib.Path) -> list[int]:
  """Lines where ``NATIVE_MARGIN`` enters a comparison or arithmetic (not a message)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.BinOp, ast.Compare)) and any(
        isinstance(n, ast.Name) and n.id == "NATIVE_MARGIN" for n in ast.walk(node)):
      out.append(node.lineno)
  return out


def test_the_reader_sees_margin_arithmetic():
  assert _margin_arithmetic(ROOT / "_src" / "auto" / "dispatch.py")


@pytest.mark.parametrize("path", [p for n, p in MODULES.items() if n != DISPATCH],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_margin_rule_is_applied_in_dispatch_alone(path):
  """A challenger replaces a default (a schedule the lax collective, MoE's allgather its
  all_to_all) by ``dispatch.replaces`` alone: trusted profiles only, every placement."""
  assert not _margin_arithmetic(path)


def _per_axes_availability(path: pathlib.Path) -> list[int]:
  """Lines that test a name against ``algorithms(primitive, num_axes=...)``: the fallback
  for a name a primitive lacks over so many axes."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Compare) and any(
        isinstance(c, ast.Call) and any(k.arg == "num_axes" for k in c.keywords)
        and getattr(c.func, "id", getattr(c.func, "attr", "")) == "algorithms"
        for c in node.comparators):
      out.append(node.lineno)
  return out


def test_the_reader_sees_availability_tests():
  assert _per_axes_availability(ROOT / "_src" / "auto" / "dispatch.py")


@pytest.mark.parametrize("path", [p for n, p in MODULES.items() if n not in (DISPATCH, REGISTRY)],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_fallback_for_a_missing_algorithm_is_decided_once(path):
  """``use`` and FSDP give a name to several primitives; where one lacks it, what runs
  instead is ``dispatch.offered`` 's answer (``jaxcoll.extend.offered_algorithm``)."""
  assert not _per_axes_availability(path)


def test_use_decides_compression_in_one_place():
  """Which of ``use`` 's collectives travel compressed: ``Options.wire_for`` alone."""
  for path in sorted((ROOT / "_src" / "use").rglob("*.py")):
    names = {n.id if isinstance(n, ast.Name) else n.attr
             for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, (ast.Name, ast.Attribute))}
    assert "compresses" not in names or path.name == "options.py", path


@pytest.mark.parametrize("path", [p for n, p in MODULES.items()
                                  if n != "jaxcoll._src.training.buckets"],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_one_bucketing_routine(path):
  """Values packed for one collective are grouped by ``buckets.assign`` alone (gradient sync,
  ``use`` 's reduce-scatters and all-reduces): no other function makes buckets."""
  defined = [n.name for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.FunctionDef) and "buckets" in n.name.lower()]
  assert not defined, defined


# ---------------------------------------------------- extension points, one file each

@pytest.mark.parametrize("table,module", [
    ("ELEMENTS", "jaxcoll._src.wire.formats"), ("ROUTERS", "jaxcoll._src.moe.routers"),
    ("FIELDS", "jaxcoll._src.config"), ("RULES", "jaxcoll._src.per_device_rules"),
    ("FORMS", "jaxcoll._src.interpreter")])
def test_each_extension_table_is_one_declarations_table(table, module):
  """A wire format, a router, a config setting, a per-device rule and a higher-order form are
  each one entry of one ``Declarations`` table, declared in one module and changed only by
  ``add`` (built in, or from outside) and ``remove``: no module assigns into it
  (tests/test_extension_points.py adds one of each from outside)."""
  from jaxcoll._src.declarations import Declarations
  assert isinstance(getattr(importlib.import_module(module), table), Declarations)
  writers = []
  for name, path in MODULES.items():
    for node in ast.walk(ast.parse(path.read_text())):
      targets = node.targets if isinstance(node, ast.Assign) else \
          [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
      for t in targets:
        base = t.value if isinstance(t, ast.Subscript) else t
        if isinstance(base, ast.Name) and base.id == table:
          writers.append((name, type(t).__name__))
  assert writers == [(module, "Name")], writers
