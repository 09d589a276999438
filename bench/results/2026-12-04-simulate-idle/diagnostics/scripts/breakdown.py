"""Per-op predicted ms (forward, backward) for a model at tp, from a profile."""
import sys, collections, dataclasses
from dtp.simulate.model import Run, simulate
from dtp.simulate.prepare import Prepared
from dtp.simulate.profile import load
from dtp.simulate.kernels import compute_parts
from dtp.simulate.flops import Flops
prof = load(sys.argv[1])
extra = dict(a.split("=") for a in sys.argv[4:])
if extra:
    prof = dataclasses.replace(prof, op_GBps=tuple(sorted({**dict(prof.op_GBps), **{k: float(v) for k, v in extra.items()}}.items())))
name, tp = sys.argv[2], int(sys.argv[3])
p = Prepared("plans/gpt2.tp", f"bench/results/2026-12-04-simulate-idle/diagnostics/scripts/{name}.yaml", 128)
w = p.workload(tp, 8, "fp32")
run = Run(tp, 1, 8, 8, 128, "fp32", "none", "sgd")
share = prof.share(tp)
agg = collections.Counter()
for op in w.flops.ops:
    c = compute_parts(Flops(w.flops.seq, (), (op,)), run, prof, share, shape=w.shape)
    key = op.name or op.kind
    agg[key, "f"] += 1e3 * (c.block_forward + c.other_forward)
    agg[key, "b"] += 1e3 * (c.block_backward + c.other_backward)
keys = sorted({k for k, _ in agg}, key=lambda k: -(agg[k, "f"] + agg[k, "b"]))
for k in keys:
    print(f"{k:20s} fwd {agg[k,'f']:7.2f} bwd {agg[k,'b']:7.2f}")
r = simulate(w, run, prof)
print(f"total {r.iteration_s*1e3:.1f} compute {r.compute_s*1e3:.1f} comm {r.tp_comm_s*1e3:.1f} opt {r.optimizer_s*1e3:.1f} share {share}")
