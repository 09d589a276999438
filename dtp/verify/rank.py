"""What every rank of `dtp apply` does: shard, train K steps beside an unsharded reference, compare,
measure.

A rank takes the plan the parent's pre-flight (dtp.runtime.preflight.prepare) parsed and checked,
with the job, and does not check it again (`trusted`)."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import statistics
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dtp import models
from dtp.compiler.vocab_parallel import cross_entropy as sharded_cross_entropy
from dtp.cost.param_bytes import ideal_param_bytes, local_param_bytes
from dtp.cost.schedule import NotModeled, schedule, summarize
from dtp.lang import ir
from dtp.models.calling import PLAIN, Forward
from dtp.runtime.build import build_sharded
from dtp.runtime.comm import CommCounter, merge
from dtp.runtime.job import Job, positive
from dtp.runtime.mesh import make_mesh, sync
from dtp.runtime.preflight import trusted
from dtp.runtime.shard import Applied, tied_groups
from dtp.verify.instruments import ActivationMeter, ModuleTrail
from dtp.verify.parity import FLOOR_SHARE, ParityCheck, compare_grads, dropout_sources
from dtp.verify.probes import compare_buffers, compare_replicas, plan_probes, run_probes
from dtp.verify.reference import (
    LOW_PRECISION,
    MixedSGD,
    bf16_autocast,
    full_value,
    ignore_some,
    own_rng,
    reference_step,
    references,
)
from dtp.verify.report import ApplyReport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True, kw_only=True)
class RunConfig(Job):
    """`dtp apply`'s job: the plan, model and mesh (Job) and the parity run's own settings."""

    steps: int = 3  # SGD steps, each compared with the references
    lr: float = 0.1
    # the long probes' length (default: the model's maximum, at most MAX_PROBE_SEQ)
    max_seq: int | None = None
    # how the model is called and where its logits are (the pre-flight discovers it)
    forward: Forward = PLAIN

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("--steps", self.steps)
        if self.max_seq is not None:
            positive("--max-seq", self.max_seq)
        # lr as given: the CLI refuses a non-finite one, and the verdict must catch what it does to
        # the weights


def _device(cfg: RunConfig) -> torch.device:
    if cfg.device != "cuda":
        return torch.device("cpu")
    rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))


def run(cfg: RunConfig, mesh: DeviceMesh | None = None) -> ApplyReport | None:
    """Run on an initialised process group; rank 0 returns the report. `cfg`'s plan is taken as
    checked (the pre-flight checked its text; the fuzz pools check each case before they send it).

    A low-precision run is decided on a float32 run of the same plan first (its rounding cannot hide
    an error of 1e-5), then the run in its own dtype, against its unsharded run in that dtype; both
    must hold. An exception leaves with `__dtp_where__` saying which module or phase it came from.
    """
    trails: list[ModuleTrail] = []
    device = _device(cfg)
    mesh = mesh or make_mesh(cfg.tp, cfg.dp, cfg.device)
    try:
        plan = cfg.plan_ir()  # once, for both runs of a low-precision dtype
        # The run draws from the default generators (weights, shared dropout stream) seeded with the
        # seed on every rank, and hands the caller's generator states back unchanged.
        with own_rng(device):
            proof = None
            if DTYPES[cfg.dtype] in LOW_PRECISION:
                _seed(cfg.seed, device)
                proof = _run(replace(cfg, dtype="float32"), plan, trails, mesh, device)
                trails.clear()
            _seed(cfg.seed, device)
            report = _run(cfg, plan, trails, mesh, device)
            return (
                report
                if report is None or proof is None
                else replace(report, parity=decided_by(proof.parity, report.parity))
            )
    except Exception as err:
        err.__dtp_where__ = trails[-1].where() if trails else "set-up"
        raise


def _seed(seed: int, device: torch.device) -> None:
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def decided_by(proof: dict, low: dict) -> dict:
    """The parity section of a low-precision run: the float32 run's comparisons come first (its
    rounding cannot hide what bfloat16's can), and the low-precision run's own (against its
    unsharded run in the same dtype) are kept under `low_precision`; both must hold. The float32 run
    cannot speak for the low-precision one: a model may take another path in that dtype (a planted
    bfloat16-only branch passed the float32 run at margin < 1 and failed its own at 27), so an error
    beyond the low-precision bound fails, even where it may be that dtype's precision alone (an MoE
    router whose top-k choice a rounding flips)."""
    worst = low if proof["ok"] and not low["ok"] else proof
    return {
        **proof,
        "ok": proof["ok"] and low["ok"],
        "decided_in": "float32",
        "low_precision": low,
        "worst_tensor": worst["worst_tensor"],
        "worst_quantity": worst["worst_quantity"],
    }


def _report(
    cfg: RunConfig,
    *,
    plan,
    parity: ParityCheck,
    collectives: dict,
    analytic: dict,
    model: nn.Module,
    gathered: list[dict],
    step_times: list[float],
    device: torch.device,
    ideal_bytes: int,
) -> ApplyReport:
    """Rank 0's report of the run."""
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    median = statistics.median(step_times)
    return ApplyReport(
        plan={"name": plan.name, "version": plan.plan_version, "file": cfg.plan},
        model=cfg.model,
        mesh={"tp": cfg.tp, "dp": cfg.dp},
        config=cfg.to_json(),
        torch=torch.__version__,
        backend=dist.get_backend(),
        parity=parity.to_json(),
        collectives=collectives,
        comm_bytes=sum(collectives["sent_bytes"].values()),
        analytic_collectives=analytic,
        tied_parameters=[
            [f"{path}.{name}".lstrip(".") for path, name in group] for group in tied_groups(model)
        ],
        param_bytes_unsharded=total_bytes,
        param_bytes_per_rank=[g["param_bytes"] for g in gathered],
        ideal_param_bytes_per_rank=ideal_bytes,
        activation_bytes_per_rank=[g["activations"] for g in gathered],
        peak_memory_kind="cuda_max_allocated" if device.type == "cuda" else "rss",
        peak_memory_bytes=[g["peak"] for g in gathered],
        step_time_ms=median * 1e3,
        tokens_per_s=cfg.batch * cfg.seq / median,
    )


