"""PyTorch data-parallel training steps on CPU (gloo): DDP against no sync and against a
per-parameter all_reduce, for the models of ddpcommon.py. One worker of P; the driver,
benchmarks/bench_vs_ddp.py, starts P of them (``--num-processes P --process-id i --coord
ADDR:PORT``, ``OMP_NUM_THREADS=1`` as torchrun sets it):

    OMP_NUM_THREADS=1 python bench_ddp_torch.py          # 1 rank: compute alone

Variants (each its own copy of the model, all from the same initial values):
  local     forward, backward, SGD; no sync (each rank trains on its own batch)
  ddp       DistributedDataParallel(model) with its defaults (bucket_cap_mb=25, first
            bucket 1 MiB, gradient_as_bucket_view=False), SGD
  perparam  forward, backward, then dist.all_reduce(p.grad) for every parameter in turn
            (synchronous, one gloo collective each) and / P, SGD
A round runs every variant once (order rotated each round); per step: dist.barrier()
(untimed), then forward + backward (+ sync) + optimizer.step() timed; a step's time is the
max over ranks. After the timed rounds: replicas of ddp must be bit-equal across ranks, and
ddp's and perparam's weights (same number of steps from the same start) must agree; and
sum(w^2) after 3 DDP steps from the initial values (bench_dp_jax.py prints the same).
Env GLOO_SOCKET_IFNAME picks gloo's interface (netns).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import ddpcommon as C
import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--coord", default="127.0.0.1:29500")
    C.add_common_args(p)
    a = p.parse_args()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    P, rank = a.num_processes, a.process_id
    if P > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{a.coord}", rank=rank,
                                world_size=P, timeout=datetime.timedelta(minutes=10))
    variants = [v for v in (a.variants or "local,ddp,perparam").split(",")
                if v and (P > 1 or v == "local")]

    class Net(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.ps = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in C.init_params(model)])

        def forward(self, x):
            return C.loss(self.model, list(self.ps), x, torch.tanh)

    def barrier():
        if P > 1:
            dist.barrier()

    def gather_max(ts):
        if P == 1:
            return ts
        allv = [None] * P
        dist.all_gather_object(allv, ts)
        return list(map(float, np.max(np.array(allv), axis=0)))

    def agree_min(v):
        if P == 1:
            return v
        t = torch.tensor([v], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    rows, checks = [], {}
    for model in a.models.split(","):
        xg = C.global_batch(model, P, a.batch)
        x = torch.from_numpy(xg[rank * a.batch:(rank + 1) * a.batch].copy())
        nets, steps, info = {}, {}, {}
        for v in variants:
            net = Net(model)
            mod = DDP(net) if v == "ddp" else net
            opt = torch.optim.SGD(mod.parameters(), lr=a.lr)
            nets[v] = (net, mod)

            def step(mod=mod, opt=opt, v=v, x=x):
                opt.zero_grad()
                loss = mod(x)
                loss.backward()
                if v == "perparam":
                    for q in mod.parameters():
                        dist.all_reduce(q.grad)
                        q.grad.div_(P)
                opt.step()
                return loss
            steps[v] = step
        ts = C.timed(variants, lambda v, steps=steps: steps[v](), barrier, agree_min, a)
        if "ddp" in nets:   # DDP's logger samples iterations: read it after the timed ones
            d = nets["ddp"][1]._get_ddp_logging_data()
            info["ddp"] = (f"{d.get('num_buckets_reduced')} buckets, bytes "
                           f"[{d.get('rebuilt_bucket_sizes')}] (before rebuild "
                           f"[{d.get('bucket_sizes')}]), cap {d.get('bucket_cap_bytes')}")
        for v in variants:
            row = {"model": model, "variant": v, **C.summary(gather_max(ts[v])),
                   "info": str(info.get(v, ""))}
            rows.append(row)
        # checks: ddp replicas bit-equal across ranks; ddp == perparam (same steps)
        if P > 1 and "ddp" in nets:
            flat = torch.cat([q.detach().ravel() for q in nets["ddp"][0].parameters()])
            allv = [None] * P
            dist.all_gather_object(allv, float(flat.double().pow(2).sum()))
            checks[f"{model}: ddp sum(w^2) per rank"] = allv
            checks[f"{model}: ddp replicas equal"] = len(set(allv)) == 1
            if "perparam" in nets:
                f2 = torch.cat([q.detach().ravel() for q in nets["perparam"][0].parameters()])
                checks[f"{model}: max|ddp - perparam|"] = float((flat - f2).abs().max())
        # cross-framework check: sum(w^2) after 3 synced steps from the initial values
        net = Net(model)
        mod = DDP(net) if P > 1 else net
        opt = torch.optim.SGD(mod.parameters(), lr=a.lr)
        for _ in range(3):
            opt.zero_grad()
            mod(x).backward()
            opt.step()
        checks[f"{model}: sum(w^2) after 3 synced steps"] = float(sum(
            q.detach().double().pow(2).sum() for q in net.parameters()))
        if rank == 0:
            print(f"  done {model}", flush=True)
    if rank == 0:
        meta = {"framework": "torch", "version": torch.__version__, "procs": P,
                "devices_per_proc": 1, "ranks": P, "batch_per_rank": a.batch,
                "torch_threads": torch.get_num_threads(),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
                "nice": os.nice(0), "checks": checks}
        C.report(a, f"# torch {torch.__version__} gloo, {P} process(es) x 1 rank, "
                    f"{torch.get_num_threads()} intra-op thread(s), batch {a.batch}/rank "
                    f"{a.label}", rows, meta)
        for k, v in checks.items():
            print(f"# check {k}: {v}", flush=True)
    if P > 1:
        barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
