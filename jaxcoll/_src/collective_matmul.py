"""Collective matmuls: an all-gather feeding an einsum, or an einsum feeding a reduce-scatter,
run as ring steps each beside the partial einsum of the chunk in hand.

``all_gather_matmul`` is ``jnp.einsum(subscripts, ...)`` with one operand first gathered
(tiled) over ``axis_name`` along the dimension of subscript letter ``dim``;
``matmul_reduce_scatter`` is the einsum's result reduce-scattered (tiled) over ``axis_name``
along its dimension ``dim``. Both are the decomposition of Wang et al. (ASPLOS 2023), XLA's
windowed einsum and PyTorch's async TP (``fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``), written the way JAX's shard_map docs and MaxText's
``shmap_collective_matmul.py`` write it: a ``fori_loop`` whose body sends one chunk to the
next device (:func:`jaxcoll.shift`) while it multiplies the chunk in hand. That loop body is
the form XLA's GPU scheduler hides: the transfer's start and done lie on either side of an
independent GEMM in the same computation (docs/guide/overlap.md). Bidirectional runs send
half of every chunk each way round the ring.

One mechanism serves every case: a chunk of the gathered operand (or of the output) is a
slice along ``dim``; every operand with that letter is sliced there, and the output slice is
written (``dim`` in the output) or summed into (``dim`` contracted). Autodiff of the loop
gives the backward pass the same structure (a loop of transfers beside partial GEMMs), so
gradients overlap too.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src import axes as axes_lib
from jaxcoll._src import checks
from jaxcoll._src.auto.cost import native_equivalents
from jaxcoll._src.collectives import all_gather, shift
from jaxcoll._src.invariant import as_replicated, make_varying


def _expand(subscripts, operands) -> tuple[list[str], str]:
  """``subscripts`` as one letter a dimension for each operand and the output, "..." expanded
  into fresh letters (aligned from the right, as einsum broadcasts them)."""
  if not isinstance(subscripts, str) or subscripts.count("->") != 1:
    raise ValueError(f"subscripts={subscripts!r}: expected an explicit einsum such as "
                     "'bsE,Ehd->bshd' (two operands, '->' and the output)")
  lhs, out = subscripts.replace(" ", "").split("->")
  terms = lhs.split(",")
  if len(terms) != len(operands):
    raise ValueError(f"subscripts={subscripts!r} names {len(terms)} operand(s); "
                     f"{len(operands)} were given")
  used = set(subscripts)
  fresh = [c for c in string.ascii_letters if c not in used]
  ranks = [x.ndim - len(t.replace("...", "")) if "..." in t else 0
           for t, x in zip(terms, operands)]
  width = max(ranks, default=0)
  if width > len(fresh) or min(ranks, default=0) < 0:
    raise ValueError(f"subscripts={subscripts!r} do not fit operands of rank "
                     f"{[x.ndim for x in operands]}")
  pool = "".join(fresh[:width])
  terms = [t.replace("...", pool[width - r:]) for t, r in zip(terms, ranks)]
  out = out.replace("...", pool)
  for t, x in zip(terms, operands):
    if len(t) != x.ndim:
      raise ValueError(f"subscripts={subscripts!r}: term {t!r} does not match an operand "
                       f"of shape {x.shape}")
  return terms, out


def _letter(dim, terms: Sequence[str], out: str) -> str:
  if not isinstance(dim, str) or len(dim) != 1 or dim not in "".join(terms) + out:
    raise ValueError(f"dim={dim!r}: expected one subscript letter of the einsum "
                     f"({','.join(terms)}->{out})")
  return dim


def _directions(bidirectional, extent: int, what: str) -> tuple[int, ...]:
  """The ring directions: +1 alone, or +1 and -1 with half of every chunk each way."""
  if checks.flag(bidirectional, "bidirectional") and extent % 2:
    raise ValueError(f"bidirectional=True halves every chunk; {what} has odd extent {extent}")
  return (1, -1) if bidirectional else (1,)


def _slice(x, term: str, letter: str, start, size: int):
  return lax.dynamic_slice_in_dim(x, start, size, term.index(letter)) if letter in term else x


@dataclasses.dataclass(frozen=True)
class _OutputSplit:
  """A two-operand einsum whose output dimension ``letter`` is split over ``axes`` (the
  reduce-scatter and all-reduce forms): its expanded ``terms`` and ``out``, the axis size
  ``n`` and the output's extent ``total`` along ``letter``."""

  terms: tuple[str, str]
  out: str
  letter: str
  axes: tuple[str, ...]
  n: int
  total: int
  precision: object
  preferred_element_type: object

  @property
  def at(self) -> int:
    """The split dimension's index in the output."""
    return self.out.index(self.letter)

  def einsum(self, a, b):
    return jnp.einsum(f"{self.terms[0]},{self.terms[1]}->{self.out}", a, b,
                      precision=self.precision,
                      preferred_element_type=self.preferred_element_type)

  def part(self, operands, start, size: int):
    """The einsum of the operands sliced to output rows ``[start, start + size)``."""
    return self.einsum(*(_slice(v, t, self.letter, start, size)
                         for v, t in zip(operands, self.terms)))