@dataclass
class Built:
    """The sharded model on this rank and, on rank 0, its unsharded references."""

    applied: Applied
    meta: nn.Module  # the model on the meta device: shapes for the schedule and the bytes
    refs: list  # rank 0: the float64 truth, then the run's dtype when it is lower; elsewhere empty
    dropout: list[str]


def build_beside_references(
    job: Job,
    plan: ir.Plan,
    mesh: DeviceMesh,
    device: torch.device,
    dtype: torch.dtype,
    *,
    forward: Forward = PLAIN,
    lr: float = 0.0,
    training: bool = True,
    trail: ModuleTrail | None = None,
) -> Built:
    """The build of every proof (`dtp apply`, `dtp generate`), through the one build path
    (dtp.runtime.build): rank 0 alone builds the whole model, with the model's own initialisation,
    for its unsharded references (called as `forward` says; `lr`: their SGD's; `training`: their
    mode, and the sharded model's); every rank builds on
    meta, shards, and receives its blocks from rank 0."""
    rank = dist.get_rank()
    source = models.resolve(job.model)
    full = models.build(source, device="cpu", dtype=dtype).to(device) if rank == 0 else None
    # the float64 truth (+ same dtype)
    refs = references(full.train(training), dtype, lr, forward) if rank == 0 else []
    if trail is not None:
        trail.phase = "sharding (apply)"
    # shapes for the plan, the schedule and the bytes
    meta = models.build(source, device="meta", dtype=dtype)
    checked = trusted(plan, meta, job.tp)
    applied = build_sharded(
        checked,
        source,
        mesh,
        seed=job.seed,
        device=device,
        dp=job.dp,
        dtype=dtype,
        # tp 1 dp 1: plain PyTorch, no DTensor
        full=full,
        from_rank0=True,
        plain=True,
    )
    del full
    applied.model.train(training)
    dropout = dropout_sources(applied.model)
    if trail is not None:
        trail.attach(applied.model)
    return Built(applied, meta, refs, dropout)


