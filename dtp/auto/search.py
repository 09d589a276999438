"""`dtp search`: the best layout of a model on a cluster, priced by `dtp simulate` on the auto plan.

Candidates: tp over the powers of two that divide the job (within a node first: a tp that crosses
nodes is priced too, on the slower link), dp the rest; data parallelism as DDP or FSDP; sequence
parallelism on or off; recomputation none, selective, per-op or full; micro-batches that divide the
batch. Each is priced with the plan `dtp plan --auto` writes for its tp (and sequence parallelism),
on the simulator's own model; what does not fit the profile's memory is dropped with its size; the
rest are ranked by predicted iteration time. `commands` writes the shell lines that run the winner as
it was priced: its plan, then `dtp train` with every flag of the layout.
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
from dataclasses import dataclass

import torch.nn as nn

from dtp.auto.planner import auto_plan
from dtp.errors import PlanError, UsageError
from dtp.files import write_text
from dtp.simulate.model import Run, simulate
from dtp.simulate.prepare import Prepared

GiB = 1024**3
RECOMPUTE = ("none", "selective", "op", "full")
# bf16 first: the same tensor-core rate as fp16 without loss scaling; fp32 only as the last resort
HALF_FIRST = ("bf16", "fp16", "fp32")
PLAN_FILE = "plan.tp"  # the file the printed `dtp plan` writes and `dtp train` reads


@dataclass(frozen=True)
class Job:
    """What is searched for: one model on `gpus` accelerators, an iteration of `global_batch`
    sequences of `seq` tokens at `precision`."""

    model: str  # as the user named it: the printed commands name it the same way
    gpus: int
    seq: int
    global_batch: int
    precision: str
    # the profile as the user named it: training on that machine predicts on it too
    profile: str | None = None


@dataclass(frozen=True)
class Candidate:
    """One layout and what the simulator predicts for it."""

    tp: int
    dp: int
    micro_batch: int
    sequence_parallel: bool
    recompute: str
    fsdp: bool
    iteration_s: float
    tflops_per_gpu: float
    memory_gib: float
    fits: bool
    parts: dict  # seconds: compute, tp_comm, dp_comm, optimizer
    plan: str  # the auto plan's text

    def key(self) -> str:
        """The layout in one phrase."""
        dp = f"{'FSDP' if self.fsdp else 'DDP'} {self.dp}"
        return (
            f"tp {self.tp} × {dp}, mb {self.micro_batch}, sp "
            f"{'on' if self.sequence_parallel else 'off'}, "
            f"recompute {self.recompute}"
        )

    @property
    def dp_mode(self) -> str:
        """`dtp train --dp-mode`'s word for this layout's data parallelism."""
        return "fsdp" if self.fsdp else "ddp"

    def to_json(self) -> dict:
        """The candidate as JSON (the plan text included)."""
        return {
            "tp": self.tp,
            "dp": self.dp,
            "micro_batch": self.micro_batch,
            "fsdp": self.fsdp,
            "sequence_parallel": self.sequence_parallel,
            "recompute": self.recompute,
            "iteration_s": self.iteration_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "memory_gib": self.memory_gib,
            "fits": self.fits,
            "seconds": self.parts,
            "plan": self.plan,
        }


def default_precision(profile) -> str:
    """The profile's best half precision: bf16 where it has a rate for it, else fp16 (V100), else
    fp32 (a CPU profile from `dtp simulate --calibrate` has only fp32)."""
    return next(p for p in HALF_FIRST if p in profile.peak_tflops)


def tp_values(gpus: int, per_node: int, limit: int = 64) -> list[int]:
    """Powers of two dividing the job, those within a node first, up to `limit`."""
    out = [t for t in (1 << i for i in range(13)) if t <= min(gpus, limit) and gpus % t == 0]
    return sorted(out, key=lambda t: (t > per_node, t))


def search(
    model: nn.Module,
    job: Job,
    profile,
    *,
    micro_batches: list[int],
    dp_modes: tuple[str, ...],
    log=None,
) -> list[Candidate]:
    """Every layout priced; feasible ones first, fastest first."""
    out: list[Candidate] = []
    with tempfile.TemporaryDirectory(prefix="dtp-search-") as scratch:
        for tp in tp_values(job.gpus, profile.gpus_per_node):
            dp = job.gpus // tp
            for sp in (False, True) if tp > 1 else (False,):
                found = auto_plan(model, job.model, tp, sp, scan=False)
                if tp not in found.checked_tp or (sp and not _has_sequence(found.text)):
                    # the plan cannot be written for this tp (or without sequence parallelism)
                    continue
                path = os.path.join(scratch, f"tp{tp}{'-sp' if sp else ''}.tp")
                write_text(path, found.text)
                try:
                    prepared = Prepared(path, job.model, job.seq)
                except (PlanError, UsageError):
                    continue
                if log:
                    log(f"priced: tp {tp}{' with sequence parallelism' if sp else ''}")
                for mb in micro_batches:
                    if job.global_batch % (mb * dp):
                        continue
                    work = prepared.workload(tp, mb, job.precision)
                    for fsdp in (m == "fsdp" for m in dp_modes):
                        if fsdp and dp == 1:
                            continue
                        for recompute in RECOMPUTE:
                            run = Run(
                                tp,
                                dp,
                                mb,
                                job.global_batch,
                                prepared.seq,
                                job.precision,
                                recompute,
                                "adam",
                                profile.dp_overlap,
                                fsdp=fsdp,
                            )
                            r = simulate(work, run, profile)
                            parts = {
                                "compute": r.compute_s,
                                "tp_comm": r.tp_comm_s,
                                "dp_comm": r.dp_comm_s,
                                "optimizer": r.optimizer_s,
                            }
                            out.append(
                                Candidate(
                                    tp,
                                    dp,
                                    mb,
                                    sp,
                                    recompute,
                                    fsdp,
                                    r.iteration_s,
                                    r.tflops_per_gpu,
                                    r.memory.total / GiB,
                                    r.memory.fits,
                                    parts,
                                    found.text,
                                )
                            )
    return sorted(out, key=lambda c: (not c.fits, c.iteration_s))


def _has_sequence(text: str) -> bool:
    return "sequence_parallel" in text and "# Without sequence parallelism" not in text


def why_lost(loser: Candidate, best: Candidate, capacity_gib: float) -> str:
    """Why `loser` is not the choice: it does not fit, or the part of its iteration that grew most."""
    if not loser.fits:
        return f"does not fit: {loser.memory_gib:.1f} GiB > {capacity_gib:.0f} GiB"
    slower = loser.iteration_s / best.iteration_s - 1
    grew = max(loser.parts, key=lambda k: loser.parts[k] - best.parts.get(k, 0.0))
    delta = loser.parts[grew] - best.parts.get(grew, 0.0)
    words = {
        "compute": "more compute (recomputation, smaller GEMMs or fewer ranks per GEMM)",
        "tp_comm": "more tensor-parallel communication",
        "dp_comm": "more exposed data-parallel communication",
        "optimizer": "a longer optimizer step",
    }
    return f"{slower:+.1%}: {words[grew]}, +{delta * 1e3:.0f} ms"


def plan_argv(best: Candidate, job: Job) -> list[str]:
    """`dtp plan --auto` for the winner's tp (and its sequence parallelism, which only the plan
    carries)."""
    sp = ["--sequence-parallel"] if best.sequence_parallel else []
    return ["dtp", "plan", "--auto", job.model, "--tp", str(best.tp), *sp, "-o", PLAN_FILE]


def train_argv(best: Candidate, job: Job) -> list[str]:
    """`dtp train` with every flag the simulator priced: a flag left to its default would train
    another layout than the one ranked first."""
    flags = {
        "--tp": best.tp,
        "--dp": best.dp,
        "--dp-mode": best.dp_mode,
        "--batch": job.global_batch,  # global: each of the dp ranks takes batch / dp
        "--micro-batch": best.micro_batch,
        "--seq": job.seq,
        "--recompute": best.recompute,
        "--precision": job.precision,
    }
    if job.profile:  # train sets the simulator's prediction for this layout beside its measurement
        flags["--profile"] = job.profile
    pairs = [word for flag, value in flags.items() for word in (flag, str(value))]
    return ["dtp", "train", PLAN_FILE, job.model, *pairs]


def launch(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of a job: as few nodes as hold it, the same number of ranks on each
    (torchrun starts --nproc-per-node on every node); a UsageError where no even split exists."""
    nodes = math.ceil(gpus / gpus_per_node)
    if gpus % nodes:
        raise UsageError(
            f"{gpus} GPUs do not split evenly over {nodes} nodes of {gpus_per_node}; torchrun "
            "starts the same number of ranks on every node"
        )
    return nodes, gpus // nodes


def commands(best: Candidate, job: Job, gpus_per_node: int) -> list[str]:
    """The shell lines that run the winner, quoted to run as printed: its plan, then training. One
    node: `dtp train` starts its own local ranks; more: torchrun, run on every node."""
    train = train_argv(best, job)
    nodes, per_node = launch(job.gpus, gpus_per_node)
    if nodes > 1:  # `torchrun -m dtp train …`: the module in place of the console script
        torchrun = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "-m"]
        train = torchrun + train
    return [shlex.join(plan_argv(best, job)), shlex.join(train)]
