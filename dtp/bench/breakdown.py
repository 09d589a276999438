"""`dtp bench --profile`: where each arm's step time goes, from torch.profiler on rank 0 — self CPU
time grouped into GEMMs, communication (issuing and waiting), DTensor's machinery (subclass
dispatch, sharding propagation, redistribution, wrapping) and the rest. Self times under contention
are inflated, but every arm is profiled in the same process group and the shares compare."""

from __future__ import annotations

import warnings

import torch

from dtp.bench.arms import ARMS
from dtp.bench.scaling import Config, inputs

GROUPS = {  # substring of the profiler's row name → group; first match wins
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm"),
    "communication": (
        "c10d",
        "allreduce",
        "all_reduce",
        "allgather",
        "all_gather",
        "reduce_scatter",
        "wait_tensor",
    ),
    "dtensor": (
        "PythonSubclass",
        "FromTorchTensor",
        "ToTorchTensor",
        "Redistribute",
        "sharding_prop",
        "DTensor",
        "propagate",
    ),
}
# self time: the collective
MEGATRON_COMM = {"_F", "_FBackward", "_G", "_GBackward", "_Scatter", "_ScatterBackward"}


def group_of(name: str) -> str:
    """The group a profiler row belongs to."""
    if name in MEGATRON_COMM:
        return "communication"
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "other"


def profile(rank: int, world: int, cfg: Config, steps: int = 3) -> dict:
    """Rank 0's self CPU milliseconds per step by group and the top rows, for every arm of `cfg`."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    given = inputs(world, cfg)
    arms = {name: ARMS[name](given) for name in cfg.arms}
    out: dict = {}
    for name, arm in arms.items():
        arm.step()  # warm-up (and compilation)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                arm.step()
        groups: dict[str, float] = {}
        rows = []
        for e in prof.key_averages():
            ms = e.self_cpu_time_total / 1e3 / steps
            groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + ms
            rows.append((ms, e.key, e.count // steps))
        rows.sort(reverse=True)
        out[name] = {
            "self_cpu_ms_per_step": groups,
            "total_ms_per_step": sum(groups.values()),
            "top": [{"name": k, "ms": ms, "calls": c} for ms, k, c in rows[:12]],
        }
    return out


def table(result: dict) -> str:
    """Markdown: one row per arm, ms per step and share by group."""
    keys = ("gemm", "communication", "dtensor", "other")
    lines = ["| arm | total ms/step | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, r in result.items():
        g, total = r["self_cpu_ms_per_step"], r["total_ms_per_step"]
        cells = " | ".join(f"{g.get(k, 0.0):.0f} ({g.get(k, 0.0) / total:.0%})" for k in keys)
        lines.append(f"| {name} | {total:.0f} | {cells} |")
    return "\n".join(lines)
