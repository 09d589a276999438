"""One decoded token (`dtp simulate --decode`): when tensor parallelism stops paying for decoding.

A decode step at a small batch does little arithmetic per byte: every rank reads its weights and its
part of the KV cache once per token, so its time is memory time, and tp divides it. What tp adds is
latency: the plan's forward collectives for one token (Megatron's all-reduce after each rowwise
layer, the vocabulary-parallel embedding's) plus the greedy choice's all-gather of vocabulary-parallel
logits, each a few kilobytes, so each costs its latency, not its bytes:

    t(token) = (weight bytes + KV bytes) per rank / (HBM GB/s × HBM_FRACTION)
             + Σ over the collectives (2 ⌈log₂ tp⌉ × latency_us + bytes / bus GB/s)

(a CPU profile adds its op overhead to each collective; a GPU queues kernels, and a compiled decode
replays them as one graph, so the launch is hidden).

Weight bytes per rank come from the plan's placement table (dtp.cost.param_bytes: what is replicated
is read by every rank), the collectives from the plan's own schedule (dtp.cost.schedule) at one token
per row; KV bytes are 2 × layers × key/value heads per rank × head size × context × batch (a block
whose attention the plan leaves whole caches every head on every rank). Small
collectives run as NCCL's tree/LL protocols do, in log₂ tp steps each way, not a ring's 2(tp − 1).

HBM_FRACTION is FITTED, one number: gpt-fast's Llama-2-7B row at TP 1 on A100-80GB (104.9 tokens/s,
1,397 of 2,039 GB/s). Everything else is the hardware profile's published values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from dtp import models
from dtp.checks.checker import Checked, check
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.cost.schedule import schedule, sent_bytes
from dtp.errors import PlanError, UsageError
from dtp.files import write_text
from dtp.lang.parse import load
from dtp.layout.attention import PROJECTIONS
from dtp.layout.styles import Style
from dtp.simulate import profile
from dtp.simulate.flops import block_paths
from dtp.simulate.prepare import shape_of
from dtp.simulate.profile import Profile

HBM_FRACTION = 1397 / 2039  # FITTED: gpt-fast, Llama-2-7B, TP 1, A100-80GB
ELEMENT = {"fp16": 2, "bf16": 2, "fp32": 4}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# the projections that make keys and values (a query-only one says nothing about the cache)
KV_PROJECTIONS = PROJECTIONS - {"q_proj", "q_attn", "wq", "query"}


@dataclass(frozen=True)
class DecodeStep:
    """One predicted decode step at one tp."""

    tp: int
    weight_bytes: int  # per rank, the largest rank's
    kv_bytes: int  # per rank
    memory_ms: float
    collectives: int
    comm_ms: float

    @property
    def ms(self) -> float:
        """Time per decode step."""
        return self.memory_ms + self.comm_ms

    def tokens_per_s(self, batch: int) -> float:
        """Tokens per second over the batch's rows."""
        return batch * 1e3 / self.ms

    def gbps_per_gpu(self) -> float:
        """The memory bandwidth a GPU achieves over the whole step (gpt-fast's metric)."""
        return (self.weight_bytes + self.kv_bytes) / (self.ms * 1e-3) / 1e9


def kv_bytes(model: nn.Module, tp: int, batch: int, context: int, elem: int) -> int:
    """The KV cache one rank holds: its key/value heads (at least one) for `context` tokens."""
    s = shape_of(model)
    head = s.hidden // s.heads
    local = max(1, math.ceil((s.kv_heads or s.heads) / tp))
    return 2 * s.layers * local * head * context * batch * elem


def whole_attention_blocks(checked: Checked, model: nn.Module) -> int:
    """Blocks whose key/value projections the plan leaves replicated (`dtp plan --auto` does so
    where the heads do not divide by tp): every rank computes, and caches, all their heads."""
    r = checked.resolution
    whole = 0
    for block in block_paths(model):
        kv = [
            f"{block}.{path}"
            for path, _ in model.get_submodule(block).named_modules()
            if path.rsplit(".", 1)[-1] in KV_PROJECTIONS
        ]
        placed = [r.placements(path).get("weight") for path in kv]
        if placed and all(p is None or p.shard_dim is None for p in placed):
            whole += 1
    return whole


def plan_kv_bytes(
    checked: Checked, model: nn.Module, tp: int, batch: int, context: int, elem: int
) -> int:
    """The KV cache one rank holds under the plan: its own heads in the blocks whose attention is
    split, every head in those left whole."""
    layers = shape_of(model).layers
    whole = whole_attention_blocks(checked, model)
    split = kv_bytes(model, tp, batch, context, elem) // layers
    full = kv_bytes(model, 1, batch, context, elem) // layers
    return split * (layers - whole) + full * whole


def collective_s(op: str, nbytes: int, tp: int, prof: Profile) -> float:
    """A small collective inside a node: overhead, log₂ tp latency steps each way, its bytes."""
    if tp <= 1:
        return 0.0
    link = prof.intra
    steps = 2 * math.ceil(math.log2(tp))
    # a GPU queues its kernels (and a compiled decode replays them as one graph): the launch is
    # hidden; a CPU rank pays it
    overhead = 0.0 if prof.async_ops else prof.op_overhead_us
    return (overhead + steps * link.latency_us) * 1e-6 + sent_bytes(
        op, nbytes, tp
    ) / link.bytes_per_s


