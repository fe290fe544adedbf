"""What each transfer of a compiled, scheduled step runs beside: ``jaxcoll.tools.overlap``.

A transfer is an asynchronous collective's ``-start``..``-done`` pair (or ``async-start``..
``async-done`` around one), or a synchronous collective; one inside a loop counts its trip
count's times. What runs beside it is what the scheduler put between its start and its
done in the same computation (a loop between them counted with its body): a GEMM (a
``dot``/``convolution``, a fusion or custom call holding or calling one: cuBLAS, Triton
GEMM fusions, cuDNN), or any other kernel (a fusion, a Pallas/Triton custom call). XLA's
collectives and jaxcoll's (collective-permutes, the schedules' steps) are read alike, so
plain ``jax.jit``'s step is the yardstick.

Two sums: ``covered``, the fraction of transfer bytes with a GEMM beside them
(``covered_by_any``: with any kernel); and ``hidden``, an estimate of the fraction of
transfer time hidden, ``sum min(transfer seconds, GEMM seconds beside it) / sum transfer
seconds``. Both models are stated, and the estimate is a simulation until a GPU measures
it:

- a transfer's seconds: the profile's link (``alpha + beta * bytes`` a step; default the
  ``"h100-nvlink"`` preset) times a bandwidth-optimal algorithm's steps: a permute one
  message of its operand; an all-reduce of M bytes over n devices ``2(n-1)`` steps of M/n;
  an all-gather of a piece M ``n-1`` steps of M; a reduce-scatter or all-to-all of M ``n-1``
  steps of M/n;
- a GEMM's seconds: its flops (``2 * output elements * contracted extent``) at the target's
  dense tensor-core peak for its output dtype (:data:`H100_PEAK_FLOPS`, NVIDIA's H100 SXM
  data sheet; float32 as TF32, which XLA's default precision uses on Hopper). Other
  kernels count in ``covered_by_any`` but not in the time.

A CPU compile's module is scheduled too, but its collectives are synchronous (no
``-start``/``-done``): it shows their order and what lies between, never an overlap.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from jaxcoll._src import hlo
from jaxcoll._src.auto.profile import ANY_AXIS, Profile
from jaxcoll._src.checks import number as check_number
from jaxcoll._src.table import Table
from jaxcoll._src.units import format_seconds, format_size

H100_PEAK_FLOPS = {"f64": 67e12, "f32": 494.7e12, "bf16": 989.4e12, "f16": 989.4e12,
                   "f8e4m3fn": 1978.9e12, "f8e5m2": 1978.9e12, "s8": 1978.9e12,
                   "s32": 1978.9e12}
_GEMM_TARGET = re.compile(r"gemm|matmul|conv", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One transfer: the instruction that starts it (``name``, ``kind``: an HLO collective),
  the ``computation`` it is in and how many ``runs`` a step makes of it, its operand
  ``nbytes`` and group size ``n``, whether it is ``asynchronous`` (XLA may run it beside
  other work; a start XLA marked synchronous is not), and what the scheduler put beside it:
  ``gemms``, other ``kernels``, the GEMMs' ``gemm_seconds``; its own ``seconds``."""

  name: str
  kind: str
  computation: str
  runs: int
  nbytes: float
  n: int
  asynchronous: bool
  gemms: int
  kernels: int
  gemm_seconds: float
  seconds: float

  @property
  def hidden_seconds(self) -> float:
    return min(self.seconds, self.gemm_seconds)


