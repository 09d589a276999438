"""What every rank of `dtp train` does: build the sharded model, train, evaluate, measure.

The loop's whole state is (model, optimizer, step, seed): batches and the learning rate are pure
functions of (seed, step), so a checkpoint needs only `train_state()` next to the model and
optimizer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm

from dtp import models
from dtp.compiler.vocab_parallel import cross_entropy
from dtp.cost.param_bytes import local_param_bytes
from dtp.cost.schedule import NotModeled, schedule, summarize
from dtp.errors import UsageError, shorten
from dtp.models import calling
from dtp.runtime.build import build_from_model, build_sharded
from dtp.runtime.comm import merge
from dtp.runtime.job import (
    DP_MODES,
    RECOMPUTE,
    TRAIN_PRECISIONS,
    Job,
    finite,
    positive,
    state_shards,
)
from dtp.runtime.mesh import make_mesh, sync
from dtp.runtime.preflight import trusted
from dtp.runtime.rows import shared_rows
from dtp.runtime.watchdog import Heartbeat, watching
from dtp.train import data, replica_checks, resume, verify
from dtp.train.activations import ForwardMeter, GroupCounter, collective_bytes, state_bytes
from dtp.train.meter import CommTimer, peak_memory
from dtp.train.optim import LocalGradScaler, Schedule, adamw, clip_, set_lr, settle_grads
from dtp.train.recompute import recompute_blocks
from dtp.train.verify import AUTOCAST
from dtp.verify.dropout import DropoutProbe
from dtp.verify.reference import autocast, full_value

# bfloat16, float16: autocast over float32 master weights and AdamW state (float16 with loss scaling)
TRAIN_DTYPES = tuple(TRAIN_PRECISIONS.values())
INITS = ("model", "keyed")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Job):
    """`dtp train`'s job: the plan, model and mesh (Job) and the training run's own settings,
    validated once."""

    dtypes: ClassVar[tuple[str, ...]] = TRAIN_DTYPES
    steps: int = 200
    lr: float = 3e-3  # the peak learning rate
    min_lr: float = 3e-4  # at the end of the cosine
    warmup: int | None = None  # linear warm-up steps; None: 10 % of the steps
    weight_decay: float = 0.1
    clip: float = 1.0  # global gradient-norm clip, 0 for none
    eval_every: int = 50
    eval_batches: int = 8
    # sequences per micro-batch on each dp rank (None: batch / dp, one micro-batch): the step's
    # gradient accumulates over batch / (dp × micro_batch) of them
    micro_batch: int | None = None
    # what backward recomputes (dtp.train.recompute): none | full | selective | op
    recompute: str = "none"
    # data parallelism over dp: FSDP2 (parameters, gradients, AdamW state sharded) or DDP (replicated;
    # gradients all-reduced)
    dp_mode: str = "fsdp"
    # a hardware profile (shipped name or YAML): the summary sets simulate's predictions for this
    # layout on it beside what was measured (None: the byte counts only, no step time)
    profile: str | None = None
    out: str = "dtp-train"
    progress: bool = False  # a tqdm bar on rank 0 (a terminal); else a line per evaluation
    checkpoint: str | None = None  # save here every `save_every` steps (0: at the end only)
    save_every: int = 0
    resume: str | None = None  # load this checkpoint before the first step
    # resume from a checkpoint of another plan (dtp.checkpoint.dcp's convert=True)
    convert: bool = False
    # "model": the model's own init, built on rank 0 and scattered; "keyed": drawn per shard
    init: str = "model"
    # compare the tp ranks' replicated tensors every N steps (0: at the end and saves only)
    check_replicas: int = 10
    # compare with a float64 replay of the model's own weights every N steps and at the end (0: off)
    verify_every: int = 100
    # the rows of every batch in reverse order: this run up to rounding (--compare-tp's noise twin)
    twin: bool = False
    # start from scratch even when --checkpoint DIR holds a checkpoint (else the run continues it)
    fresh: bool = False
    # set by dtp.train.resume.validate: resuming from --checkpoint DIR by itself, and from where
    automatic: bool = False
    resumed_from: dict | None = None
    # intra-op threads per local rank (None: dtp.runtime.threads.threads_per_rank)
    threads: int | None = None
    # end the run when no rank has made progress for this long (seconds; 0: only --timeout)
    stall_timeout: float = 100.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recompute not in RECOMPUTE:
            raise UsageError(
                f"--recompute must be one of {', '.join(RECOMPUTE)}, got {shorten(self.recompute)}"
            )
        if self.dp_mode not in DP_MODES:
            raise UsageError(
                f"--dp-mode must be {' or '.join(DP_MODES)}, got {shorten(self.dp_mode)}"
            )
        if self.micro_batch is None:
            object.__setattr__(self, "micro_batch", self.batch // self.dp)
        positive("--micro-batch", self.micro_batch)
        if (self.batch // self.dp) % self.micro_batch:
            raise UsageError(
                f"--micro-batch {self.micro_batch} must divide the {self.batch // self.dp} "
                f"sequences each dp rank runs a step (--batch {self.batch} / --dp {self.dp})"
            )
        if self.init not in INITS:
            raise UsageError(f"--init must be {' or '.join(INITS)}, got {shorten(self.init)}")
        for flag, value in (
            ("--steps", self.steps),
            ("--eval-every", self.eval_every),
            ("eval_batches", self.eval_batches),
        ):
            positive(flag, value)
        finite("--lr", self.lr, strict=True)
        finite("--min-lr", self.min_lr)
        finite("--weight-decay", self.weight_decay)
        finite("--clip", self.clip)
        if self.min_lr > self.lr:
            raise UsageError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.warmup is None:
            object.__setattr__(self, "warmup", self.steps // 10)
        if self.warmup < 0:
            raise UsageError(f"--warmup must be 0 or more steps, got {self.warmup}")
        if self.warmup > self.steps:
            raise UsageError(f"--warmup {self.warmup} is longer than --steps {self.steps}")
        if self.check_replicas < 0:
            raise UsageError(f"--check-replicas must be 0 or more steps, got {self.check_replicas}")
        if self.verify_every < 0:
            raise UsageError(f"--verify-every must be 0 or more steps, got {self.verify_every}")
        finite("--stall-timeout", self.stall_timeout)
        if self.save_every and not self.checkpoint:
            raise UsageError("--save-every needs --checkpoint DIR (where to save)")
        if self.convert and not self.resume:
            raise UsageError("--convert applies to --resume DIR only")
        if self.fresh and self.resume:
            raise UsageError("--fresh starts over; it contradicts --resume DIR")

    @property
    def state_shards(self) -> int:
        """How many dp ranks share the training state (dtp.runtime.job.state_shards)."""
        return state_shards(self.dp, self.dp_mode)


# time collectives on every 10th step only: the timer's dispatch mode sees every op and slows it
COMM_SAMPLE = 10


class Trainer:
    """One rank's model, optimizer and data, and the step and evaluation functions."""

    def __init__(self, cfg: TrainConfig, corpus: data.Corpus, mesh: DeviceMesh):
        self.cfg, self.corpus, self.mesh = cfg, corpus, mesh
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if cfg.device == "cuda"
            else torch.device("cpu")
        )
        self.source = models.resolve(cfg.model)
        # shapes for the plan, the forward's discovery, the schedule and the replay's memory
        self.meta = meta = models.build(self.source, device="meta")
        # the parent checked this text
        self.checked = trusted(cfg.plan_ir(), meta, cfg.tp)
        # how the model gives every position's logits (a tuple, targets, positions:
        # dtp.models.calling)
        self.forward = calling.discover(meta, models.vocab_size(meta), cfg.model)
        # The seed drives the model's own init (rank 0) and the stream replicated dropout shares.
        torch.manual_seed(cfg.seed)
        # plain: at tp 1 dp 1 the model stays plain PyTorch (no DTensor, no collectives;
        # dtp.runtime.shard.apply)
        if cfg.init == "model":
            self.applied = build_from_model(
                self.checked,
                self.source,
                mesh,
                seed=cfg.seed,
                device=self.device,
                dp=cfg.dp,
                plain=True,
                dp_mode=cfg.dp_mode,
            )
        else:
            self.applied = build_sharded(
                self.checked,
                self.source,
                mesh,
                seed=cfg.seed,
                device=self.device,
                dp=cfg.dp,
                plain=True,
                dp_mode=cfg.dp_mode,
            )
        self.model = self.applied.model
        rows = shared_rows(self.applied)  # k/v rows every rank holds: counted once in the clip norm
        self.shared_rows = {id(p): rows[n] for n, p in self.model.named_parameters() if n in rows}
        self.blocks = recompute_blocks(self.model, cfg.recompute, cfg.seq)
        self.optimizer = adamw(self.model, cfg.lr, cfg.weight_decay)
        # float16: dynamic loss scaling, the skip decided alike on every rank (the scaler all-reduces
        # what it found over the world); otherwise a disabled scaler is the identity
        self.fp16 = cfg.dtype == "float16"
        self.scaler = LocalGradScaler(device=self.device.type, enabled=self.fp16)
        # gradient accumulation: FSDP2 and DDP reduce only on the last micro-batch's backward
        self.sync_grads = (
            self.model.set_requires_gradient_sync
            if isinstance(self.model, FSDPModule) and cfg.batch // cfg.dp > cfg.micro_batch
            else None
        )
        self.schedule = Schedule(cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        self.tokens = corpus.tokens()
        self.dp_rank = mesh["dp"].get_local_rank() if cfg.dp > 1 else 0
        self.dp_group = mesh["dp"].get_group() if cfg.dp > 1 else None
        self.step = 0
        self.heartbeat = Heartbeat()  # what this rank last began, for the stall watchdog
        self.param_bytes = local_param_bytes(self.model)
        # what the first step measures, for dtp simulate's prediction (dtp.train.predict)
        self.measured: dict = {}
        self.val = data.val_batches(
            corpus, self.tokens, cfg.batch, cfg.seq, cfg.dp, self.dp_rank, cfg.eval_batches
        )

    def train_state(self) -> dict:
        """What a checkpoint must keep besides the model and optimizer (the rest derives from it)."""
        return {
            "step": self.step,
            "seed": self.cfg.seed,
            "config": self.cfg.to_json(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
            # float16's dynamic loss scale (and its growth tracker): resumed, not restarted
            "loss_scale": self.scaler.state_dict() if self.fp16 else None,
        }

    def _autocast(self):
        return autocast(self.device, AUTOCAST.get(self.cfg.dtype))

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.forward(self.model, inputs.to(self.device), targets.to(self.device))
        # in float32 from (possibly half-precision) logits, as autocast does; vocabulary-parallel
        # logits stay split
        return cross_entropy(logits, targets.to(self.device))

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        value = full_value(value).detach().float().reshape(1).clone()
        if self.dp_group is not None:
            dist.all_reduce(value, group=self.dp_group)
            value /= self.cfg.dp
        return float(value.item())

    def train_step(
        self,
        counters: dict | None = None,
        timer: CommTimer | None = None,
        probe=None,
        meter: ForwardMeter | None = None,
    ) -> dict:
        """One optimizer step on this step's batch, its gradient accumulated over the micro-batches;
        `counters` (forward, backward, optimizer) count its collectives and measure its training
        state (`self.measured`); `probe` (dtp.verify.dropout) records the first forward's random
        masks; `meter` the bytes the first micro-batch's forward leaves for backward."""
        cfg = self.cfg
        lr = self.schedule(self.step)
        set_lr(self.optimizer, lr)
        inputs, targets = data.train_batch(
            self.corpus, self.tokens, self.step, cfg.seed, cfg.batch, cfg.seq, cfg.dp, self.dp_rank
        )
        if cfg.twin:  # the same sums in another order: only rounding differs
            inputs, targets = inputs.flip(0), targets.flip(0)
        micro = list(zip(inputs.split(cfg.micro_batch), targets.split(cfg.micro_batch)))
        self.model.train()
        sync(self.device)
        t0 = time.perf_counter()
        losses = []
        with timer or contextlib.nullcontext():
            for i, (x, y) in enumerate(micro):
                last = i == len(micro) - 1
                if self.sync_grads is not None:  # FSDP2/DDP reduce the gradient once, at the end
                    self.sync_grads(last)
                self.heartbeat.beat(self.step + 1, "forward")
                with (
                    counters["forward"] if counters else contextlib.nullcontext(),
                    probe.recording() if probe and i == 0 else contextlib.nullcontext(),
                    meter if meter and i == 0 else contextlib.nullcontext(),
                ):
                    loss = self._loss(x, y)
                self.heartbeat.beat(self.step + 1, "backward")
                with counters["backward"] if counters else contextlib.nullcontext():
                    # every micro-batch has as many tokens: the mean of their means is the batch's
                    self.scaler.scale(loss / len(micro)).backward()
                losses.append(loss.detach())
            self.heartbeat.beat(self.step + 1, "optimizer")
            norm, skipped = self._optimizer_step(counters["optimizer"] if counters else None)
            sync(self.device)
        if meter:
            self.measured["activation_bytes"] = meter.nbytes
        seconds = time.perf_counter() - t0
        self.step += 1
        return {
            "step": self.step,
            "loss": self._mean_over_dp(torch.stack([full_value(v) for v in losses]).mean()),
            "lr": lr,
            "grad_norm": float(norm),
            "step_time_ms": seconds * 1e3,
            "tokens_per_s": cfg.batch * cfg.seq / seconds,
            "comm_share": (timer.seconds / seconds) if timer else None,
            **({"loss_scale": self.scaler.get_scale(), "skipped": skipped} if self.fp16 else {}),
        }

    def _optimizer_step(self, counter: GroupCounter | None = None) -> tuple[torch.Tensor, bool]:
        """Unscale (float16), clip, step: (the gradient norm, whether the step was skipped for a
        non-finite gradient — every rank decides alike: the scaler all-reduces what it found).
        `counter`: the collectives of settling the gradients and of the step (not the clip's or the
        scaler's scalars: nothing prices them), and the training state measured after it."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        with counter or contextlib.nullcontext():
            settle_grads(params)  # a Partial gradient reduced once, before the scaler reads it
        self.scaler.unscale_(self.optimizer)
        # not counted: see analytic()
        norm = clip_(self.model.parameters(), self.cfg.clip, self.shared_rows)
        before = self.scaler.get_scale() if self.fp16 else None
        with counter or contextlib.nullcontext():
            self.scaler.step(self.optimizer)
        self.scaler.update()
        if counter is not None:
            self.measured.update(state_bytes(self.model, self.optimizer))
        self.optimizer.zero_grad(set_to_none=True)
        skipped = self.fp16 and self.scaler.get_scale() < before
        return norm, skipped

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches (all dp ranks)."""
        self.model.eval()
        total = 0.0
        for inputs, targets in self.val:
            self.heartbeat.beat(self.step, "evaluation")
            total += self._mean_over_dp(self._loss(inputs, targets))
        return total / len(self.val)

    def analytic(self) -> dict:
        """The analytic collectives of one step's forwards + backwards (every micro-batch, recomputed
        forwards included), as counted on the first step. Clipping and the optimizer step are not
        counted: the gradient norm's scalar reductions run there, and sequence-parallel norms'
        gradients (DTensor Partial) are reduced there lazily, so for sequence-parallel plans the
        schedule's norm-gradient all-reduces are not seen by the count."""
        cfg = self.cfg
        try:
            steps = schedule(
                self.checked,
                cfg.tp,
                cfg.batch // cfg.dp,
                cfg.seq,
                dtype=AUTOCAST.get(cfg.dtype, torch.float32),
                lowered=self.applied.compiled.lowered,
                dp=cfg.dp,
                model=self.meta,
                checkpoint_activations=cfg.recompute == "full",
                plain=self.applied.plain,
                dp_mode=cfg.dp_mode,
                micro_batches=cfg.batch // cfg.dp // cfg.micro_batch,
                param_dtype=torch.float32,  # the master weights: what FSDP2 and DDP move
            )
            return summarize(steps, cfg.tp, cfg.dp)
        except NotModeled as err:
            return {"not_modeled": str(err)}


def _anywhere(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank of the world (a collective)."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _progress(cfg: TrainConfig, rank: int):
    if rank != 0 or not cfg.progress:
        return None

    return tqdm(total=cfg.steps, desc="dtp train", unit="step", dynamic_ncols=True)


def train(rank: int, world: int, cfg: TrainConfig, corpus: data.Corpus) -> dict:
    """Train on an initialised process group; rank 0 appends metrics to OUT/metrics.jsonl as it
    goes. Returns this rank's summary (rank 0's carries the loss curve)."""
    warnings.filterwarnings("ignore", message=".*(backward hook|returned a view tensor).*")
    # The clip norm of FSDP2 + tp gradients reduces over dp then tp, which torch calls suboptimal;
    # it is one scalar.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if cfg.threads:  # local ranks got it at start-up; a torchrun rank gets it here
        torch.set_num_threads(cfg.threads)
    trainer = Trainer(cfg, corpus, make_mesh(cfg.tp, cfg.dp, cfg.device))
    resumed = resume.restore(trainer, cfg) if cfg.resume else None
    start, saves = trainer.step, []
    metrics = Path(cfg.out, "metrics.jsonl") if rank == 0 else None
    bar = _progress(cfg, rank)
    replicas = replica_checks.ReplicaChecks.over(trainer.mesh, trainer.model, trainer.device)
    verification = verify.Verification.over(trainer, cfg.verify_every)
    # the first step's random masks against their tensors' placement (tp > 1, dropout or a generator)
    masks = DropoutProbe.over(trainer.model) if replicas.group is not None else None
    stopped = False
    groups = {
        "tp": trainer.mesh["tp"].get_group() if cfg.tp > 1 else None,
        "dp": trainer.mesh["dp"].get_group() if cfg.dp > 1 else None,
    }
    counters = {phase: GroupCounter(groups) for phase in ("forward", "backward", "optimizer")}
    # the saved activations of the first step, or of the second where the dropout probe holds the
    # first forward's masks (they would be counted)
    meter_step = start if masks is None else start + 1
    losses, val_losses, times, shares = [], [], [], []
    skipped = 0  # float16 steps the loss scaler skipped (a non-finite gradient)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(metrics, "a", encoding="utf-8")) if metrics else None
        if bar is not None:
            stack.callback(bar.close)
        if bar is not None:
            bar.update(start)
        # from the first step on, a rank that stops (or a collective that never completes) ends the
        # run within --stall-timeout; building and restoring are bounded by --timeout alone
        stack.enter_context(watching(trainer.heartbeat, rank, world, cfg.stall_timeout))
        for step in range(start, cfg.steps):
            first = step == start  # collectives are counted, not timed, on this run's first step
            # a plain model has no collectives to time; else every COMM_SAMPLE-th step is timed, and
            # left out of the step-time median (the timer's dispatch mode slows every op of that
            # step)
            sampled = not first and not trainer.applied.plain and (step - start) % COMM_SAMPLE == 1
            row = trainer.train_step(
                counters if first else None,
                CommTimer() if sampled else None,
                masks if first else None,
                ForwardMeter(trainer.model) if step == meter_step else None,
            )
            if first and masks and _anywhere(bool(masks.verdict(replicas.group)), trainer.device):
                stopped = True  # every rank: dropout masks that break their tensors' placement
                break
            if not math.isfinite(row["loss"]):
                raise FloatingPointError(
                    f"the loss became {row['loss']} at step {row['step']}; lower --lr "
                    "or keep --clip on"
                )
            trainer.heartbeat.beat(row["step"], "checks")
            # Before evaluating (FSDP2 leaves the root gathered after it) and before any save: never
            # a drifted checkpoint.
            if replicas.group is not None and (
                replica_checks.due(row["step"], start, cfg.check_replicas, cfg.steps)
                or resume.due(cfg, row["step"])
            ):
                stopped = not replicas.check(trainer.model, row["step"])
                row["replicas_checked"] = replicas.tensors
                # every rank stops here; the ranks of a tp group that diverged say what differs
                if stopped:
                    row["replica_divergences"] = [d.describe() for d in replicas.divergences]
                    if log:
                        log.write(json.dumps(row) + "\n")
                    break
            if not verification.skipped and verify.due(row["step"], cfg.verify_every, cfg.steps):
                found = verification.check(trainer, row["step"])
                row["verified"] = {"ok": found["ok"], "margin": found["margin"]}
                if not found["ok"]:  # every rank has the record: every rank stops here
                    stopped = True
                    if log:
                        log.write(json.dumps(row) + "\n")
                    break
            if row["step"] % cfg.eval_every == 0 or row["step"] == cfg.steps:
                row["val_loss"] = trainer.evaluate()
                val_losses.append((row["step"], row["val_loss"]))
            row["peak_memory_bytes"] = peak_memory(trainer.device)[0]
            if resume.due(cfg, row["step"]):  # after the step's timing: a save is not step time
                trainer.heartbeat.beat(row["step"], "save")
                saves.append(resume.save(trainer, cfg))
                row["checkpoint_bytes"], row["checkpoint_seconds"] = (
                    saves[-1]["bytes"],
                    saves[-1]["seconds"],
                )
            losses.append(row["loss"])
            skipped += bool(row.get("skipped"))
            if sampled:
                shares.append(row["comm_share"])
            elif not first:
                times.append(row["step_time_ms"])
            if log:
                log.write(json.dumps(row) + "\n")
                log.flush()
            if bar is not None:
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False
                )
                bar.update(1)
            elif rank == 0 and "val_loss" in row:
                print(
                    f"step {row['step']}/{cfg.steps}: loss {row['loss']:.4f} · val loss "
                    f"{row['val_loss']:.4f} · "
                    f"{row['tokens_per_s']:.0f} tokens/s",
                    flush=True,
                )
    peak, kind = peak_memory(trainer.device)
    out = {
        "rank": rank,
        "param_bytes": trainer.param_bytes,
        "peak_memory_bytes": peak,
        "peak_memory_kind": kind,
        "replicas": replicas.record(),
        "verify": verification.record(),
        "dropout": masks.record() if masks else None,
        "threads": torch.get_num_threads(),
        "plain": trainer.applied.plain,
    }
    if rank == 0 and not stopped:
        times = times or [row["step_time_ms"]]
        median = sorted(times)[len(times) // 2]
        out.update(
            losses=losses,
            val_losses=val_losses,
            val_loss=val_losses[-1][1],
            step_time_ms=median,
            tokens_per_s=cfg.batch * cfg.seq / (median / 1e3),
            comm_share=sorted(shares)[len(shares) // 2] if shares else 0.0,
            # the schedule has the forward and backward passes' collectives
            collectives=merge({k: counters[k] for k in ("forward", "backward")}),
            measured={
                **collective_bytes(counters.values()),
                **trainer.measured,
                "step_ms": median,
            },
            analytic_collectives=trainer.analytic(),
            blocks_checkpointed=len(trainer.blocks),
            loss_scale=(
                {"final": trainer.scaler.get_scale(), "skipped_steps": skipped}
                if trainer.fp16
                else None
            ),
            start_step=start,
            resumed=resumed,
            saves=saves,
        )
    return out
