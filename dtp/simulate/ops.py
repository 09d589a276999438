"""Every kernel of one forward pass, recorded on the meta device: what each op is (a GEMM,
attention, or memory-bound), its FLOPs or the elements it reads and writes, and whether tensor
parallelism splits it.

The FLOP totals come from `flops.py`; this module gives the *time* model what FLOPs alone miss: the
elementwise work (LayerNorm, GELU, residual adds, dropout, softmax, embedding lookups) that moves
bytes rather than multiplying, which tp leaves whole outside the colwise→rowwise span, and the
number of ops, each of which pays a fixed dispatch/launch cost.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from dtp.layout.styles import Style

ATTENTION = ("bmm", "baddbmm", "scaled_dot_product")
LOSS = "<loss>"  # the path the training loss's ops are recorded under


@dataclass(frozen=True)
class Op:
    """One kind of forward op on one sequence, `count` times: GEMM/attention FLOPs or memory
    traffic."""

    kind: str  # "gemm", "attention" or "memory"
    flops: int
    # floating-point activation elements read + written per sequence (memory ops; × element size)
    elements: int
    split: bool  # tp divides this op's work
    in_block: bool  # inside a repeated block: full recompute runs it again
    count: int
    name: str = ""  # the aten op (a calibrated CPU profile prices memory-bound ops by name)
    # the training loss's (priced only by a profile that measured that op: kernels.py)
    loss: bool = False
    # parameter elements it reads (once per micro-batch, whatever the batch: an embedding table)
    params: int = 0
    params_split: bool = False  # tp shards those parameters (a vocabulary-parallel embedding)
    # it reads or writes a (…, seq, seq) tensor: attention scores (a flash kernel has none)
    score: bool = False


class Recorder(TorchDispatchMode):
    """Records each aten op of a forward pass with the innermost module it ran in (views are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = ModuleTracker()
        # (module path, kind, flops, activation elements, aten op, parameter elements, score-shaped)
        self.raw: list[tuple[str, str, int, int, str, int, bool]] = []
        # set: every op is recorded under this path (the loss, outside any module)
        self.scope: str | None = None
        self.seq: int | None = None  # set: an op on a (…, seq, seq) tensor is an attention-score op

    def __enter__(self):
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out
        name = str(func.overloadpacket)
        path = max(self.tracker.parents, key=len, default="")
        # "ClassName.a.b" → "a.b"; the root → ""
        path = path.split(".", 1)[1] if "." in path else ""
        path = self.scope if self.scope is not None else path
        packet = func.overloadpacket
        # "aten.gelu" → "gelu", and "gelu.tanh" for GELU's tanh approximation (another kernel): a
        # profile's op_GBps key
        short = packet.__name__ + "".join(
            f".{v}" for v in kwargs.values() if isinstance(v, str) and v != "none"
        )
        if packet in flop_registry:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            # a GEMM's elements: its output (what its backward reads as dy)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.raw.append(
                (
                    path,
                    "attention" if any(a in name for a in ATTENTION) else "gemm",
                    flops,
                    sum(t.numel() for t in outs),
                    short,
                    0,
                    False,
                )
            )
        else:
            tensors = [
                t
                for t in tree_flatten((args, kwargs, out))[0]
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            ]
            params = sum(t.numel() for t in tensors if isinstance(t, torch.nn.Parameter))
            elements = sum(t.numel() for t in tensors if not isinstance(t, torch.nn.Parameter))
            score = bool(self.seq) and any(
                t.dim() >= 2 and tuple(t.shape[-2:]) == (self.seq, self.seq) for t in tensors
            )
            if elements or params:
                self.raw.append((path, "memory", 0, elements, short, params, score))
        return out


def summarize(
    raw: list[tuple[str, str, int, int, str, int, bool]], sharded: dict[str, str], blocks: list[str]
) -> tuple[Op, ...]:
    """Group recorded ops; `sharded` maps module path → style (colwise/rowwise/vocab_parallel). Ops
    recorded under LOSS are split when the last GEMM before them (the head) is: a
    vocabulary-parallel loss."""
    colwise_parents = {
        p.rsplit(".", 1)[0] if "." in p else "" for p, s in sharded.items() if s == Style.COLWISE
    }
    head = next((path for path, kind, *_ in reversed(raw) if kind == "gemm" and path != LOSS), "")
    counts: Counter = Counter()
    for path, kind, flops, nbytes, name, params, score in raw:
        within = any(path == b or path.startswith(b + ".") for b in blocks)
        if path == LOSS:
            split = head in sharded
        elif kind == "gemm":
            split = any(p == path or p.startswith(path + ".") for p in sharded) if path else False
        else:  # between a colwise and its rowwise (heads, GELU): the tensor is sharded over tp
            split = any(path == c or path.startswith(c + ".") for c in colwise_parents if c)
        counts[
            kind,
            flops,
            nbytes,
            split,
            within,
            name,
            path == LOSS,
            params,
            bool(params) and path in sharded,
            score,
        ] += 1
    return tuple(
        Op(k, f, b, s, w, n, name, loss, p, ps, sc)
        for (k, f, b, s, w, name, loss, p, ps, sc), n in sorted(counts.items())
    )