def _output_split(subscripts, x, y, axis_name, dim, precision,
                  preferred_element_type) -> _OutputSplit:
  """:class:`_OutputSplit` of the call's arguments; ValueError (naming the argument) for
  subscripts that do not fit the operands or a ``dim`` not in the output."""
  terms, out = _expand(subscripts, [x, y])
  letter = _letter(dim, terms, out)
  if letter not in out:
    raise ValueError(f"dim={dim!r} is not a dimension of the output ({out!r})")
  axes = axes_lib.normalize(axis_name)
  total = next(v.shape[t.index(letter)] for v, t in zip((x, y), terms) if letter in t)
  return _OutputSplit(tuple(terms), out, letter, axes, axes_lib.size(axes), total, precision,
                      preferred_element_type)


def all_gather_matmul(subscripts: str, x, y, axis_name, *, dim: str, operand: int = 0,
                      bidirectional: bool = False, algorithm: str = "auto",
                      precision=None, preferred_element_type=None,
                      return_gathered: bool = False):
  """``jnp.einsum(subscripts, x, y)`` with operand ``operand`` all-gathered first (tiled, over
  ``axis_name``, along its dimension of letter ``dim``), as N-1 ring steps each beside the
  einsum of the chunk in hand.

  Where ``dim`` is in the output the chunks' products are written there (the tensor-parallel
  all-gather of activations, MaxText's collective matmul); where it is contracted they are
  summed (FSDP's gathered weight, in float32 for floats narrower than 32 bits). The other
  operand holds ``dim`` whole (N times the gathered operand's extent) where it has it.

  Cost: N-1 steps of M/N bytes per device (M = the gathered operand), as a ring all_gather,
  each overlapping one partial einsum; bidirectional, N-1 steps of M/2N bytes each way.

  Args:
    subscripts: an explicit einsum, two operands (``"bsE,Ehd->bshd"``; "..." allowed).
    x, y: the operands, inside ``jax.shard_map``.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    dim: the subscript letter of the gathered dimension.
    operand: which operand is gathered (0: x, 1: y).
    bidirectional: send half of every chunk each way round the ring (off by default: XLA's
      GPU scheduler hides one transfer beside the GEMM, not both; docs/guide/overlap.md).
    algorithm: the :func:`jaxcoll.shift` algorithm of each step.
    precision, preferred_element_type: as ``jnp.einsum``'s.
    return_gathered: also return the gathered operand (assembled from the chunks as they
      pass, no transfer more; as PyTorch's ``fused_all_gather_matmul`` returns it), for a
      later reader such as the backward pass's matmul.

  Returns:
    ``jnp.einsum(subscripts, x, y)`` on the gathered operand: varying over ``axis_name``;
    with ``return_gathered``, the pair (that, the gathered operand).

  Raises:
    ValueError: at trace time, naming the argument: subscripts that are not an explicit
      two-operand einsum matching the shapes, a ``dim`` that is not a letter of the gathered
      operand, an other operand whose ``dim`` is not N times the gathered one,
      ``bidirectional=True`` on an odd chunk, an ``operand`` other than 0 or 1.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(
    ...     lambda a, w: jaxcoll.all_gather_matmul("sk,kn->sn", a, w, "x", dim="s"),
    ...     mesh=mesh, in_specs=(jax.P("x"), jax.P(None, "x")), out_specs=jax.P(None, "x"))
    >>> a, w = jnp.arange(16.0).reshape(8, 2), jnp.ones((2, 4))
    >>> bool(jnp.array_equal(f(a, w), a @ w))
    True

  """
  operands = [x, y]
  checks.choice(operand, (0, 1), "operand")
  terms, out = _expand(subscripts, operands)
  letter = _letter(dim, terms, out)
  if letter not in terms[operand]:
    raise ValueError(f"dim={dim!r} is not a dimension of operand {operand} "
                     f"({terms[operand]!r})")
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)
  size = operands[operand].shape[terms[operand].index(letter)]
  other = 1 - operand
  if letter in terms[other] and operands[other].shape[terms[other].index(letter)] != n * size:
    raise ValueError(f"dim={dim!r}: operand {other} has extent "
                     f"{operands[other].shape[terms[other].index(letter)]} there; the "
                     f"gathered operand {operand} needs {n} x {size} = {n * size}")
  spec = f"{terms[0]},{terms[1]}->{out}"

  def einsum(a, b, dtype=preferred_element_type):
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=dtype)

  directions = _directions(bidirectional, size, f"operand {operand}'s dim {dim!r}")
  checks.flag(return_gathered, "return_gathered")
  if n == 1:
    return (einsum(x, y), operands[operand]) if return_gathered else einsum(x, y)
  piece = size // len(directions)
  operands = [make_varying(v, axes) for v in operands]
  me = axes_lib.index(axes)
  contracted = letter not in out
  whole = list(operands[operand].shape)
  whole[terms[operand].index(letter)] = n * size
  shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in operands]
  shapes[operand] = jax.ShapeDtypeStruct(tuple(whole), operands[operand].dtype)
  result = jax.eval_shape(einsum, *shapes)
  dtype = result.dtype
  if contracted and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    dtype = jnp.dtype(jnp.float32)
  varying = set(axes).union(*(jax.typeof(v).mat.varying for v in operands))
  acc = make_varying(jnp.zeros(result.shape, dtype), tuple(sorted(varying)))
  held = [_slice(operands[operand], terms[operand], letter, k * piece, piece)
          for k in range(len(directions))]

  gathered = []
  if return_gathered:
    gathered = [make_varying(jnp.zeros(whole, operands[operand].dtype), tuple(sorted(varying)))]
  axis = terms[operand].index(letter)

  def add(acc, gathered, chunk, source, k):
    """acc with the product of ``chunk`` (piece k of device ``source``'s operand), and
    the chunk in its place among the gathered where they are kept."""
    start = source * size + k * piece
    gathered = [lax.dynamic_update_slice_in_dim(g, chunk, start, axis) for g in gathered]
    pair = [chunk, chunk]
    pair[other] = _slice(operands[other], terms[other], letter, start, piece)
    part = einsum(*pair, dtype if contracted else preferred_element_type)
    if contracted:
      return acc + part.astype(dtype), gathered
    return lax.dynamic_update_slice_in_dim(acc, part.astype(dtype), start,
                                           out.index(letter)), gathered

  def step(t, carry):
    acc, gathered, held = carry
    nxt = [shift(h, axes, d, algorithm=algorithm) for h, d in zip(held, directions)]
    for k, (h, d) in enumerate(zip(held, directions)):
      acc, gathered = add(acc, gathered, h, (me - d * t) % n, k)
    return acc, gathered, nxt

  acc, gathered, held = lax.fori_loop(0, n - 1, step, (acc, gathered, held))
  for k, (h, d) in enumerate(zip(held, directions)):
    acc, gathered = add(acc, gathered, h, (me - d * (n - 1)) % n, k)
  acc = acc.astype(result.dtype)
  return (acc, gathered[0]) if return_gathered else acc


