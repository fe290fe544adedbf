"""JAX data-parallel training steps on CPU with jaxcoll, the counterpart of
bench_ddp_torch.py (the same models, batches and timing loop: ddpcommon.py). One rank of
a job started by benchmarks/bench_vs_ddp.py through ``jaxcoll.launch`` (or plain
``jax.distributed.initialize``):

    python -m jaxcoll.launch -n 2 --devices-per-process 4 -- python bench_dp_jax.py
    python bench_dp_jax.py --local-devices 1          # 1 rank: compute alone

The step (params, opt_state, batch) -> (params, opt_state, ()) is written for one device
and run with ``jaxcoll.data_parallel(step, mesh, "data", donate_argnums=(0,))`` over all
devices (one axis "data", process-major: every device is one gloo rank with its own batch
rows). Step: jax.grad of the loss, the sync, SGD (p - lr g), in one jit. Variants:

  nosync   no collective (each device keeps its own update): the compute alone, the
           baseline the sync time is measured from (a plain shard_map: data_parallel
           rightly refuses a step whose output differs between devices)
  sync     ``jaxcoll.sync_gradients(g, "data")``: default settings (DDP's buckets, auto)
  int8_ef  ``optax.chain(jaxcoll.optax.sync("data", wire_dtype="int8"), optax.sgd(lr))``:
           int8 on the wire with error feedback
  pmean    per-leaf ``lax.pmean`` (what jax.grad under pjit inserts)

A round runs every variant once (order rotated); per step: a jitted 1-element psum as
barrier (untimed), then the step + block_until_ready timed; a step's time is the max over
processes. Then, for every all_reduce the synced steps trace (one per bucket,
``jaxcoll.extend.recording``), that all_reduce alone on the same bytes, timed the same way,
beside the cost model's prediction for it (``jaxcoll.explain``: what auto priced), the
buckets timed like the steps (rotated rounds, untimed barriers, the same reps rule).
Checks: sync's weights after one step equal pmean's within float tolerance (int8_ef's
within its wire bound); sum(w^2) after 3 synced steps (bench_ddp_torch.py prints it too).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import ddpcommon as C
import numpy as np

VARIANTS = ("nosync", "sync", "int8_ef", "pmean")


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--local-devices", type=int, default=None,
                 help="devices of this process (rewrites what the launcher set)")
  p.add_argument("--calibrate", default=None, metavar="PROFILE_JSON",
                 help="also price every bucket with a profile measured on this job's mesh "
                      "(jaxcoll.calibrate of all_reduce at its default sizes, saved here; an "
                      "existing file is loaded): the steps still run with the defaults")
  C.add_common_args(p)
  a = p.parse_args()
  if a.local_devices is not None or "JAXCOLL_COORDINATOR" not in os.environ:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count="
                               f"{a.local_devices or 1}").strip()
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  from jaxcoll import distributed
  from jaxcoll.extend import recording
  if distributed.launched():
    distributed.initialize()

  devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  R, nproc = len(devs), jax.process_count()
  mesh = Mesh(np.array(devs), ("data",))
  rep_sh, dat_sh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  variants = [v for v in (a.variants or "nosync,sync,int8_ef").split(",")
              if v and (R > 1 or v == "nosync")]
  for v in variants:
    if v not in VARIANTS:
      raise SystemExit(f"--variants: {v!r} is not one of {VARIANTS}")
  calibrated = None
  if a.calibrate and os.path.exists(a.calibrate):
    calibrated = jaxcoll.Profile.load(a.calibrate)

  def calibrate():
    """The profile measured on this mesh, once the first model's steps have run: in the
    conditions the buckets alone are timed in (measured at the job's start, before any step,
    it priced 2-rank int8 buckets at 0.55-0.71x their time; after the steps, 0.81-1.03)."""
    t0 = time.perf_counter()
    profile = jaxcoll.calibrate(mesh, primitives=("all_reduce",), progress=False)
    if jax.process_index() == 0:
      profile.save(a.calibrate)
      print(f"  calibrated in {time.perf_counter() - t0:.0f} s: {a.calibrate}", flush=True)
    return profile
  tx_int8 = optax.chain(jaxcoll.optax.sync("data", wire_dtype="int8"), optax.sgd(a.lr))

  def loss_fn(model):
    return lambda ps, x: C.loss(model, ps, x, jnp.tanh)

  bar_f = jax.jit(jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh,
                                in_specs=P("data"), out_specs=P("data")))
  bar_x = jax.make_array_from_callback((R,), dat_sh, lambda i: np.ones(1, np.float32))

  def barrier():
    bar_f(bar_x).block_until_ready()

  def allmax(ts):
    if nproc == 1:
      return list(map(float, ts))
    allt = np.asarray(multihost_utils.process_allgather(np.array(ts, np.float64)))
    return list(map(float, np.max(allt.reshape(nproc, -1), axis=0)))

  def agree_min(v):
    if nproc == 1:
      return v
    return int(np.min(multihost_utils.process_allgather(np.array([v]))))

  def place_params(model):
    return [jax.make_array_from_callback(v.shape, rep_sh, lambda i, v=v: v[i])
            for v in C.init_params(model)]

  def to_host(ps):   # replicated: this process's first shard is the whole value
    return [np.asarray(q.addressable_shards[0].data) for q in ps]

  def make_step(v, loss):
    def step(params, opt_state, xb):
      g = jax.grad(loss)(params, xb)
      if v == "int8_ef":
        updates, opt_state = tx_int8.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ()
      if v == "sync":
        g = jaxcoll.sync_gradients(g, "data")
      elif v == "pmean":
        g = [lax.pmean(x, "data") for x in g]
      return [q - a.lr * gq for q, gq in zip(params, g)], opt_state, ()
    if v == "nosync":
      return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                                   out_specs=P(), check_vma=False), donate_argnums=(0,))
    return jaxcoll.data_parallel(step, mesh, "data", donate_argnums=(0,))

  def alone(nbytes, algorithm, wire):
    """One all_reduce of ``nbytes`` per device by ``algorithm``, alone: a call that runs it."""
    n = nbytes // 4
    x = jax.make_array_from_callback((R * n,), dat_sh, lambda i: np.ones(n, np.float32))
    f = jax.jit(jax.shard_map(
        lambda u: jaxcoll.all_reduce(u, "data", algorithm=algorithm, wire_dtype=wire),
        mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    return lambda: f(x).block_until_ready()

  rows, checks, buckets = [], {}, []
  for model in a.models.split(","):
    xg = C.global_batch(model, R, a.batch)
    x = jax.make_array_from_callback(xg.shape, dat_sh, lambda i, xg=xg: xg[i])
    loss = loss_fn(model)
    fns, state, info, traced = {}, {}, {}, {}
    for v in variants:
      f = make_step(v, loss)
      ps = place_params(model)
      opt = tx_int8.init(ps) if v == "int8_ef" else ()
      t0 = time.perf_counter()
      with recording() as lines:
        txt = f.lower(ps, opt, x).compile().as_text()
      traced[v] = [ln for ln in lines if ln.kind == "jaxcoll"]
      info[v] = {"compile_s": round(time.perf_counter() - t0, 2),
                 "all_reduce_ops": len(re.findall(r"\ball-reduce(?:-start)?\(", txt)),
                 "collective_permutes": len(re.findall(
                     r"\bcollective-permute(?:-start)?\(", txt))}
      fns[v], state[v] = f, (ps, opt)

    def run(v, fns=fns, state=state, x=x):
      ps, opt = state[v]
      ps, opt, _ = fns[v](ps, opt, x)
      jax.block_until_ready(ps)
      state[v] = (ps, opt)
    ts = C.timed(variants, run, barrier, agree_min, a)
    for v in variants:
      i = info[v]
      picks = [f"{ln.nbytes} B: {ln.algorithm}" for ln in traced[v]]
      rows.append({"model": model, "variant": v, **C.summary(allmax(ts[v])),
                   "info": f"HLO all-reduce {i['all_reduce_ops']}, collective-permute "
                           f"{i['collective_permutes']}, compile {i['compile_s']} s"
                           + (f"; buckets {picks}" if picks else ""), **i})
    if a.calibrate and calibrated is None:
      calibrated = calibrate()
    # every bucket alone, timed as the steps are (rotated rounds): measured beside predicted
    alone_rows, calls = [], {}
    for v in ("sync", "int8_ef"):
      if v not in variants:
        continue
      wire = "int8" if v == "int8_ef" else None
      for i, ln in enumerate(traced[v]):
        shape = jax.ShapeDtypeStruct((ln.nbytes // 4,), jnp.float32)

        def priced(profile, shape=shape, wire=wire, ln=ln):   # (explanation, what ran's time)
          e = jaxcoll.explain("all_reduce", shape, mesh, "data", profile, wire_dtype=wire)
          return e, next(r.predicted_s for r in e.rows if r.algorithm == ln.algorithm)
        e, predicted = priced(None)
        row = {"model": model, "variant": v, "nbytes": ln.nbytes, "algorithm": ln.algorithm,
               "auto_chose": e.chosen, "profile": e.profile, "links": e.links,
               "predicted_s": predicted}
        if calibrated is not None:
          c, row["calibrated_s"] = priced(calibrated)
          row["calibrated_chose"] = c.chosen
        calls[f"{v}{i}"] = alone(ln.nbytes, ln.algorithm, wire)
        alone_rows.append(row)
    if calls:
      ts = C.timed(list(calls), lambda k, calls=calls: calls[k](), barrier, agree_min, a)
      for row, k in zip(alone_rows, calls):
        row["measured_s"] = float(np.median(allmax(ts[k])))
        row["ratio"] = row["predicted_s"] / row["measured_s"]
      buckets += alone_rows
    # checks: one step of each sync from the same start against per-leaf pmean
    ref_f = make_step("pmean", loss)
    ref = to_host(ref_f(place_params(model), (), x)[0])
    for v in variants:
      if v == "nosync":
        continue
      ps = place_params(model)
      out = to_host(fns[v](ps, tx_int8.init(ps) if v == "int8_ef" else (), x)[0])
      checks[f"{model}: max|{v} - pmean| after 1 step"] = float(max(
          np.abs(p_ - q_).max() for p_, q_ in zip(out, ref)))
    ps = place_params(model)
    for _ in range(3):
      ps = ref_f(ps, (), x)[0]
    checks[f"{model}: sum(w^2) after 3 synced steps (pmean)"] = float(sum(
        np.square(q.astype(np.float64)).sum() for q in to_host(ps)))
    if jax.process_index() == 0:
      print(f"  done {model}", flush=True)
  if jax.process_index() == 0:
    meta = {"framework": "jax", "version": jax.__version__, "procs": nproc,
            "devices_per_proc": R // nproc, "ranks": R, "batch_per_rank": a.batch,
            "XLA_FLAGS": os.environ.get("XLA_FLAGS"), "cpu_count": os.cpu_count(),
            "gloo_local_address": os.environ.get("JAXCOLL_LOCAL_ADDRESS"),
            "nice": os.nice(0), "checks": checks, "buckets": buckets}
    C.report(a, f"# jax {jax.__version__} + jaxcoll {jaxcoll.__version__}, {nproc} "
                f"process(es) x {R // nproc} device(s) = {R} ranks, batch {a.batch}/rank "
                f"{a.label}", rows, meta)
    for b in buckets:
      cal = (f", calibrated {b['calibrated_s'] * 1e3:.1f} ms (ratio "
             f"{b['calibrated_s'] / b['measured_s']:.2f})" if "calibrated_s" in b else "")
      print(f"# bucket {b['model']} {b['variant']} {b['nbytes']} B {b['algorithm']}: predicted "
            f"{b['predicted_s'] * 1e3:.1f} ms, measured alone {b['measured_s'] * 1e3:.1f} ms, "
            f"ratio {b['ratio']:.2f}{cal}", flush=True)
    for k, v in checks.items():
      print(f"# check {k}: {v}", flush=True)
  barrier()
  return 0


if __name__ == "__main__":
  sys.exit(main())
