"""All-reduce as training calls it vs as calibrated: dist.all_reduce after a barrier, functional all_reduce
after a barrier, and functional all_reduce right after ~2 ms of compute (no barrier)."""
import os, statistics, sys, time
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
from dtp.runtime.ranks import on_ranks

def work(rank, world, sizes, reps):
    out = {}
    a = torch.randn(256, 256); b = torch.randn(256, 256)
    for size in sizes:
        t = torch.ones(size // 4)
        dist.all_reduce(t)
        r = {"plain": [], "functional": [], "after_compute": []}
        for _ in range(reps):
            dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(t); r["plain"].append(time.perf_counter() - t0)
        for _ in range(reps):
            dist.barrier(); t0 = time.perf_counter(); y = fc.all_reduce(t, "sum", dist.group.WORLD); y = fc.wait_tensor(y)
            r["functional"].append(time.perf_counter() - t0)
        for _ in range(reps):
            dist.barrier()
            for _ in range(15): a @ b   # ~1.5-2 ms of compute, different on each rank by jitter only
            t0 = time.perf_counter(); y = fc.all_reduce(t, "sum", dist.group.WORLD); y = fc.wait_tensor(y)
            r["after_compute"].append(time.perf_counter() - t0)
        out[size] = {k: statistics.median(v) for k, v in r.items()}
    return out

if __name__ == "__main__":
    print("load", os.getloadavg())
    sizes = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
    for world in (2, 4):
        res = on_ranks(work, world, sizes, 15, timeout=600)
        for s in sizes:
            print(world, s // 1024, "KiB", {k: round(max(r[s][k] for r in res) * 1e3, 3) for k in res[0][s]})
    print("load", os.getloadavg())
