"""A compiled module's text (``compiled.as_text()``), read: its computations, each an
instruction sequence in the order the scheduler left them, the types and bytes of values,
the loops' trip counts and the collectives' groups.

The one reader of HLO text in jaxcoll (the overlap report, the tests' byte counts). It reads
what XLA prints on CPU, GPU and TPU on both supported jax versions: ``%name = TYPE
opcode(operands), attributes``, a tuple TYPE in parentheses, computations opened by a line
``[ENTRY ]%name (...) -> ... {`` and closed by ``}``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
               "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4,
               "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}
CONTROL_FLOW = ("while", "call", "conditional")   # opcodes that run computations they name
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-broadcast", "collective-permute")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction: ``name``, result ``type`` (text), ``opcode``, ``operands`` (names),
  the ``attributes`` text after the operands."""

  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str

  @property
  def nbytes(self) -> float:
    """The result's bytes (a tuple's: its elements')."""
    return nbytes(self.type)

  def called(self, key: str = "calls|body|condition|to_apply|true_computation|"
             "false_computation") -> list[str]:
    """The computations it names under ``key`` (and a conditional's branches)."""
    out = re.findall(rf"\b(?:{key})=%([\w.\-]+)", self.attributes)
    branches = re.search(r"branch_computations=\{(.*?)\}", self.attributes)
    return out + (re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else [])

  @property
  def times(self) -> int:
    """How many times a control-flow instruction runs its bodies (a loop: its known trip
    count, else once)."""
    return (self.trip_count or 1) if self.opcode == "while" else 1

  @property
  def trip_count(self) -> int | None:
    """A while loop's trip count where XLA knows it (``known_trip_count``)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.attributes)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class Module:
  """``computations``: name -> its instructions in schedule order; ``entry``: the ENTRY
  computation's name."""

  computations: dict
  entry: str

  @functools.cached_property
  def types(self) -> dict[str, str]:
    """Every value's type, by name (names are unique in a module)."""
    return {i.name: i.type for seq in self.computations.values() for i in seq}

  def operand_bytes(self, instruction: Instruction) -> float:
    """The bytes of an instruction's operands."""
    return sum(nbytes(self.types.get(a, "")) for a in instruction.operands)

  @functools.cached_property
  def runs(self) -> dict[str, int]:
    """How many times a call of the module runs each computation reached by control flow
    (while bodies times their trip counts, calls, conditional branches once each, async
    wrappers); computations a fusion or a reduction calls are not listed."""
    runs, todo = {self.entry: 1}, [self.entry]
    while todo:
      comp = todo.pop()
      for i in self.computations.get(comp, ()):
        if i.opcode not in (*CONTROL_FLOW, "async-start"):
          continue
        times = runs[comp] * i.times
        for callee in i.called("calls|body|condition|true_computation|false_computation"):
          if callee not in runs:
            runs[callee] = times
            todo.append(callee)
    return runs


def nbytes(type_text: str) -> float:
  """The bytes of the arrays a type's text names (``f32[8,128]{1,0}``, tuples summed)."""
  return sum(DTYPE_BYTES.get(t, 0) * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in _ARRAY.findall(type_text))


def dims(type_text: str) -> tuple[str, tuple[int, ...]] | None:
  """The dtype and dimensions of the first array a type's text names."""
  m = _ARRAY.search(type_text)
  return None if m is None else (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))


def group_size(attributes: str) -> int:
  """How many devices each group of a collective's ``replica_groups`` holds (a permute's:
  1, it pairs devices)."""
  named = re.search(r"replica_groups=mesh\[(.*?)\](?:, device_ids=\(.*?\))? \{(.*?)\}",
                    attributes)
  if named:
    sizes = {k.strip("'"): int(v) for k, v in re.findall(r"('[\w]+')=(\d+)", named.group(1))}
    return math.prod(sizes[a.strip().strip("'")] for a in named.group(2).split(",") if a.strip())
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attributes)
  if iota:
    return int(iota.group(1).split(",")[-1])
  listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
  return len(listed.group(1).split(",")) if listed else 1


def _closing(text: str, start: int) -> int:
  """The index of the parenthesis closing the one at ``start``."""
  depth = 0
  for k in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[k], 0)
    if depth == 0:
      return k
  raise ValueError(f"unbalanced parentheses in HLO: {text[:120]!r}")


def _instruction(line: str) -> Instruction | None:
  m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ", line)
  if m is None:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    end = _closing(rest, 0) + 1
  else:
    end = rest.find(" ")
  type_text, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if op is None:
    return None
  close = _closing(rest, op.end() - 1)
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[op.end():close]))
  return Instruction(m.group(1), type_text, op.group(1), operands, rest[close + 1:])


def parse(text: str) -> Module:
  """A compiled module's text as a :class:`Module`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxcoll._src import hlo
    >>> m = hlo.parse(jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4))).compile().as_text())
    >>> any(i.opcode in ("dot", "fusion", "custom-call") for i in m.computations[m.entry])
    True
  """
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
    if head:
      current = head.group(2)
      computations[current] = []
      entry = current if head.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (i := _instruction(line)) is not None:
      computations[current].append(i)
  if entry is None:
    raise ValueError("not an HLO module's text (no ENTRY computation)")
  return Module({k: tuple(v) for k, v in computations.items()}, entry)