def decode_step(
    checked: Checked,
    model: nn.Module,
    tp: int,
    prof: Profile,
    *,
    batch: int,
    context: int,
    precision: str,
) -> DecodeStep:
    """The predicted step of `checked` (the plan at `tp`) decoding `batch` rows at `context`
    tokens of cache."""
    elem = ELEMENT[precision]
    weights = max(param_bytes_per_rank(checked, model, tp, 1, elem=elem))
    kv = plan_kv_bytes(checked, model, tp, batch, context, elem)
    memory_s = (weights + kv) / (prof.hbm_GBps * 1e9 * HBM_FRACTION)
    ops = [
        (c.op, c.buffer_bytes)
        for c in schedule(checked, tp, batch, 1, dtype=DTYPE[precision], model=model, plain=tp == 1)
        if c.phase == "forward" and "cross-entropy" not in c.reason
    ]
    vocab = shape_of(model).vocab
    if tp > 1 and _sharded_logits(checked):
        ops.append(("all_gather", batch * vocab * elem))  # the greedy choice sees every logit
    comm_s = sum(collective_s(op, nbytes, tp, prof) for op, nbytes in ops)
    return DecodeStep(tp, weights, kv, memory_s * 1e3, len(ops), comm_s * 1e3)


def _sharded_logits(checked: Checked) -> bool:
    """Whether the plan splits the output head by vocabulary (its logits then need gathering)."""
    r = checked.resolution
    return any(
        rule.style.name == Style.VOCAB_PARALLEL and isinstance(r.modules[path], nn.Linear)
        for path, rule in r.claims.items()
    )


def tp_values(prof: Profile, asked: int) -> list[int]:
    """1, 2, 4, … up to the node's GPUs, and `asked` if beyond them."""
    out, tp = [], 1
    while tp <= prof.gpus_per_node:
        out.append(tp)
        tp *= 2
    return sorted(set(out) | {asked})


def decode_table(
    plan: str, model: str, prof: Profile, *, tp: int, batch: int, context: int, precision: str
) -> dict:
    """The predicted decode step at every tp the plan allows; the fastest, and what limits it."""
    meta = models.build(models.resolve(model), device="meta")
    parsed = load(plan)
    rows, refused = [], {}
    for n in tp_values(prof, tp):
        try:
            checked = check(parsed, meta, n)
        except PlanError as err:  # this tp does not divide something: not a row
            refused[n] = str(err).splitlines()[0]
            continue
        step = decode_step(
            checked, meta, n, prof, batch=batch, context=context, precision=precision
        )
        rows.append(
            {
                "tp": n,
                "ms_per_token": step.ms,
                "tokens_per_s": step.tokens_per_s(batch),
                "gbps_per_gpu": step.gbps_per_gpu(),
                "weight_bytes_per_rank": step.weight_bytes,
                "kv_bytes_per_rank": step.kv_bytes,
                "memory_ms": step.memory_ms,
                "collectives": step.collectives,
                "comm_ms": step.comm_ms,
            }
        )
    if not rows:
        raise UsageError(f"{plan} fits none of tp {', '.join(map(str, refused))} for {model}")
    best = min(rows, key=lambda r: r["ms_per_token"])
    return {
        "profile": prof.name,
        "batch": batch,
        "context": context,
        "precision": precision,
        "rows": rows,
        "fastest_tp": best["tp"],
        "refused": refused,
        "hbm_fraction": HBM_FRACTION,
    }


def render_table(t: dict) -> str:
    """The table and the verdict, in words."""
    lines = [
        f"decode step on {t['profile']}: {t['batch']} row(s), {t['context']} tokens of KV cache, "
        f"{t['precision']} (memory at {t['hbm_fraction']:.3f} of HBM bandwidth, fitted on gpt-fast's "
        "TP 1 row)",
        "",
        "| tp | ms/token | tokens/s | GB/s per GPU | collectives | memory ms | collectives ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in t["rows"]:
        lines.append(
            f"| {r['tp']} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['gbps_per_gpu']:.0f} | {r['collectives']} | {r['memory_ms']:.2f} | "
            f"{r['comm_ms']:.2f} |"
        )
    best = next(r for r in t["rows"] if r["tp"] == t["fastest_tp"])
    larger = [r for r in t["rows"] if r["tp"] > best["tp"]]
    lines.append("")
    if larger:
        nxt = larger[0]
        lines.append(
            f"fastest at tp {best['tp']}: at tp {nxt['tp']} the {nxt['collectives']} collectives "
            f"per token take {nxt['comm_ms']:.2f} ms, more than the {best['memory_ms'] - nxt['memory_ms']:.2f} ms "
            "of memory time the extra ranks save"
        )
    else:
        lines.append(f"fastest at tp {best['tp']}, the largest tp here: tp still pays")
    for n, why in t["refused"].items():
        lines.append(f"tp {n}: not a row ({why})")
    return "\n".join(lines)


def decode_command(
    *,
    plan: str | None,
    model: str | None,
    profile_name: str | None,
    tp: int,
    batch: int,
    context: int,
    precision: str,
    json_path: str | None,
) -> int:
    """`dtp simulate PLAN MODEL --profile P --decode`: print the table (and write it as JSON)."""
    if not (plan and model and profile_name):
        raise UsageError("--decode needs PLAN, MODEL and --profile")
    table = decode_table(
        plan,
        model,
        profile.load(profile_name),
        tp=tp,
        batch=batch,
        context=context,
        precision=precision,
    )
    print(render_table(table))
    if json_path:
        write_text(json_path, json.dumps(table, indent=2) + "\n", "--json")
    return 0