def matmul_reduce_scatter(subscripts: str, x, y, axis_name, *, dim: str,
                          bidirectional: bool = False, algorithm: str = "auto",
                          precision=None, preferred_element_type=None) -> jax.Array:
  """``lax.psum_scatter(jnp.einsum(subscripts, x, y), axis_name, tiled=True)`` along the
  output's dimension of letter ``dim``, as N-1 ring steps: each device sends a running partial
  sum on while it computes its own partial einsum for the next chunk.

  The product is never materialised whole: each step computes one output chunk's partial
  einsum (the operands sliced along ``dim``) and adds it to the sum arriving from the previous
  device (the Megatron row-parallel matmul with sequence parallelism).

  Cost: N-1 steps of R/N bytes per device (R = the einsum's result), as a ring
  reduce_scatter, each overlapping one partial einsum; bidirectional, R/2N each way.

  Args:
    subscripts: an explicit einsum, two operands ("..." allowed).
    x, y: the operands (partial sums over ``axis_name``), inside ``jax.shard_map``.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    dim: the subscript letter of the output dimension scattered (divisible by N).
    bidirectional: half of every chunk each way round the ring (off by default, as in
      :func:`all_gather_matmul`).
    algorithm: the :func:`jaxcoll.shift` algorithm of each step.
    precision, preferred_element_type: as ``jnp.einsum``'s.

  Returns:
    This device's chunk of the summed product (its ``dim`` extent divided by N).

  Raises:
    ValueError: at trace time, naming the argument: subscripts that are not an explicit
      two-operand einsum matching the shapes, a ``dim`` not in the output or not divisible
      by N, ``bidirectional=True`` on an odd chunk.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(
    ...     lambda h, w: jaxcoll.matmul_reduce_scatter("sf,fn->sn", h, w, "x", dim="s"),
    ...     mesh=mesh, in_specs=(jax.P(None, "x"), jax.P("x")), out_specs=jax.P("x"))
    >>> h, w = jnp.arange(32.0).reshape(8, 4), jnp.ones((4, 2))
    >>> bool(jnp.array_equal(f(h, w), h @ w))
    True

  """
  split = _output_split(subscripts, x, y, axis_name, dim, precision, preferred_element_type)
  axes, n, total = split.axes, split.n, split.total
  if total % n:
    raise ValueError(f"dim={dim!r}: the output's extent {total} there is not divisible by "
                     f"the axis size {n}")
  size = total // n
  directions = _directions(bidirectional, size, f"the output's chunk along {dim!r}")
  if n == 1:
    return split.einsum(x, y)
  piece = size // len(directions)
  operands = [make_varying(v, axes) for v in (x, y)]
  me = axes_lib.index(axes)

  def part(chunk, k):
    return split.part(operands, chunk * size + k * piece, piece)

  sums = [part((me - d) % n, k) for k, d in enumerate(directions)]

  def step(t, sums):
    return [shift(s, axes, d, algorithm=algorithm) + part((me - d * (t + 1)) % n, k)
            for k, (s, d) in enumerate(zip(sums, directions))]

  sums = lax.fori_loop(1, n, step, sums)
  return jnp.concatenate(sums, axis=split.at) if len(sums) > 1 else sums[0]


