"""A snapshot of what jaxcoll decides and builds, to show that a refactor changes nothing.

Three parts, each a dict from a case to a digest:

- ``auto``: auto's pick (``jaxcoll.tools.decide``, the one decision, its label) for every
  preset profile, primitive, 12 mesh shapes (1 to 3 axes, 2 to 64 devices), 5 message
  sizes, with and without native allowed: 6 x 7 x 12 x 5 x 2 = 5,040 cases (no device
  needed).
- ``programs``: the StableHLO (no debug locations) of every primitive x algorithm program,
  over one axis of 8 devices and over two axes (2, 4), plain and with an int8 wire where the
  primitive compresses; a case that raises records its error.
- ``use``: the StableHLO of ``jaxcoll.use`` (auto, and the ring forced) on each public
  program of ``tests/test_use_conformance.py`` (the pjit test models among them).

Run it on two checkouts and compare::

  git worktree add /tmp/before <commit>
  PYTHONPATH=/tmp/before python benchmarks/behaviour_snapshot.py --out /tmp/before.json
  python benchmarks/behaviour_snapshot.py --out /tmp/after.json --compare /tmp/before.json

``--compare`` lists every case whose digest differs and exits 1 if any does.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MESHES = ((2,), (3,), (4,), (5,), (8,), (16,), (64,), (2, 2), (2, 4), (4, 8), (8, 8),
          (2, 2, 2))
SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26)


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def auto_picks() -> dict:
  import jaxcoll
  from jaxcoll.tools import Call, Pricing, decide
  out = {}
  for name in jaxcoll.Profile.preset_names():
    pricing = Pricing(jaxcoll.Profile.preset(name))
    for primitive in jaxcoll.PRIMITIVES:
      for shape in MESHES:
        names = tuple("abc"[:len(shape)])
        for nbytes in SIZES:
          for native in (True, False):
            chosen = decide(Call(primitive, names, shape, nbytes, native_allowed=native),
                            "auto", pricing)
            out[f"{name}/{primitive}/{shape}/{nbytes}/native={native}"] = chosen.label
  return out


def _call(primitive, x, axes, algorithm, **extra):
  import jaxcoll
  kw = {"algorithm": algorithm, **extra}
  if primitive in ("reduce_scatter", "all_gather"):
    kw["tiled"] = True
  if primitive == "all_to_all":
    return jaxcoll.all_to_all(x, axes, 0, 0, tiled=True, **kw)
  return getattr(jaxcoll, primitive)(x, axes, **kw)


def programs() -> dict:
  import jaxcoll
  out = {}
  meshes = {"x8": jax.make_mesh((8,), ("x",)), "x2y4": jax.make_mesh((2, 4), ("x", "y"))}
  for mesh_name, mesh in meshes.items():
    axes = tuple(mesh.axis_names)
    named = axes if len(axes) > 1 else axes[0]
    spec = P(axes)
    x = jax.ShapeDtypeStruct((8 * 64,), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, spec))
    for primitive in jaxcoll.PRIMITIVES:
      for algorithm in jaxcoll.algorithms(primitive):
        wires = [{}] + ([{"wire_dtype": "int8"}]
                        if primitive in ("all_reduce", "reduce_scatter", "all_gather") else [])
        for extra in wires:
          key = f"{mesh_name}/{primitive}/{algorithm}/{extra or 'plain'}"

          def body(v, primitive=primitive, algorithm=algorithm, extra=extra, named=named):
            return _call(primitive, v, named, algorithm, **extra)
          try:
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                      check_vma=False))
            out[key] = _digest(f.lower(x).as_text())
          except Exception as e:   # noqa: BLE001 - an error is a behaviour too
            out[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return out


def use_programs() -> dict:
  tests = Path(__file__).resolve().parent.parent / "tests"
  sys.path.insert(0, str(tests))
  import test_use_conformance as conformance

  import jaxcoll
  out = {}
  for name, case in conformance.PROGRAMS.items():
    mesh, step, args = case()
    context = mesh if isinstance(mesh, conformance._in_mesh_context) else jax.set_mesh(mesh)
    with context:
      for algorithm in ("auto", "ring"):
        used = jaxcoll.use(step, algorithm=algorithm)
        out[f"{name}/{algorithm}"] = _digest(used.lower(*args).as_text())
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="where to write the snapshot (JSON)")
  parser.add_argument("--compare", help="a snapshot to compare against")
  parser.add_argument("--parts", default="auto,programs,use",
                      help="comma-separated parts to take (default: all)")
  args = parser.parse_args(argv)
  makers = {"auto": auto_picks, "programs": programs, "use": use_programs}
  parts = args.parts.split(",")
  unknown = set(parts) - set(makers)
  if unknown:
    parser.error(f"--parts: unknown {sorted(unknown)}; expected names from {sorted(makers)}")
  snapshot = {"jax": jax.__version__, **{p: makers[p]() for p in parts}}
  Path(args.out).write_text(json.dumps(snapshot, indent=1, sort_keys=True))
  print(", ".join(f"{p}: {len(snapshot[p])} cases" for p in parts))
  if not args.compare:
    return 0
  before = json.loads(Path(args.compare).read_text())
  differ = 0
  for p in parts:
    old, new = before.get(p, {}), snapshot[p]
    for key in sorted(set(old) | set(new)):
      if old.get(key) != new.get(key):
        differ += 1
        print(f"{p} {key}: {old.get(key)} -> {new.get(key)}")
  print(f"{differ} cases differ")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
