"""One benchmark configuration on `tp` ranks, in one process group: build every arm from the same
weights, prove each equal to the unsharded model (a configuration whose arm fails parity fails,
untimed), then time the arms step by step, round-robin, and keep every sample."""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtp.bench.arms import ARMS, gpt_config
from dtp.bench.megatron import BASELINE_VERSION, flops_per_token, relative_error
from dtp.bench.stats import interleaved_orders
from dtp.cost.schedule import schedule, summarize
from dtp.models.gpt import GPT, GPTConfig

RTOL = 1e-4  # float32, as `dtp apply`: sharding only reorders sums


@dataclass(frozen=True)
class Config:
    """One point of a scaling curve."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    seq: int
    batch: int
    tp: int
    warmup: int = 2  # untimed rounds
    samples: int = 20  # timed rounds: every arm once per round
    arms: tuple[str, ...] = ("dtp", "hand", "megatron")
    device: str = "cpu"  # "cuda": NCCL ranks, one GPU each (the GPU check)

    def gpt(self) -> GPTConfig:
        """The model."""
        return gpt_config(self.n_layer, self.n_head, self.n_embd, self.vocab_size, self.seq)


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


def measure(rank: int, world: int, cfg: Config, builders: dict | None = None) -> dict:
    """Run on every rank; rank 0's dict is the result. `builders` replaces the arm registry (tests
    plant a broken arm this way)."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    builders = builders or ARMS
    mesh = init_device_mesh(cfg.device, (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    base = GPT(cfg.gpt()).to(cfg.device)
    ids = torch.randint(
        0, cfg.vocab_size, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    ids = ids.to(cfg.device)
    x, y = ids[:, :-1], ids[:, 1:]
    out: dict = {"config": asdict(cfg), "baseline_version": BASELINE_VERSION, "ok": False}
    ref = _reference(base, x, y)
    arms = {name: builders[name](base, mesh, x, y) for name in cfg.arms}
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
        steps = schedule(arms["dtp"].extra["checked"], world, cfg.batch, cfg.seq)
        out["analytic_collectives"] = summarize(steps, world)["by_op"]
        out["comm_ms"] = _comm_time(steps, cfg.device)
    out["flops_per_step"] = flops_per_token(cfg.gpt(), cfg.seq) * cfg.batch * cfg.seq
    out["ok"] = True
    return out
