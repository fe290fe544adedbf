"""The documentation runs: every ``>>>`` example in jaxcoll's docstrings and in docs/ and
README.md, README's Python blocks in order, a command beside every measured table, and the
public API documented with Args/Returns/Raises and an example."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import re

import pytest

import jaxcoll

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((REPO / "docs").rglob("*.md"))
MODULES = sorted(
    ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for p in (REPO / "jaxcoll").rglob("*.py"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _run(tests) -> None:
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  for test in tests:
    runner.run(test)
  failed, attempted = runner.summarize(verbose=False)
  assert failed == 0, f"{failed} of {attempted} examples failed (output above)"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  _run(doctest.DocTestFinder(exclude_empty=True).find(module, name, globs={}))


@pytest.mark.parametrize("path", [REPO / "README.md", *PAGES],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_page_examples_run(path):
  import jax
  import numpy as np
  # the fenced blocks holding ">>>", one session per page; the pages' examples assume these
  # three imports (docs/index.md)
  text = path.read_text()
  blocks = re.findall(r"```(?:python|pycon)?\n(>>> .*?)```", text, re.S)
  prompts = lambda t: len(re.findall(r"^>>> ", t, re.M))   # noqa: E731
  assert prompts(text) == sum(map(prompts, blocks)), "a >>> example outside a python block"
  globs = {"jax": jax, "np": np, "jaxcoll": jaxcoll}
  _run([doctest.DocTestParser().get_doctest("\n".join(blocks), globs, path.name, str(path), 0)])


def test_readme_python_blocks_run_in_order():
  """README's three examples, as a reader pastes them one after another."""
  blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
  assert len(blocks) >= 3
  scope: dict = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), scope)   # noqa: S102 (the README's own code)


def test_readme_is_a_guide_not_a_report():
  assert len((REPO / "README.md").read_text().splitlines()) <= 250


FIGURE = re.compile(r"^\**[-+~]?[\d.,]+\s*(ms|us|s|x|%|B|KiB|MiB|GiB|GB/s|Gbit/s)?\**$")
COMMAND = re.compile(r"(python[0-9.]* |jaxcoll-bench|benchmarks/\S+\.py|examples/\S+\.py|"
                     r"jaxcoll\.[\w.]+\()")


def _sections(text: str):
  """(heading, text) of every section of a markdown page (headings inside code fences are
  code)."""
  heading, body, fenced = "", [], False
  for line in text.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    if line.startswith("#") and not fenced:
      yield heading, "\n".join(body)
      heading, body = line, []
    else:
      body.append(line)
  yield heading, "\n".join(body)


def _measured_tables(section: str):
  """The first line of every table in ``section`` with a cell that is a figure (a number,
  a time, a ratio, a size or a rate)."""
  tables, current = [], []
  for line in section.splitlines() + [""]:
    if line.startswith("|"):
      current.append(line)
    elif current:
      tables.append(current)
      current = []
  for table in tables:
    cells = [c.strip() for row in table[2:] for c in row.strip("|").split("|")]
    if any(FIGURE.match(c) for c in cells):
      yield table[0]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_measured_table_names_its_command(path):
  missing = [f"{heading}: {first[:80]}" for heading, section in _sections(path.read_text())
             for first in _measured_tables(section) if not COMMAND.search(section)]
  assert not missing, "tables without the command that measured them:\n" + "\n".join(missing)


def _public():
  namespaces = {"jaxcoll": jaxcoll, "jaxcoll.fsdp": jaxcoll.fsdp, "jaxcoll.moe": jaxcoll.moe,
                "jaxcoll.optax": jaxcoll.optax, "jaxcoll.kernels": jaxcoll.kernels,
                "jaxcoll.distributed": jaxcoll.distributed, "jaxcoll.pipeline": jaxcoll.pipeline}
  for prefix, module in namespaces.items():
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isfunction(obj):
        yield f"{prefix}.{name}", obj


@pytest.mark.parametrize("name,fn", list(_public()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_function_documents_args_returns_raises_and_an_example(name, fn):
  doc = inspect.getdoc(fn) or ""
  parts = ("Args:",) * bool(inspect.signature(fn).parameters) + ("Returns:", "Raises:", ">>>")
  missing = [part for part in parts if part not in doc]
  assert not missing, f"{name}'s docstring lacks {missing}"
