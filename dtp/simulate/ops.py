"""Every kernel of one forward pass, recorded on the meta device: what each op is (a GEMM, attention, or
memory-bound), its FLOPs or the elements it reads and writes, and whether tensor parallelism splits it.

The FLOP totals come from `flops.py`; this module gives the *time* model what FLOPs alone miss: the
elementwise work (LayerNorm, GELU, residual adds, dropout, softmax, embedding lookups) that moves bytes
rather than multiplying, which tp leaves whole outside the colwise→rowwise span, and the number of ops,
each of which pays a fixed dispatch/launch cost.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

ATTENTION = ("bmm", "baddbmm", "scaled_dot_product")


@dataclass(frozen=True)
class Op:
    """One kind of forward op on one sequence, `count` times: GEMM/attention FLOPs or memory traffic."""

    kind: str  # "gemm", "attention" or "memory"
    flops: int
    elements: int  # floating-point elements read + written (memory ops; × the run's element size = bytes)
    split: bool  # tp divides this op's work
    in_block: bool  # inside a repeated block: full recompute runs it again
    count: int


class Recorder(TorchDispatchMode):
    """Records each aten op of a forward pass with the innermost module it ran in (views are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = ModuleTracker()
        self.raw: list[tuple[str, str, int, int]] = []  # (module path, kind, flops, bytes)

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
        path = path.split(".", 1)[1] if "." in path else ""  # "ClassName.a.b" → "a.b"; the root → ""
        packet = func.overloadpacket
        if packet in flop_registry:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            self.raw.append((path, "attention" if any(a in name for a in ATTENTION) else "gemm", flops, 0))
        else:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() for t in tensors if t.is_floating_point())  # in elements
            if nbytes:
                self.raw.append((path, "memory", 0, nbytes))
        return out


def summarize(raw: list[tuple[str, str, int, int]], sharded: dict[str, str], blocks: list[str]) -> tuple[Op, ...]:
    """Group recorded ops; `sharded` maps module path → style (colwise/rowwise/vocab_parallel)."""
    colwise_parents = {p.rsplit(".", 1)[0] if "." in p else "" for p, s in sharded.items() if s == "colwise"}
    counts: Counter = Counter()
    for path, kind, flops, nbytes in raw:
        within = any(path == b or path.startswith(b + ".") for b in blocks)
        if kind == "gemm":
            split = any(p == path or p.startswith(path + ".") for p in sharded) if path else False
        else:  # between a colwise and its rowwise (heads, GELU): the tensor is sharded over tp
            split = any(path == c or path.startswith(c + ".") for c in colwise_parents if c)
        counts[kind, flops, nbytes, split, within] += 1
    return tuple(Op(k, f, b, s, w, n) for (k, f, b, s, w), n in sorted(counts.items()))
