"""``jaxcoll.use``, the public function transformation (:mod:`jaxcoll._src.use.rewrite`
does the work)."""

from __future__ import annotations

from collections.abc import Callable

from jaxcoll._src.use.options import Options
from jaxcoll._src.use.rewrite import rewrite


def use(fun: Callable | None = None, *, algorithm="auto", wire_dtype=None, profile=None,
        axes=None, in_shardings=None, out_shardings=None, strict: bool = False,
        collective_matmul: bool | None = None):
  """Runs ``fun``'s lax collectives as jaxcoll collectives (a function transformation).

  Every ``psum`` (and its invariant form; ``pmean`` is a psum and a divide), ``pmax``,
  ``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all`` and every ``ppermute`` that is
  a shift (i -> i + k, wrapped or not) over shard_map axes becomes ``jaxcoll.all_reduce``,
  ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``shift`` with the same semantics:
  same shapes, dtypes and typing (invariant where lax's is), results within reduction-order
  tolerance, lax's gradients. The rewrite reaches into shard_map, nested jit, scan, while,
  cond, checkpoint/remat (the policy kept) and custom_jvp/custom_vjp functions (primal and
  rules); every other equation runs as it was.

  A step written for global arrays (plain ``jax.jit`` over sharded arrays, on an Auto or
  Explicit mesh) has no collective in its jaxpr: XLA's partitioner adds them. ``use`` runs
  such a step per device in one ``shard_map`` over the mesh axes its inputs are split on
  (:mod:`spmd`): each value tracked as split or a partial sum, jaxcoll collectives where a
  layout changes, partial sums reduced late and together in buckets. Inputs are laid out as
  the arguments are (concrete arrays' shardings, Explicit types), or as ``in_shardings`` or
  a jitted ``fun``'s own ``in_shardings`` say; arguments that are not arrays are passed as
  they are (a jitted function's static arguments). ``jaxcoll.explain_step`` reports what
  runs where.

  Usable as ``use(f)``, ``use(f, algorithm="ring")``, ``@use`` and ``@use(algorithm=...)``.

  Args:
    fun: the function (arguments: pytrees of arrays, and static values).
    algorithm: "auto" (the cost model, per call); a name, used by every primitive that
      offers it ("ring": all_reduce, reduce_scatter, all_gather; the others "schedule",
      auto among jaxcoll's schedules, so that no collective stays the lax one); or a
      mapping ``{primitive: algorithm}`` (unnamed primitives: "auto").
    wire_dtype: compress every floating all_reduce, reduce_scatter and all_gather
      (``jaxcoll.WIRE_DTYPES``); None sends values as they are.
    profile: the cost model's :class:`jaxcoll.Profile` (or preset name, or profile JSON path:
      :meth:`jaxcoll.Profile.resolve`) while ``fun`` is traced; None keeps
      ``jaxcoll.config``'s.
    axes: for a global program, the mesh axes jaxcoll takes over (the others stay with XLA's
      partitioner, reported); None: every axis the inputs are split on; () runs no global
      program per device.
    in_shardings: the inputs' layouts (NamedSharding or PartitionSpec leaves; a pytree
      prefix of ``(args, kwargs)``'s args, as ``jax.jit``'s), for abstract tracing.
    out_shardings: the outputs' layouts (a pytree prefix of the outputs); None: as the
      step computes them (a jitted ``fun``'s own ``out_shardings`` where it has them).
    strict: refuse (ValueError naming the equation and its source line) an equation whose
      split inputs have no per-device rule, instead of gathering them whole.
    collective_matmul: where a global program gathers an operand of a matmul over one axis,
      or reduce-scatters a matmul's sum, run the pair as :func:`jaxcoll.all_gather_matmul`
      or :func:`jaxcoll.matmul_reduce_scatter` (ring steps each beside a partial matmul,
      which a GPU runs at once; a sum headed whole too, as :func:`jaxcoll.matmul_all_reduce`,
      where a schedule was asked); None: where the backend the step is compiled for runs transfers
      beside compute (not the CPU, whose collectives are synchronous). Never for a
      collective sent on a lossy wire, or asked for an algorithm other than a ring.

  Returns:
    The function, same pytrees in and out; ``.lower(*args)`` lowers it as that call runs,
    from arrays or their ``jax.ShapeDtypeStruct``s with shardings (ahead of time, for a
    machine the caller is not on); ``.lower(*args).compile()`` is called as the function.

  Raises:
    ValueError: an axis not in the mesh, shardings that are no prefix of the arguments,
      ``axes`` leaving out a shard_map's axes, inputs on different meshes (at the call),
      an equation refused under ``strict``. TypeError: ``fun`` that is not callable, a
      ``strict`` or ``collective_matmul`` that is no bool.

  Example:
    >>> step = jaxcoll.use(train_step, algorithm="ring")   # doctest: +SKIP
    >>> params, loss = step(params, batch)   # arrays laid out on a mesh   # doctest: +SKIP
  """
  opts = Options(algorithm, wire_dtype, profile, axes, in_shardings, out_shardings, strict,
                 collective_matmul)
  if fun is None:
    return lambda f: rewrite(_callable(f), opts)
  return rewrite(_callable(fun), opts)


def _callable(fun):
  if not callable(fun):
    raise TypeError(f"use(fun={fun!r}): expected a callable (a function, a jax.jit-ed "
                    "function, a flax apply), not a " + type(fun).__name__)
  return fun