@dataclasses.dataclass(frozen=True)
class Overlap:
  """The transfers of a compiled step and what runs beside them (module docstring)."""

  transfers: tuple[Transfer, ...]
  profile: str

  def _share(self, weight, where) -> float:
    total = sum(weight(t) * t.runs for t in self.transfers)
    return 0.0 if total == 0 else sum(weight(t) * t.runs for t in self.transfers
                                      if where(t)) / total

  @property
  def nbytes(self) -> float:
    """Transfer bytes per step (each transfer's operand bytes times its runs)."""
    return sum(t.nbytes * t.runs for t in self.transfers)

  @property
  def covered(self) -> float:
    """The fraction of transfer bytes with a GEMM scheduled beside them."""
    return self._share(lambda t: t.nbytes, lambda t: t.gemms > 0)

  @property
  def covered_by_any(self) -> float:
    """The fraction of transfer bytes with any kernel scheduled beside them."""
    return self._share(lambda t: t.nbytes, lambda t: t.gemms + t.kernels > 0)

  @property
  def hidden(self) -> float:
    """Estimated fraction of transfer time hidden behind GEMMs (module docstring)."""
    total = sum(t.seconds * t.runs for t in self.transfers)
    return 0.0 if total == 0 else sum(t.hidden_seconds * t.runs
                                      for t in self.transfers) / total

  def counts(self) -> dict[str, int]:
    """How many transfers of each collective kind the module holds (every kind of
    ``hlo.COLLECTIVES``; an asynchronous pair counted once, a loop's body once)."""
    return {k: sum(t.kind == k for t in self.transfers) for k in hlo.COLLECTIVES}

  def by_kind(self) -> dict[str, float]:
    """Transfer bytes per step by collective kind."""
    out: dict[str, float] = {}
    for t in self.transfers:
      out[t.kind] = out.get(t.kind, 0.0) + t.nbytes * t.runs
    return out

  def table(self) -> Table:
    rows = [(t.kind, t.name, format_size(t.nbytes) + (f" x{t.runs}" if t.runs > 1 else ""),
             t.n, "async" if t.asynchronous else "sync", t.gemms, t.kernels,
             format_seconds(t.seconds), format_seconds(t.gemm_seconds))
            for t in self.transfers]
    title = (f"transfers: {format_size(self.nbytes)} a step; covered by GEMMs "
             f"{self.covered:.2f} (by any kernel {self.covered_by_any:.2f}); est. hidden "
             f"{self.hidden:.2f} ({self.profile} link, H100 peak)")
    return Table.of(title, ("kind", "instruction", "bytes", "n", "mode", "GEMMs beside",
                            "kernels beside", "transfer", "GEMM time beside"), rows)

  def __str__(self) -> str:
    return str(self.table())


def overlap(compiled, *, profile="h100-nvlink", peak_flops=None) -> Overlap:
  """What each transfer of a compiled step runs beside, and the two sums.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``, also
      ``jaxcoll.use``'s) or its ``as_text()``.
    profile: the :class:`jaxcoll.Profile` (or preset name) whose ``"*"`` link prices a
      transfer step.
    peak_flops: ``{dtype: flops per second}`` for GEMMs (HLO dtype names: ``"bf16"``,
      ``"f32"``); default :data:`H100_PEAK_FLOPS`.

  Returns:
    An :class:`Overlap`: ``transfers``, ``covered``, ``covered_by_any``, ``hidden``.

  Raises:
    ValueError: text that is no HLO module; a profile that is none; a ``peak_flops`` rate
      that is not a finite number above 0.
    TypeError: ``compiled`` that is neither a compiled program nor text; ``peak_flops``
      that is no mapping of dtype names to numbers.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcoll
    >>> compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((8, 8))).compile()
    >>> jaxcoll.tools.overlap(compiled).transfers   # one device: nothing moves
    ()
  """
  if not isinstance(compiled, str) and not callable(getattr(compiled, "as_text", None)):
    raise TypeError(f"overlap(compiled={compiled!r}): expected a compiled program "
                    "(jax.jit(f).lower(...).compile()) or its as_text()")
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  module = hlo.parse(text)
  found = Profile.resolve(profile, "overlap(profile=...)")
  link = found.link(ANY_AXIS)
  if peak_flops is not None and not (isinstance(peak_flops, Mapping) and peak_flops):
    raise TypeError(f"overlap(peak_flops={peak_flops!r}): expected a mapping of HLO dtype "
                    "names to flops per second, e.g. {'bf16': 989.4e12}")
  peak = {dtype: check_number(rate, f"peak_flops[{dtype!r}]", above=0.0) for dtype, rate in
          (H100_PEAK_FLOPS if peak_flops is None else peak_flops).items()}
  transfers = []
  for comp, runs in module.runs.items():
    sequence = module.computations.get(comp, ())
    for k, instr in enumerate(sequence):
      kind, done = _transfer(module, sequence, k)
      if kind is None:
        continue
      gemms, kernels, seconds = _work(module, sequence[k + 1:done], peak)
      size, n = module.operand_bytes(instr), hlo.group_size(instr.attributes)
      transfers.append(Transfer(
          instr.name, kind, comp, runs, size, n,
          done > k + 1 or (instr.opcode != kind and '"is_sync":true' not in instr.attributes),
          gemms, kernels, seconds, _seconds(kind, size, n, link)))
  return Overlap(tuple(transfers), found.name or str(profile))


