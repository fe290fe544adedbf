"""Which forms of a data-parallel gradient sum XLA's GPU scheduler hides, compiled for 8
H100s without a GPU (needs the CUDA plugin, as ``gpu_check.py --compile-only``).

The DP MLP of ``gpu_compile.py`` (8 layers of 2048 x 2048, 1024 rows a device), each
layer's weight gradient summed in a custom VJP (as ``sync_in_backward`` does) by: XLA's
``psum``; jaxcoll's ``direct`` reduce-scatter then all-gather (unrolled permutes); seven
independent permutes to i+1..i+7, summed; lax's ``psum_scatter`` then ``all_gather``.
Prints each program's collectives and the fraction of its transfer bytes with a GEMM
between start and done (``jaxcoll.tools.overlap``; docs/guide/overlap.md quotes it).

  JAX_PLATFORMS=cpu python benchmarks/gpu_overlap_forms.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_compile  # noqa: E402


def summed(kind: str, n: int):
  """The identity whose VJP sums the cotangent over "data" in the form ``kind``."""
  import jax

  import jaxcoll

  @jax.custom_vjp
  def ident(w):
    return w

  def bwd(_, g):
    if kind == "psum":
      return (jax.lax.psum(g, "data"),)
    if kind == "direct reduce_scatter + all_gather":
      s = jaxcoll.reduce_scatter(g, "data", tiled=True, algorithm="direct")
      return (jaxcoll.all_gather(s, "data", tiled=True, algorithm="direct"),)
    if kind == "lax psum_scatter + all_gather":
      return (jax.lax.all_gather(jax.lax.psum_scatter(g, "data", tiled=True), "data",
                                 tiled=True),)
    total = g   # independent permutes, summed
    for k in range(1, n):
      total = total + jax.lax.ppermute(g, "data", [(i, (i + k) % n) for i in range(n)])
    return (total,)
  ident.defvjp(lambda w: (w, None), bwd)
  return ident


def main() -> int:
  import jax
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  why = gpu_compile.available()
  if why is not None:
    print(f"skipped: {why}")
    return 0
  topology, n = gpu_compile.TOPOLOGIES["1x8"]
  layers, width, rows = gpu_compile.LAYERS, gpu_compile.WIDTH, gpu_compile.ROWS
  mesh = gpu_compile.topology_mesh(topology, (n,), ("data",))
  ws = [gpu_compile._typed(mesh, (width, width), P()) for _ in range(layers)]
  x = gpu_compile._typed(mesh, (n * rows, width), P("data"))
  print("| gradient sum | collectives | covered by GEMMs |")
  print("|---|---|---:|")
  for kind in ("psum", "direct reduce_scatter + all_gather", "independent permutes",
               "lax psum_scatter + all_gather"):
    def step(params, x, kind=kind):
      grads = jax.grad(lambda ps: gpu_compile.mlp([summed(kind, n)(w) for w in ps], x))(params)
      return [w - 0.01 * g for w, g in zip(params, grads)]
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=([P()] * layers, P("data")),
                               out_specs=[P()] * layers, check_vma=False))
    found = jaxcoll.tools.overlap(fn.lower(ws, x).compile())
    kinds = ", ".join(f"{v} {k}" for k, v in found.counts().items() if v)
    print(f"| {kind} | {kinds} | {found.covered:.2f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
