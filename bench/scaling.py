"""One benchmark configuration on `tp` ranks: dtp's compiled plan, a hand-written `parallelize_module` plan
with the same placements, and the Megatron-style baseline — same weights, same batch, checked equal first,
then timed side by side."""
from __future__ import annotations

import copy
import resource
import statistics
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from bench.megatron import BASELINE_VERSION, MegatronGPT, allclose_report, flops_per_token
from dtp.shard import apply
from dtp.comm import CommCounter, merge
from dtp.models.gpt import GPT, GPTConfig
from dtp.schedule import schedule, summarize
from dtp.styles import pack_rows
from dtp.syntax import load


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
    warmup: int = 2
    steps: int = 5
    plan: str = "plans/gpt2.tp"

    def gpt(self) -> GPTConfig:
        """The model."""
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, vocab_size=self.vocab_size,
                         block_size=self.seq, bias=True, tie_embeddings=True)


def handwritten(model: GPT, mesh) -> None:
    """The placements of plans/gpt2.tp written directly against torch's API (what dtp saves you)."""
    tp = mesh.size()
    with torch.no_grad():  # head-aligned QKV the manual way: reorder rows, then plain ColwiseParallel
        for block in model.transformer.h:
            for name in ("weight", "bias"):
                p = getattr(block.attn.c_attn, name)
                p.copy_(pack_rows(p, 3, tp))
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.transformer.h)):
        plan |= {f"transformer.h.{i}.attn.c_attn": ColwiseParallel(), f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                 f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(), f"transformer.h.{i}.mlp.c_proj": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.transformer.wte.weight


def _time(step, warmup: int, steps: int) -> tuple[float, list[float]]:
    """(median milliseconds, every timed step's milliseconds) after `warmup` untimed steps."""
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    timed = times[warmup:]
    return statistics.median(timed), timed


def _comm_time(collectives, reps: int = 5) -> float:
    """Milliseconds one step spends in its collectives, timing each (op, size) alone on this process group."""
    cache: dict[tuple[str, int], float] = {}
    total = 0.0
    for c in collectives:
        key = (c.op, c.buffer_bytes)
        if key not in cache:
            n = dist.get_world_size()
            numel = max(1, c.buffer_bytes // 4)
            full = torch.zeros(-(-numel // n) * n)
            part = torch.zeros(full.numel() // n)
            run = {"all_reduce": lambda: dist.all_reduce(full),
                   "all_gather": lambda: dist.all_gather_into_tensor(full, part),
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full)}[c.op]
            cache[key], _ = _time(run, 1, reps)
        total += cache[key]
    return total


def gemm_peak(n: int = 512, reps: int = 20) -> float:
    """Single-thread fp32 GEMM FLOP/s on this machine (the CPU's 'peak' for utilization)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def measure(rank: int, world: int, cfg: Config) -> dict:
    """Run on every rank; rank 0's dict is the result."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    base = GPT(cfg.gpt())
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    out: dict = {"config": asdict(cfg), "baseline_version": BASELINE_VERSION}

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01)

    # dtp
    model = copy.deepcopy(base)
    applied = apply(load(cfg.plan), model, mesh)
    opt = sgd(model.parameters())

    def train_step(net, optimizer):
        logits = net(x)
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    counters = {"forward": CommCounter(), "backward": CommCounter()}
    with loss_parallel():
        with counters["forward"]:
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        with counters["backward"]:
            loss.backward()
    opt.zero_grad()
    dtp_logits = logits.full_tensor()
    ref_logits = base(x)
    out["parity_vs_unsharded"] = allclose_report(dtp_logits, ref_logits)
    steps = schedule(applied.checked, world, cfg.batch, cfg.seq)
    out["collectives"], out["analytic_collectives"] = merge(counters), summarize(steps, world)
    out["param_bytes_per_rank"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4
                                      for p in model.parameters())
    out["param_bytes_unsharded"] = sum(p.numel() * 4 for p in base.parameters())
    sharded = sum(p.numel() * 4 for p in model.parameters()
                  if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements))
    out["ideal_param_bytes_per_rank"] = out["param_bytes_unsharded"] - sharded + sharded // world
    out["dtp_ms"], _ = _time(lambda: train_step(model, opt), cfg.warmup, cfg.steps)

    # the hand-written plan with the same placements
    hand = copy.deepcopy(base)
    handwritten(hand, mesh)
    hopt = sgd(hand.parameters())
    out["handwritten_ms"], _ = _time(lambda: train_step(hand, hopt), cfg.warmup, cfg.steps)

    # the Megatron-style baseline, checked equal to dtp before timing
    meg = MegatronGPT(cfg.gpt(), rank, world)
    meg.load_from(base)
    mopt = sgd(meg.parameters())
    local = meg(x)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local.detach().contiguous())
    out["megatron_vs_dtp_logits"] = allclose_report(torch.cat(gathered, dim=-1), dtp_logits)
    out["megatron_vs_dtp_loss"] = abs(meg.loss(local, y).item() - loss.full_tensor().item())

    def meg_step():
        meg.loss(meg(x), y).backward()
        mopt.step()
        mopt.zero_grad()

    out["megatron_ms"], _ = _time(meg_step, cfg.warmup, cfg.steps)

    out["comm_ms"] = _comm_time(steps)
    out["gemm_flops_per_core"] = gemm_peak()
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = cfg.batch * cfg.seq
    out["tokens_per_s"] = tokens / (out["dtp_ms"] / 1e3)
    out["megatron_tokens_per_s"] = tokens / (out["megatron_ms"] / 1e3)
    out["achieved_flops_per_rank"] = flops_per_token(cfg.gpt(), cfg.seq) * tokens / (out["dtp_ms"] / 1e3) / world
    out["utilization"] = out["achieved_flops_per_rank"] / out["gemm_flops_per_core"]
    return out
