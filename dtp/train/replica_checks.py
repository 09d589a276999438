"""Replica consistency while training: the tp ranks' copies of every replicated tensor must stay
equal.

A replicated parameter whose gradient comes from a rank's own shard of an activation (Qwen3's q/k
norms under plain `replicate`) takes a different step on every rank: the copies drift apart while
the loss looks normal. dtp.runtime.replicas fingerprints every tp-replicated parameter and floating
buffer and compares them in one all-gather; this module decides when (after the run's first step,
every `--check-replicas` steps, before every checkpoint and at the end) and what a difference means.

On the CPU (gloo) the ranks run the same kernels on the same inputs, so replicas are bitwise equal
and any difference is a divergence. On CUDA some kernels are not bitwise deterministic (atomics in
scatter-style backward kernels), so copies may differ in their last bits without any error in the
plan: a difference up to `replica_rtol` (64 × eps of the parameter dtype, relative to the tensor's
largest value) is put back to the first rank's copy, so such noise cannot accumulate between checks;
a larger one is a divergence. A sharding bug moves replicas by about the learning rate per step,
orders of magnitude above that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dtp.runtime.replicas import Divergence, check_replicas, replica_rtol, replicated_tensors


def due(step: int, start: int, every: int, last: int) -> bool:
    """Whether to check after `step` (1-based): the last; with `every` > 0 also the run's first step
    (a plan whose replicas drift shows at once) and every `every` steps."""
    return step == last or (every > 0 and (step == start + 1 or step % every == 0))


@dataclass
class ReplicaChecks:
    """One rank's replica checks over its tp group, and what they found."""

    # the tp ranks; None at tp 1 (nothing is replicated across ranks)
    group: dist.ProcessGroup | None
    rtol: float
    # where the collectives' tensors live (NCCL: the rank's GPU)
    device: torch.device = torch.device("cpu")
    steps: list[int] = field(default_factory=list)  # the steps checked, in order
    tensors: int = 0  # replicated tensors compared at each check
    resynced: list[str] = field(default_factory=list)  # CUDA: tensors whose last bits were put back
    seconds: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)

    @classmethod
    def over(cls, mesh: DeviceMesh, model: nn.Module, device: torch.device) -> ReplicaChecks:
        """Checks over `mesh`'s tp dimension: bitwise on the CPU, within 64 · eps on CUDA
        (`replica_rtol`)."""
        names = mesh.mesh_dim_names or ()
        group = mesh["tp"].get_group() if "tp" in names and mesh["tp"].size() > 1 else None
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return cls(group, replica_rtol(device, dtype), device)

    def check(self, model: nn.Module, step: int) -> bool:
        """Compare every replicated tensor across the tp ranks after `step`; False when they
        diverged in any tp group (the same answer on every rank of the world, so every rank stops at
        the same step)."""
        if self.group is None:
            return True
        t0 = time.perf_counter()
        # every difference; what is tolerated is decided here
        found = check_replicas(model, self.group, rtol=0.0)
        noise = [d for d in found if self.rtol > 0 and d.rel <= self.rtol]
        if noise:
            self._resync(model, {d.name for d in noise})
        self.divergences = [d for d in found if d not in noise]
        self.steps.append(step)
        self.tensors = len(replicated_tensors(model))
        diverged = torch.tensor([float(bool(self.divergences))], device=self.device)
        # dp > 1: another tp group may have found it
        if dist.get_world_size() > dist.get_world_size(self.group):
            dist.all_reduce(diverged, op=dist.ReduceOp.MAX)
        self.seconds += time.perf_counter() - t0
        return not diverged.item()

    def _resync(self, model: nn.Module, names: set[str]) -> None:
        """Put the first tp rank's copy of each of `names` on every tp rank (CUDA rounding noise
        only)."""
        first = dist.get_process_group_ranks(self.group)[0]
        for _, name, local in replicated_tensors(model):
            if name in names:
                with torch.no_grad():
                    dist.broadcast(local, src=first, group=self.group)
                self.resynced.append(name)

    def record(self) -> dict:
        """What the summary and metrics keep: steps checked, tensors compared, the tolerance, the
        time."""
        return {
            "steps": self.steps,
            "tensors": self.tensors,
            "rtol": self.rtol,
            "checked": self.group is not None,
            "resynced": sorted(set(self.resynced)),
            "ms_per_check": 1e3 * self.seconds / len(self.steps) if self.steps else 0.0,
            "divergences": [
                {
                    "name": d.name,
                    "kind": d.kind,
                    "max_abs": d.max_abs,
                    "rel": d.rel,
                    "ranks": list(d.ranks),
                }
                for d in self.divergences
            ],
        }


def message(record: dict, step: int) -> str:
    """The paragraph a divergence stops the run with: the tensor, the step, the size, the fix."""
    found = sorted(
        record["divergences"], key=lambda o: -o["rel"] if o["rel"] == o["rel"] else -float("inf")
    )
    d = found[0]  # the most drifted first: the cause, usually; the rest drift because it did
    before = [s for s in record["steps"] if s < step]
    since = (
        f"equal at step {before[-1]}, the previous check"
        if before
        else "the first check of this run"
    )
    others = ""
    if len(found) > 1:
        names = ", ".join(o["name"] for o in found[1:4]) + (", …" if len(found) > 4 else "")
        others = f"; {len(found) - 1} other replicated tensor(s) differ too ({names})"
    if d["kind"] == "buffer":
        why = (
            "A buffer updated from each rank's own shard of an activation (a running statistic "
            "after a colwise "
            "layer) takes a different value on every rank; compute it where the activation is whole "
            "(after the "
            "rowwise layer), or keep that module unsharded"
        )
    else:
        why = (
            "A replicated parameter whose gradient comes from each rank's own shard of an "
            "activation (a per-head "
            "norm or gain after a colwise projection, a scalar on sharded features) gets a partial "
            "gradient and a "
            "different update on every rank; give its module `replicate(reduce_grad=true)` (the "
            "gradient summed "
            "over the tp ranks) or, for a norm over the whole projection, `sharded_norm`; plain "
            "`replicate` is "
            "right only for a module that reads full activations"
        )
    return (
        f"the tp ranks' copies of replicated tensors diverged at step {step} ({since}): {d['kind']} "
        ""
        f"{d['name']} differs on rank(s) {', '.join(map(str, d['ranks']))} from the first tp rank's "
        "copy by up "
        f"to {d['max_abs']:.3g} ({d['rel']:.3g} of its largest value){others}. {why}. The run was "
        "stopped "
        "before any checkpoint of the diverged model was saved"
    )


def line(record: dict) -> list[str]:
    """The summary's line for the replica checks (none at tp 1)."""
    if not record.get("checked"):
        return []
    how = "bitwise" if record["rtol"] == 0 else f"within {record['rtol']:.2g} relative"
    steps = record["steps"]
    shown = ", ".join(map(str, steps[:6])) + (f", … {steps[-1]}" if len(steps) > 6 else "")
    resynced = (
        f"; last-bit noise put back in {len(record['resynced'])}" if record["resynced"] else ""
    )
    return [
        f"  replicas: {record['tensors']} replicated tensors equal across the tp ranks ({how}) at "
        "steps "
        f"{shown} ({record['ms_per_check']:.1f} ms per check{resynced})"
    ]
