"""FLOPs of one training iteration, counted on the actual model (meta device, torch's
FlopCounterMode), and the closed forms they are checked against (Narayanan et al. 2021, eqs. 2–3).

Counting is per module and per sequence: a forward pass over one sequence of `seq` tokens is timed
by nothing and allocates nothing (meta tensors carry shapes only); a batch of B sequences costs B
times that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dtp.layout.resolve import Resolution
from dtp.layout.styles import Style
from dtp.simulate.ops import LOSS, Recorder, summarize

SHARDING_STYLES = (Style.COLWISE, Style.ROWWISE, Style.VOCAB_PARALLEL)
RECOMPUTE = ("none", "selective", "full", "op")


@dataclass(frozen=True)
class ModuleFlops:
    """Forward FLOPs a module performs itself (children excluded) on one sequence."""

    path: str
    gemm: int  # matrix multiplies with a weight (linear layers, the output head)
    # activation × activation products (QKᵀ, attention × V): what selective recompute redoes
    attention: int
    # the plan splits this work over tp (the module or a child is colwise/rowwise/vocab)
    sharded: bool
    in_block: bool  # inside a repeated block: activation checkpointing recomputes it


@dataclass(frozen=True)
class Flops:
    """Per-module forward FLOPs of one sequence; the iteration totals follow from them."""

    seq: int
    modules: tuple[ModuleFlops, ...]
    ops: tuple = ()  # ops.Op: every kernel of the forward, for the time model

    def forward(self, tp: int = 1) -> float:
        """Forward FLOPs of one sequence on one tensor-parallel rank."""
        return sum((m.gemm + m.attention) / (tp if m.sharded else 1) for m in self.modules)

    def recomputed(self, recompute: str, tp: int = 1) -> float:
        """Forward FLOPs of one sequence that activation checkpointing runs again in backward."""
        if recompute == "none":
            return 0.0
        pick = {
            "full": lambda m: m.gemm + m.attention,
            "selective": lambda m: m.attention,
            "op": lambda m: m.gemm / 2,
        }[recompute]  # op: every other matrix multiply runs again
        return sum(pick(m) / (tp if m.sharded else 1) for m in self.modules if m.in_block)

    def iteration(self, batch: int, recompute: str, tp: int = 1) -> float:
        """FLOPs one rank executes for `batch` sequences: forward, backward (2× forward), recompute."""
        return batch * (3 * self.forward(tp) + self.recomputed(recompute, tp))

    def model_flops(self, batch: int) -> float:
        """Model FLOPs (no recompute) of `batch` sequences over the whole model: 3 × forward."""
        return 3.0 * batch * self.forward(1)


def count(model: nn.Module, seq: int, resolution: Resolution | None = None) -> Flops:
    """Run one forward pass of a meta-device model over one sequence under FlopCounterMode."""
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    if device.type != "meta":
        raise ValueError("flops.count runs on a meta-device model (it never allocates)")
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False, depth=None)
    recorder = Recorder()
    recorder.seq = seq
    with counter, recorder, torch.no_grad():
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        # the training loss: priced as the other ops
        if isinstance(logits, torch.Tensor) and logits.dim() == 3:
            recorder.scope = LOSS
            F.cross_entropy(logits.flatten(0, 1), ids.flatten())
            recorder.scope = None
    totals = {_strip(k): v for k, v in counter.get_flop_counts().items() if k != "Global"}
    blocks = block_paths(model)
    styles = {
        p: rule.style.name
        for p, rule in (resolution.claims.items() if resolution else ())
        if rule.style.name in SHARDING_STYLES
    }
    sharded = set(styles)
    own = {path: dict(ops) for path, ops in totals.items()}
    # FlopCounterMode counts a module's children in it: take them out
    for path, ops in totals.items():
        parent = _tracked_parent(path, totals)
        if parent is not None:
            for op, n in ops.items():
                own[parent][op] -= n
    out = []
    for path, ops in own.items():
        gemm = sum(n for op, n in ops.items() if not _attention_op(op))
        attention = sum(n for op, n in ops.items() if _attention_op(op))
        if gemm or attention:
            split = any(p == path or p.startswith(path + ".") for p in sharded) if path else False
            within = any(path == b or path.startswith(b + ".") for b in blocks)
            out.append(ModuleFlops(path, int(gemm), int(attention), split, within))
    return Flops(seq, tuple(out), summarize(recorder.raw, styles, blocks))


def _strip(key: str) -> str:
    # FlopCounterMode names modules "ClassName.path.to.module"; the root is "ClassName".
    return key.split(".", 1)[1] if "." in key else ""


def _attention_op(op: object) -> bool:
    name = str(op)
    return "bmm" in name or "scaled_dot_product" in name or "baddbmm" in name


def _tracked_parent(path: str, tracked: dict) -> str | None:
    """The nearest enclosing module that FlopCounterMode saw (containers without forward are
    skipped)."""
    if path == "":
        return None
    parts = path.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:k]) in tracked:
            return ".".join(parts[:k])
    return ""


def block_paths(model: nn.Module) -> list[str]:
    """The repeated blocks: children of every ModuleList (what Megatron checkpoints, one per layer)."""
    return [
        f"{path}.{name}" if path else name
        for path, m in model.named_modules()
        if isinstance(m, nn.ModuleList)
        for name, _ in m.named_children()
    ]


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021 eq. 3: FLOPs of one iteration with full recompute (GEMMs only)."""
    return (
        96.0
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    )


def narayanan_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Narayanan et al. 2021 eq. 2: parameters of a GPT (tied embeddings, learned positions)."""
    return (
        12.0
        * layers
        * hidden**2
        * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * layers * hidden))
    )
