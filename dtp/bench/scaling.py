"""One benchmark configuration on `tp` ranks, in one process group: build every arm from the same
weights, prove each equal to the unsharded model (a configuration whose arm fails parity fails,
untimed), then time the arms step by step, round-robin, and keep every sample."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtp.bench.arms import ARMS, PLAN, PLAN_NAME, Inputs, gpt_config
from dtp.bench.megatron import BASELINE_VERSION, flops_per_token, relative_error
from dtp.bench.stats import interleaved_orders
from dtp.cost.schedule import schedule, summarize
from dtp.errors import UsageError
from dtp.models import ModelSource
from dtp.models.gpt import GPT, GPTConfig
from dtp.runtime.job import Job, positive
from dtp.runtime.preflight import Prepared, launch, prepare, trusted

RTOL = 1e-4  # float32, as `dtp apply`: sharding only reorders sums


@dataclass(frozen=True, kw_only=True)
class Config(Job):
    """One point of a scaling curve: a job (the shipped Megatron plan on the benchmark's GPT over tp
    ranks; batch and seq as every job's) and the benchmark's own settings. Validated here, once,
    one message per condition; device "cuda" is the GPU check's (NCCL ranks, one GPU each)."""

    plan: str = PLAN_NAME
    plan_text: str | None = PLAN  # what the pre-flight parses and checks
    model: str = "bench-gpt"  # the GPT of the sizes below (`source`), as messages name it
    timeout: float = 3600.0
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    warmup: int = 2  # untimed rounds
    samples: int = 20  # timed rounds: every arm once per round
    arms: tuple[str, ...] = ("dtp", "hand", "megatron")
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)  # the arms and their tolerance (RTOL)

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, value in (
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("vocab_size", self.vocab_size),
            ("--samples", self.samples),
        ):
            positive(flag, value)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise UsageError(f"warmup must be an integer ≥ 0, got {self.warmup!r}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise UsageError(
                f"arms must name some of {', '.join(ARMS)}, got {', '.join(self.arms) or 'none'}"
            )

    def gpt(self) -> GPTConfig:
        """The model."""
        return gpt_config(self.n_layer, self.n_head, self.n_embd, self.vocab_size, self.seq)

    def source(self) -> ModelSource:
        """The model as the pre-flight builds it (on meta) and the ranks rebuild it."""
        return ModelSource(self.model, "gpt", self.gpt())


class ParityFailure(Exception):
    """An arm does not compute what the unsharded model does: the configuration is not timed."""


def _reference(base: GPT, x, y) -> tuple[torch.Tensor, float, float]:
    logits = base(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in base.parameters())
    base.zero_grad()
    return logits.detach(), loss.item(), grad_sq


def check_parity(name: str, probe, ref: tuple[torch.Tensor, float, float]) -> dict:
    """Relative errors of logits, loss and gradient norm²; ParityFailure past RTOL (or non-finite)."""
    logits, loss, grad_sq = ref
    errors = {
        "logits": relative_error(probe.logits, logits),
        "loss": relative_error(torch.tensor(probe.loss), torch.tensor(loss)),
        "grad_sq": relative_error(torch.tensor(probe.grad_sq), torch.tensor(grad_sq)),
    }
    bad = {k: v for k, v in errors.items() if not v <= RTOL}  # `not <=`: NaN fails too
    if bad:
        raise ParityFailure(
            f"arm '{name}' differs from the unsharded model: "
            + ", ".join(f"{k} relative error {v:.2e}" for k, v in bad.items())
            + f" (tolerance {RTOL})"
        )
    return errors