def _transfer(module: hlo.Module, sequence, k: int) -> tuple[str | None, int]:
  """``(kind, index of its done)`` if ``sequence[k]`` starts a transfer (a synchronous
  collective: its own index), else ``(None, k)``."""
  instr = sequence[k]
  if instr.opcode in hlo.COLLECTIVES:
    return instr.opcode, k
  if instr.opcode.removesuffix("-start") in hlo.COLLECTIVES and instr.opcode.endswith("-start"):
    kind = instr.opcode.removesuffix("-start")
  elif instr.opcode == "async-start":
    inner = [i.opcode for c in instr.called("calls") for i in module.computations.get(c, ())
             if i.opcode in hlo.COLLECTIVES]
    if not inner:
      return None, k
    kind = inner[0]
  else:
    return None, k
  names = {instr.name}
  for j in range(k + 1, len(sequence)):   # the done (through async-updates) that ends it
    later = sequence[j]
    if names & set(later.operands) and later.opcode in (f"{kind}-done", "async-update",
                                                        "async-done"):
      if later.opcode != "async-update":
        return kind, j
      names.add(later.name)
  return kind, k


def _work(module: hlo.Module, between, peak) -> tuple[int, int, float]:
  """``(GEMMs, other kernels, GEMM seconds)`` of instructions (loops: their bodies times
  their trip counts)."""
  gemms = kernels = 0
  seconds = 0.0
  for instr in between:
    if instr.opcode in hlo.CONTROL_FLOW:
      times = instr.times
      for body in instr.called("body|calls|true_computation|false_computation"):
        g, k, s = _work(module, module.computations.get(body, ()), peak)
        gemms, kernels, seconds = gemms + g * times, kernels + k * times, seconds + s * times
      continue
    flops = _gemm_flops(module, instr)
    if flops is not None:
      gemms += 1
      seconds += sum(f / peak.get(dtype, min(peak.values())) for dtype, f in flops)
    elif instr.opcode in ("fusion", "custom-call", "sort", "reduce", "scatter", "gather",
                          "reduce-window", "select-and-scatter", "fft", "triangular-solve",
                          "cholesky", "rng", "rng-bit-generator", "copy"):
      kernels += 1
  return gemms, kernels, seconds


def _gemm_flops(module: hlo.Module, instr) -> list[tuple[str, float]] | None:
  """The ``(dtype, flops)`` of the GEMMs an instruction is or holds (None: no GEMM)."""
  if instr.opcode in ("dot", "convolution"):
    return [_dot_flops(module, instr)]
  if instr.opcode == "fusion":
    inner: list = []
    for c in instr.called("calls"):
      for i in module.computations.get(c, ()):
        inner += _gemm_flops(module, i) or []
    return inner or None
  if instr.opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', instr.attributes)
    if target and _GEMM_TARGET.search(target.group(1)):
      return [_dot_flops(module, instr)]
  return None


def _dot_flops(module: hlo.Module, instr) -> tuple[str, float]:
  """A dot's, convolution's or GEMM call's ``(output dtype, flops)``: 2 x output elements x
  the contracted extent (a convolution's: the kernel's elements per output feature)."""
  out = hlo.dims(instr.type) or ("f32", ())
  lhs = hlo.dims(module.types.get(instr.operands[0], "")) if instr.operands else None
  rhs = hlo.dims(module.types.get(instr.operands[1], "")) if len(instr.operands) > 1 else None
  contracted = 1
  named = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attributes) or re.search(
      r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attributes)
  if named and lhs:
    contracted = math.prod(lhs[1][int(d.strip('"'))] for d in named.group(1).split(",") if d)
  elif instr.opcode == "convolution" and rhs:
    labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attributes)
    o = labels.group(1).index("o") if labels and "o" in labels.group(1) else len(rhs[1]) - 1
    contracted = math.prod(rhs[1]) // max(rhs[1][o], 1)
  return out[0], 2.0 * math.prod(out[1]) * contracted


def _seconds(kind: str, nbytes: float, n: int, link) -> float:
  """A transfer's seconds under a bandwidth-optimal algorithm (module docstring)."""
  step = lambda b: link.alpha + link.beta * b   # noqa: E731
  if kind == "all-reduce":
    return 2 * (n - 1) * step(nbytes / n)
  if kind == "all-gather":
    return (n - 1) * step(nbytes)
  if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
    return (n - 1) * step(nbytes / n)
  return step(nbytes)
