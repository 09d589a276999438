import sys, contextlib, collections, time
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from dtp import models
from dtp.checks.checker import checked_for
from dtp.lang.parse import load
from dtp.runtime.shard import apply
tp = int(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
meta = models.build(models.resolve(sys.argv[1]), device="meta")
checked = checked_for(load("plans/gpt2.tp"), meta, tp)
applied = apply(checked, meta, mesh, 0, plain=True)
model = applied.model
class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.c = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = tree_flatten((args, kwargs or {}))[0]
        d = any(isinstance(t, DTensor) for t in flat)
        self.c[(self.phase, "dtensor" if d else "plain", "view" if getattr(func, "is_view", False) else "op")] += 1
        if d: self.c[(self.phase, "dt:" + str(func.overloadpacket))] += 1
        return func(*args, **(kwargs or {}))
ids = torch.zeros(8, 128, dtype=torch.long, device="meta")
ctx = loss_parallel if applied.loss_parallel else contextlib.nullcontext
m = Count()
t = time.time()
with m, ctx():
    m.phase = "fwd"
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    m.phase = "bwd"
    loss.backward()
print(time.time() - t)
for k, v in sorted(m.c.items()): print(k, v)
