"""Diagnostic: time one dtp-apply-like step (sharded model, SGD) per rank with barriers, and profile ops."""
import contextlib, statistics, sys, time, json
import torch, torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel
from dtp import models
from dtp.checks.checker import checked_for
from dtp.lang.parse import load
from dtp.runtime.build import build_sharded
from dtp.runtime.mesh import make_mesh
from dtp.runtime.ranks import on_ranks
from dtp.verify.reference import MixedSGD, cross_entropy, logits_of

def work(rank, world, spec, steps, prof):
    mesh = make_mesh(world, 1, "cpu")
    plan = load("plans/gpt2.tp")
    source = models.resolve(spec)
    full = models.build(source, device="cpu", dtype=torch.float32) if rank == 0 else None
    meta = models.build(source, device="meta", dtype=torch.float32)
    checked = checked_for(plan, meta, world)
    applied = build_sharded(checked, source, mesh, seed=0, device=torch.device("cpu"), dp=1, dtype=torch.float32,
                            full=full, from_rank0=True, plain=True)
    model = applied.model.train()
    vocab = models.vocab_size(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (8, 129), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    opt = MixedSGD(model, 0.1)
    ctx = loss_parallel if applied.loss_parallel else contextlib.nullcontext
    def step():
        with ctx():
            loss = cross_entropy(logits_of(model(x)), y)
            loss.backward()
        opt.step(); opt.zero_grad()
    fb, times = [], []
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        with ctx():
            loss = cross_entropy(logits_of(model(x)), y)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        opt.step(); opt.zero_grad()
        t3 = time.perf_counter()
        if i >= 1:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    out = {"rank": rank, "median_ms": [1e3 * statistics.median(c) for c in zip(*times)]}
    if prof:
        from torch.profiler import profile, ProfilerActivity
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as p:
            step()
        dist.barrier()
        ka = p.key_averages()
        rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)
        out["ops"] = [(e.key, e.count, e.self_cpu_time_total / 1e3, e.cpu_time_total / 1e3) for e in rows[:45]]
        out["nops"] = sum(e.count for e in ka if e.key.startswith("aten::"))
    return out

if __name__ == "__main__":
    spec, tp, steps, prof = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    import os
    print("load", os.getloadavg())
    res = on_ranks(work, tp, spec, steps, prof, timeout=900)
    for r in res:
        print(r["rank"], "total/fwd/bwd/opt ms", [round(v, 1) for v in r["median_ms"]])
    if prof:
        print("aten ops", res[0]["nops"])
        for k, c, s, t in res[0]["ops"]:
            print(f"{k:55s} {c:5d} self {s:8.2f} ms  total {t:8.2f}")
    print("load", os.getloadavg())
