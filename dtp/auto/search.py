"""`dtp search`: the best layout of a model on a cluster, priced by `dtp simulate` on the auto plan.

Candidates: tp over the powers of two that divide the job (within a node first: a tp that crosses
nodes is priced too, on the slower link), dp the rest; data parallelism as DDP or FSDP; sequence
parallelism on or off; recomputation none, selective, per-op or full; micro-batches that divide the
batch. Each is priced with the plan `dtp plan --auto` writes for its tp (and sequence parallelism),
on the simulator's own model; what does not fit the profile's memory is dropped with its size; the
rest are ranked by predicted iteration time. `commands` writes the shell lines that run the winner as
it was priced: its plan, then `dtp train` with every flag of the layout.

`search_decode` (`dtp search --decode`) serves instead of training: each tp of a node (powers of two
dividing the job) decodes its own rows on gpus / tp replicas, its step priced by `dtp simulate
--decode`'s model (dtp.simulate.decode.decode_step) on the auto plan for that tp; `serving_pick`
chooses by the stated objective, `stops_paying` says where a larger tp buys too little.
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
from dataclasses import dataclass

import torch.nn as nn

from dtp import models
from dtp.auto.planner import auto_plan
from dtp.checks.checker import check
from dtp.errors import PlanError, UsageError
from dtp.files import write_text
from dtp.lang.parse import parse
from dtp.simulate import decode
from dtp.simulate.decode import DecodeStep, decode_step
from dtp.simulate.model import Run, simulate
from dtp.simulate.prepare import Prepared

GiB = 1024**3
RECOMPUTE = ("none", "selective", "op", "full")
# bf16 first: the same tensor-core rate as fp16 without loss scaling; fp32 only as the last resort
HALF_FIRST = ("bf16", "fp16", "fp32")
PLAN_FILE = "plan.tp"  # the file the printed `dtp plan` writes and `dtp train` reads
# a tp is worth its GPUs when it is more than this much faster (or serves more) than the choice
MEANINGFUL = 0.05
# `dtp generate`'s --dtype for each precision: it has no float16; bfloat16 moves the same bytes
GENERATE_DTYPE = {"bf16": "bfloat16", "fp16": "bfloat16", "fp32": "float32"}


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
    left_whole: tuple[str, ...] = ()  # "PATH: why" of each part the auto plan keeps replicated

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


def check_seq(model: nn.Module, name: str, seq: int) -> None:
    """A --seq beyond the positions the model's config states is a UsageError naming both, before
    anything is priced."""
    limit = models.max_sequence(model)
    if limit is not None and seq > limit:
        raise UsageError(
            f"--seq {seq} exceeds the block size of {name}: at most {limit} tokens per sequence"
        )


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
    """Every layout priced; feasible ones first, fastest first. Nothing priced because a tp's plan
    could not be is that pricing's own error (a UsageError), not an empty list."""
    out: list[Candidate] = []
    unpriced: list[str] = []  # why a tp's plan could not be priced
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
                except (PlanError, UsageError) as err:
                    unpriced.append(str(err).splitlines()[0])
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
                                    found.refused,
                                )
                            )
    if unpriced and not out:
        raise UsageError(f"no layout could be priced: {unpriced[0]}")
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


@dataclass(frozen=True)
class Serving:
    """What a decode search is for: `model` served on `gpus` accelerators, each replica decoding
    `batch` rows together with `context` tokens of KV cache per row."""

    model: str
    gpus: int
    batch: int
    context: int
    precision: str
    objective: str = "latency"  # or "throughput"