def matmul_all_reduce(subscripts: str, x, y, axis_name, *, dim: str, pieces: int = 1,
                      algorithm: str = "auto", precision=None,
                      preferred_element_type=None) -> jax.Array:
  """``lax.psum(jnp.einsum(subscripts, x, y), axis_name)`` as a ring all-reduce pipelined over
  ``pieces`` blocks of the output's dimension ``dim``: block p is reduce-scattered beside its
  own chunks' partial einsums (as :func:`matmul_reduce_scatter`) while block p-1, reduced,
  is gathered on the same steps (both in one transfer a step). Every step but the last
  block's gather sends beside a partial einsum: 1 - 1/(2 pieces) of the bytes. With one
  piece (the default) it is a ring all-reduce whose reduce-scatter half runs beside the
  matmul's pieces and whose gather half runs alone.

  Cost: a ring all-reduce's 2(N-1)/N R bytes per device (R = the einsum's result), in
  (pieces + 1)(N-1) steps: N-1 of R/(pieces N) (the first block's reduce-scatter), then
  (pieces - 1)(N-1) of twice that, then N-1 of R/(pieces N) alone (the last gather). More
  pieces put more bytes beside GEMMs at more steps, each paying a transfer's latency: worth
  it where a block's partial einsum outlasts its step. On the data-parallel MLP of
  docs/guide/overlap.md (2048 x 2048 weights, 1024 rows a device, 8 H100s, compiled) the
  weight gradient's GEMM is a quarter of its all-reduce's time, and 1, 2 and 4 pieces cover
  0.50, 0.75 and 0.87 of the bytes but leave 1.5, 2.0 and 2.9 ms of transfer time exposed
  (estimated): one piece is the default.

  Args:
    subscripts: an explicit einsum, two operands ("..." allowed).
    x, y: the operands (partial sums over ``axis_name``), inside ``jax.shard_map``.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    dim: the subscript letter of the output dimension split into blocks and chunks.
    pieces: how many blocks (an int of at least 1 such that pieces x N divides the
      output's extent along ``dim``).
    algorithm: the :func:`jaxcoll.shift` algorithm of each step.
    precision, preferred_element_type: as ``jnp.einsum``'s.

  Returns:
    The summed product, whole on every device (bit-identical across devices: each chunk is
    summed once, in ring order, and copied).

  Raises:
    ValueError: at trace time, naming the argument: subscripts that are not an explicit
      two-operand einsum matching the shapes, a ``dim`` not in the output, ``pieces`` that
      with N does not divide the output's extent there.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(
    ...     lambda h, w: jaxcoll.matmul_all_reduce("sf,fn->sn", h, w, "x", dim="s", pieces=2),
    ...     mesh=mesh, in_specs=(jax.P(None, "x"), jax.P("x")), out_specs=jax.P())
    >>> h, w = jnp.arange(64.0).reshape(16, 4), jnp.ones((4, 2))
    >>> bool(jnp.array_equal(f(h, w), h @ w))
    True
  """
  split = _output_split(subscripts, x, y, axis_name, dim, precision, preferred_element_type)
  axes, n, total, at = split.axes, split.n, split.total, split.at
  pieces = checks.integer(pieces, "pieces", least=1)
  if total % (pieces * n):
    raise ValueError(f"pieces={pieces}: the output's extent {total} along dim={dim!r} is not "
                     f"divisible by pieces x the axis size ({pieces} x {n})")
  if n == 1:   # lax's own: typed invariant as a psum's result
    return lax.psum(split.einsum(x, y), axes)
  if pieces == 1:   # the executor's ring gather holds less than the loop below (compiled)
    ring = native_equivalents("all_gather")[0]   # the ring: what NCCL runs for a gather
    return all_gather(matmul_reduce_scatter(subscripts, x, y, axes, dim=dim, algorithm=algorithm,
                                            precision=precision,
                                            preferred_element_type=preferred_element_type),
                      axes, axis=at, tiled=True, algorithm=ring, to="invarying")
  size = total // (pieces * n)       # one chunk; a block is n chunks
  operands = [make_varying(v, axes) for v in (x, y)]
  me = axes_lib.index(axes)

  def part(block, chunk):
    return split.part(operands, (block * n + chunk) * size, size)

  def stage(block, sums, held):
    """The n-1 steps that reduce-scatter ``block`` (``sums``: its running sum, if not None)
    and gather ``block - 1`` (``held``: this device's reduced chunk of it, if not None),
    both in one transfer a step. Returns the block's reduced chunk and the gathered block
    before it (its n chunks stacked in rank order)."""
    def step(t, carry):
      sums, held, got = carry
      moved = shift(jnp.stack([v for v in (sums, held) if v is not None]), axes, 1,
                    algorithm=algorithm)
      if sums is not None:
        sums = moved[0] + part(block, (me - t - 1) % n)
      if held is not None:
        held = moved[-1]
        got = lax.dynamic_update_index_in_dim(got, held, (me - t) % n, 0)
      return sums, held, got

    got = None if held is None else lax.dynamic_update_index_in_dim(
        jnp.zeros((n,) + held.shape, held.dtype), held, me, 0)
    sums, _, got = lax.fori_loop(1, n, step, (sums, held, got))
    return sums, got

  blocks, sums, held = [], part(0, (me - 1) % n), None
  for block in range(pieces + 1):
    reduced, got = stage(block, sums, held)
    if got is not None:   # [n, ..., size, ...] -> the block: chunk index beside its rows
      got = jnp.moveaxis(got, 0, at)
      blocks.append(got.reshape(got.shape[:at] + (n * size,) + got.shape[at + 2:]))
    held = reduced
    sums = part(block + 1, (me - 1) % n) if block + 1 < pieces else None
  return as_replicated(jnp.concatenate(blocks, axis=at) if len(blocks) > 1 else blocks[0], axes)