def _batch(
    cfg: RunConfig, mesh: DeviceMesh, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """(inputs, targets) of the global batch, and this rank's part of it: dp splits the batch;
    logits and loss are compared on that part. One target in eight is IGNORE_INDEX."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    # the global batch
    ids = torch.randint(0, vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    targets = ignore_some(ids[:, 1:], gen)  # ignored labels (-100) reach the loss
    per_dp = cfg.batch // cfg.dp
    mine = (
        slice(mesh["dp"].get_local_rank() * per_dp, (mesh["dp"].get_local_rank() + 1) * per_dp)
        if cfg.dp > 1
        else slice(None)
    )
    return ids[:, :-1].to(device), targets.to(device), mine


def _compare_step(
    parity: ParityCheck,
    built: Built,
    step: int,
    logits: torch.Tensor,
    loss: torch.Tensor,
    batch: tuple[torch.Tensor, torch.Tensor, slice],
    cfg: RunConfig,
    device: torch.device,
) -> None:
    """Logits, loss and every gradient of this step against the references (rank 0), then the
    references step."""
    full_logits, full_loss = full_value(logits), full_value(loss)
    grads = {
        n: (built.applied.full(n, p.grad) if p.grad is not None else None)
        for n, p in built.applied.model.named_parameters()
    }
    if not built.refs:
        return
    inputs, targets, mine = batch
    outs = [reference_step(r, inputs, targets, mine, cfg.dp > 1, device) for r in built.refs]
    lowp = outs[1] if len(built.refs) > 1 else (None, None)
    parity.compare("logits", f"logits (step {step + 1})", full_logits, outs[0][0], lowp[0])
    parity.compare("loss", f"loss (step {step + 1})", full_loss, outs[0][1], lowp[1])
    compare_grads(parity, "grads", grads, built.refs)
    for r in built.refs:
        r.opt.step()
        r.opt.zero_grad()


def _compare_params(parity: ParityCheck, built: Built, opt: MixedSGD, step: int) -> None:
    """Every parameter after the step (its master copy) against the references' (rank 0)."""
    # a collective: every rank
    params = {n: built.applied.full(n, m.detach()) for n, m in opt.masters.items()}
    if not built.refs:
        return
    truth, unsharded = built.refs[0], (built.refs[1] if len(built.refs) > 1 else None)
    for n, p in params.items():
        parity.compare(
            "params",
            f"{n} (after step {step + 1})",
            p,
            truth.param(n),
            unsharded.param(n) if unsharded else None,
            held_in=opt.master_dtype,
        )


def _compare_state(
    parity: ParityCheck,
    built: Built,
    mesh: DeviceMesh,
    device: torch.device,
    dtype: torch.dtype,
    when: str,
) -> None:
    """Buffers against the references, and replicas across the tp ranks (collectives: every rank)."""
    model = built.applied.model
    compare_buffers(parity, model, built.refs, when)
    compare_replicas(parity, model, mesh["tp"].get_group(), device, dtype, when)


def _probe(
    parity: ParityCheck,
    cfg: RunConfig,
    built: Built,
    mesh: DeviceMesh,
    device: torch.device,
    dtype: torch.dtype,
    batch: tuple[torch.Tensor, torch.Tensor, slice],
) -> None:
    """The forwards after the steps (dtp.verify.probes), then buffers and replicas once more; says
    what was compared."""
    model = built.applied.model
    inputs, _, mine = batch
    vocab = models.vocab_size(model)
    probes = plan_probes(
        refs=built.refs,
        model=built.meta,
        max_seq=cfg.max_seq,
        tp=cfg.tp,
        batch=inputs[mine].shape[0],
        seq=cfg.seq,
        vocab=vocab,
        device=device,
        dtype=dtype,
        forward=cfg.forward,
    )
    skipped = run_probes(
        parity,
        sharded=model,
        refs=built.refs,
        probes=probes,
        inputs=inputs,
        mine=mine,
        seed=cfg.seed,
        vocab=vocab,
        device=device,
        forward=cfg.forward,
    )
    _compare_state(parity, built, mesh, device, dtype, "after the probes")
    parity.shapes = [
        f"train, {inputs[mine].shape[0]}×{cfg.seq}: {cfg.steps} steps (logits, loss, gradients, "
        "parameters, "
        "buffers; replicas on every rank)"
    ] + [f"{p.label}: {skipped.get(p, 'logits')}" for p in probes]
    if not any(p.seq > cfg.seq for p in probes):
        parity.shapes.append(
            f"no longer sequence: the model runs none longer than {cfg.seq} "
            f"(up to {cfg.max_seq or 'its maximum'})"
        )


def _autocast_grads(
    parity: ParityCheck,
    cfg: RunConfig,
    built: Built,
    device: torch.device,
    batch: tuple[torch.Tensor, torch.Tensor, slice],
) -> None:
    """One forward and backward of the steps' batch under bfloat16 autocast, as `dtp train --dtype
    bfloat16` runs it (the loss in float32 after), and no optimizer step: every gradient against
    the float64 truth's (without autocast) by the rule, with the float32 copy under autocast as the
    unsharded run. A path only autocast takes moves the gradients of what it touches by O(1), where
    the logits it feeds may move less than bfloat16's own rounding (dtp.verify.probes)."""
    model, (inputs, targets, mine) = built.applied.model, batch
    with bf16_autocast(device):
        logits = cfg.forward(model, inputs[mine], targets[mine])
    sharded_cross_entropy(logits, targets[mine]).backward()
    grads = {
        n: (built.applied.full(n, p.grad) if p.grad is not None else None)
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    parity.shapes.append(
        f"train, {inputs[mine].shape[0]}×{inputs.shape[1]}, bfloat16 autocast: gradients (one "
        "forward and backward, no step)"
    )
    if not built.refs:
        return
    for i, ref in enumerate(built.refs):
        with bf16_autocast(device, i > 0):
            reference_step(ref, inputs, targets, mine, cfg.dp > 1, device)
    compare_grads(
        parity, "probes", grads, built.refs, " (bfloat16 autocast)", torch.bfloat16, FLOOR_SHARE
    )
    for ref in built.refs:
        ref.opt.zero_grad()


def _analytic(cfg: RunConfig, built: Built, dtype: torch.dtype) -> dict:
    """dtp.cost.schedule's prediction of one step's collectives, to set beside the measurement."""
    try:
        steps = schedule(
            built.applied.checked,
            cfg.tp,
            cfg.batch // cfg.dp,
            cfg.seq,
            dtype=dtype,
            lowered=built.applied.compiled.lowered,
            dp=cfg.dp,
            model=built.meta,
            plain=built.applied.plain,
        )
        return summarize(steps, cfg.tp, cfg.dp)
    except NotModeled as err:
        return {"not_modeled": str(err)}


def _run(
    cfg: RunConfig, plan: ir.Plan, trails: list[ModuleTrail], mesh: DeviceMesh, device: torch.device
) -> ApplyReport | None:
    """Build, train K steps comparing each with the references, measure; rank 0's report."""
    # FSDP2 root: logits are not edited in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    # Gathering FSDP2 + TP parameters for the comparison warns that it takes two all-gathers; it
    # may.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dtype = DTYPES[cfg.dtype]
    trail = ModuleTrail()
    trails.append(trail)
    built = build_beside_references(
        cfg, plan, mesh, device, dtype, forward=cfg.forward, lr=cfg.lr, trail=trail
    )
    model = built.applied.model
    batch = _batch(cfg, mesh, models.vocab_size(model), device)
    inputs, targets, mine = batch

    opt = MixedSGD(model, cfg.lr)
    parity = ParityCheck(dtype)
    parity.dropout = built.dropout
    # One counter per phase (the comparisons run in between, uncounted).
    counters = {"forward": CommCounter(), "backward": CommCounter(), "optimizer": CommCounter()}
    step_times: list[float] = []
    activations = ActivationMeter(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    for step in range(cfg.steps):
        counting = step == 0
        sync(device)
        t0 = time.perf_counter()
        with (
            counters["forward"] if counting else contextlib.nullcontext(),
            activations.recording() if counting else contextlib.nullcontext(),
        ):
            trail.phase = "forward"
            logits = cfg.forward(model, inputs[mine], targets[mine])
            trail.phase = "loss"
            loss = sharded_cross_entropy(logits, targets[mine])
        with counters["backward"] if counting else contextlib.nullcontext():
            trail.phase = "backward"
            loss.backward()
        # The optimizer step is applied after the gradients are compared, but timed as part of the
        # step.
        sync(device)
        t_fwd_bwd = time.perf_counter() - t0

        trail.phase = "comparison with the reference"
        _compare_step(parity, built, step, logits, loss, batch, cfg, device)

        trail.phase = "optimizer step"
        sync(device)
        t1 = time.perf_counter()
        with counters["optimizer"] if counting else contextlib.nullcontext():
            opt.step()
            opt.zero_grad()
            sync(device)
        step_time = t_fwd_bwd + time.perf_counter() - t1
        if not counting or cfg.steps == 1:
            step_times.append(step_time)

        trail.phase = "comparison with the reference"
        _compare_params(parity, built, opt, step)
        _compare_state(parity, built, mesh, device, dtype, f"after step {step + 1}")

    # Measured before the probes: their long forward raises the peak, and FSDP2 leaves its root unit
    # gathered.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss
    measured = {
        "param_bytes": local_param_bytes(model),
        "peak": peak,
        "activations": activations.nbytes,
    }
    trail.phase = "probes after the steps"
    _probe(parity, cfg, built, mesh, device, dtype, batch)
    if dtype == torch.float32:
        trail.phase = "bfloat16 autocast step"
        _autocast_grads(parity, cfg, built, device, batch)
        _compare_state(parity, built, mesh, device, dtype, "after the autocast step")

    trail.phase = "report"
    analytic = _analytic(cfg, built, dtype)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measured)
    if dist.get_rank() != 0:
        return None

    ideal = ideal_param_bytes(
        built.applied.checked, built.meta, cfg.tp, cfg.dp, next(model.parameters()).element_size()
    )
    return _report(
        cfg,
        plan=plan,
        parity=parity,
        collectives=merge(counters),
        analytic=analytic,
        model=model,
        gathered=gathered,
        step_times=step_times,
        device=device,
        ideal_bytes=ideal,
    )
