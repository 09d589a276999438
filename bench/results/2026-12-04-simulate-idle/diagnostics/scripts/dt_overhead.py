import time, statistics, torch, torch.distributed as dist, os
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, Replicate, distribute_tensor
torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
x = DTensor.from_local(torch.ones(4, requires_grad=False), mesh, [Shard(0)])
p = torch.ones(4)
def per(fn, reps=2000):
    b = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps): fn()
        b.append((time.perf_counter() - t0) / reps)
    return statistics.median(b)
print("load", os.getloadavg())
print("plain add us", per(lambda: p + p) * 1e6)
print("dtensor add us", per(lambda: x + x) * 1e6)
print("dtensor mul scalar us", per(lambda: x * 2.0) * 1e6)
print("dtensor detach us", per(lambda: x.detach()) * 1e6)
loc = torch.ones(4, requires_grad=True)
print("from_local us", per(lambda: DTensor.from_local(loc, mesh, [Shard(0)], run_check=False)) * 1e6)
print("to_local us", per(lambda: x.to_local()) * 1e6)
xg = DTensor.from_local(torch.ones(4, requires_grad=True), mesh, [Shard(0)])
def fb():
    y = (xg * 2.0).sum()
    y.backward()
print("dtensor mul+sum fwd+bwd us", per(fb, 300) * 1e6)
pg = torch.ones(4, requires_grad=True)
def fb2():
    y = (pg * 2.0).sum(); y.backward()
print("plain mul+sum fwd+bwd us", per(fb2, 300) * 1e6)