@dataclass(frozen=True)
class Replica:
    """One tp for decoding: gpus / tp replicas of tp GPUs, each decoding its own rows, and the step
    `dtp simulate --decode`'s model predicts for one of them."""

    tp: int
    replicas: int
    batch: int
    step: DecodeStep
    capacity_bytes: int  # the profile's memory per GPU
    plan: str  # the auto plan's text
    left_whole: tuple[str, ...] = ()

    @property
    def ms(self) -> float:
        """Per-token latency: one decode step."""
        return self.step.ms

    @property
    def tokens_per_s(self) -> float:
        """One replica's tokens per second over its rows."""
        return self.step.tokens_per_s(self.batch)

    @property
    def cluster_tokens_per_s(self) -> float:
        """Every replica's together."""
        return self.replicas * self.tokens_per_s

    @property
    def gpu_tokens_per_s(self) -> float:
        """Tokens per second per GPU: what each of the cluster's GPUs serves."""
        return self.tokens_per_s / self.tp

    @property
    def memory_bytes(self) -> int:
        """Weights and KV cache on the fullest GPU."""
        return self.step.weight_bytes + self.step.kv_bytes

    @property
    def memory_gib(self) -> float:
        """The same, in GiB."""
        return self.memory_bytes / GiB

    @property
    def fits(self) -> bool:
        """Weights and cache within the profile's memory per GPU."""
        return self.memory_bytes <= self.capacity_bytes

    def why_not_fit(self) -> str:
        """The sizes that do not fit, in GiB."""
        return (
            f"does not fit: {self.memory_gib:.1f} GiB (weights "
            f"{self.step.weight_bytes / GiB:.1f} + KV cache {self.step.kv_bytes / GiB:.1f}) > "
            f"{self.capacity_bytes / GiB:.0f} GiB"
        )

    def to_json(self) -> dict:
        """The candidate as JSON (the plan text included)."""
        return {
            "tp": self.tp,
            "replicas": self.replicas,
            "ms_per_token": self.ms,
            "tokens_per_s_per_replica": self.tokens_per_s,
            "tokens_per_s_cluster": self.cluster_tokens_per_s,
            "tokens_per_s_per_gpu": self.gpu_tokens_per_s,
            "memory_gib": self.memory_gib,
            "weight_gib": self.step.weight_bytes / GiB,
            "kv_cache_gib": self.step.kv_bytes / GiB,
            "collectives_per_token": self.step.collectives,
            "collectives_ms": self.step.comm_ms,
            "memory_ms": self.step.memory_ms,
            "fits": self.fits,
            "left_whole": list(self.left_whole),
            "plan": self.plan,
        }


def serving_tp_values(gpus: int, profile) -> list[int]:
    """The tps a decode replica can take: 1, 2, 4, … within one node, as `dtp simulate --decode`
    prices them (a token's collectives are latency; across nodes they would cross the slow link),
    dividing the job and each full node."""
    per_node = profile.gpus_per_node
    return [
        t
        for t in decode.tp_values(profile, 1)
        if t <= gpus and gpus % t == 0 and (gpus <= per_node or per_node % t == 0)
    ]


def search_decode(model: nn.Module, job: Serving, profile) -> tuple[list[Replica], dict[int, str]]:
    """Each tp's decode step on its auto plan, by tp; and the tps that could not be planned, with
    why."""
    out, refused = [], {}
    for tp in serving_tp_values(job.gpus, profile):
        try:
            found = auto_plan(model, job.model, tp, scan=False)
            checked = check(parse(found.text, "<auto>"), model, tp)
        except PlanError as err:
            refused[tp] = str(err).splitlines()[0]
            continue
        step = decode_step(
            checked,
            model,
            tp,
            profile,
            batch=job.batch,
            context=job.context,
            precision=job.precision,
        )
        capacity = int(profile.memory_GiB * GiB)
        out.append(
            Replica(tp, job.gpus // tp, job.batch, step, capacity, found.text, found.refused)
        )
    return out, refused


def serving_pick(rows: list[Replica], objective: str) -> Replica | None:
    """The choice among the tps that fit (None when none does). latency: the smallest tp that no
    tp beats by more than MEANINGFUL in ms per token (the fastest, or a smaller tp nearly as fast:
    it leaves more replicas). throughput: the most tokens/s over the cluster, or a tp within
    MEANINGFUL of it that answers sooner."""
    fit = [r for r in rows if r.fits]
    if not fit:
        return None
    if objective == "latency":
        return stops_paying(fit)
    most = max(r.cluster_tokens_per_s for r in fit)
    near = [r for r in fit if r.cluster_tokens_per_s >= (1 - MEANINGFUL) * most]
    return min(near, key=lambda r: (r.ms, r.tp))


def stops_paying(rows: list[Replica]) -> Replica | None:
    """The smallest tp that fits and that no larger tp beats by more than MEANINGFUL in per-token
    latency (then no smaller one does either): from there, more GPUs per replica buy too
    little."""
    fit = sorted((r for r in rows if r.fits), key=lambda r: r.tp)
    for r in fit:
        if all(o.ms >= (1 - MEANINGFUL) * r.ms for o in fit if o.tp > r.tp):
            return r
    return None


def decode_commands(best: Replica, job: Serving, max_prompts: int, max_new: int) -> list[str]:
    """The shell lines that check the chosen replica with `dtp generate` (token-exact against the
    unsharded model): its plan, then `batch` one-token prompts (at most `max_prompts`, what
    generate takes) decoding until the cache holds `context` tokens (at most `max_new` new ones)."""
    rows = min(job.batch, max_prompts)
    new = max(1, min(job.context - 1, max_new))
    generate = [
        "dtp",
        "generate",
        PLAN_FILE,
        job.model,
        "--tp",
        str(best.tp),
        "--prompt-ids",
        ";".join(["1"] * rows),
        "--max-new-tokens",
        str(new),
        "--dtype",
        GENERATE_DTYPE[job.precision],
    ]
    plan = ["dtp", "plan", "--auto", job.model, "--tp", str(best.tp), "-o", PLAN_FILE]
    return [shlex.join(plan), shlex.join(generate)]