def time_interleaved(
    steps: dict, warmup: int, samples: int, device: str = "cpu"
) -> dict[str, list[float]]:
    """Milliseconds per step of every arm, rounds of one step each, every order of the arms in turn;
    a sample is the slowest rank's time (one all-reduce at the end, so timing adds no communication
    to the steps)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    order = interleaved_orders(tuple(steps), warmup + samples, warmup)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r, names in enumerate(order):
        for name in names:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            steps[name]()
            sync()
            if r >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    table = torch.tensor([times[n] for n in steps], dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {n: table[i].tolist() for i, n in enumerate(steps)}


def _comm_time(collectives, device: str = "cpu", reps: int = 5) -> float:
    """Milliseconds one step spends in its collectives, timing each (op, size) alone on this process
    group."""
    cache: dict[tuple[str, int], float] = {}
    total = 0.0
    for c in collectives:
        key = (c.op, c.buffer_bytes)
        if key not in cache:
            n = dist.get_world_size()
            full = torch.zeros(-(-max(1, c.buffer_bytes // 4) // n) * n, device=device)
            part = torch.zeros(full.numel() // n, device=device)
            run = {
                "all_reduce": lambda: dist.all_reduce(full),
                "all_gather": lambda: dist.all_gather_into_tensor(full, part),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
            }[c.op]
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            if device == "cuda":
                torch.cuda.synchronize()
            cache[key] = (time.perf_counter() - t0) * 1e3 / reps
        total += cache[key]
    return total


def inputs(world: int, cfg: Config) -> Inputs:
    """On a rank: what every arm is built from. The GPT from seed 0, one batch from seed 1, and the
    job's plan (parsed and checked once, by the pre-flight) matched to the GPT."""
    mesh = init_device_mesh(cfg.device, (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    base = GPT(cfg.gpt()).to(cfg.device)
    ids = torch.randint(
        0, cfg.vocab_size, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    ids = ids.to(cfg.device)
    with torch.device("meta"):
        checked = trusted(cfg.plan_ir(), GPT(cfg.gpt()), world)
    return Inputs(base, mesh, ids[:, :-1], ids[:, 1:], checked)


def measure(rank: int, world: int, cfg: Config, builders: dict | None = None) -> dict:
    """Run on every rank; rank 0's dict is the result. `builders` replaces the arm registry (tests
    plant a broken arm this way)."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    builders = builders or ARMS
    given = inputs(world, cfg)
    base, x, y = given.base, given.x, given.y
    out: dict = {"config": cfg.to_json(), "baseline_version": BASELINE_VERSION, "ok": False}
    ref = _reference(base, x, y)
    arms = {name: builders[name](given) for name in cfg.arms}
    probes = {name: arm.probe() for name, arm in arms.items()}
    try:
        out["parity"] = {name: check_parity(name, p, ref) for name, p in probes.items()}
    except ParityFailure as err:
        # every rank saw the same gathered tensors, so every rank stops here
        out["error"] = str(err)
        return out
    out["collectives"] = {name: p.collectives for name, p in probes.items()}
    out["comm_bytes"] = {name: p.comm_bytes for name, p in probes.items()}
    out["param_bytes_per_rank"] = {name: a.param_bytes for name, a in arms.items()}
    out["param_bytes_unsharded"] = sum(p.numel() * p.element_size() for p in base.parameters())
    out["times_ms"] = time_interleaved(
        {n: a.step for n, a in arms.items()}, cfg.warmup, cfg.samples, cfg.device
    )
    if "dtp" in arms:
        # tp 1: plain, as the arm runs
        steps = schedule(given.checked, world, cfg.batch, cfg.seq)
        out["analytic_collectives"] = summarize(steps, world)["by_op"]
        out["comm_ms"] = _comm_time(steps, cfg.device)
    out["flops_per_step"] = flops_per_token(cfg.gpt(), cfg.seq) * cfg.batch * cfg.seq
    out["ok"] = True
    return out


def preflight(cfg: Config) -> Prepared:
    """The pre-flight of one configuration (dtp.runtime.preflight, as every command's): the world,
    the device and the plan's text checked against the GPT at cfg.tp, before any rank starts."""
    return prepare(cfg, source=cfg.source())


def run(prepared: Prepared, fn=None) -> dict:
    """`fn(rank, world, cfg)` (default: `measure`) on the prepared configuration's ranks (the one
    launch); rank 0's result. CPU ranks get one intra-op thread each: the arms and the utilization
    assume it."""
    threads = None if prepared.device == "cuda" else 1
    return launch(prepared, fn or measure, prefix="dtp-bench-", threads=threads)[0]
