"""`sharded_norm`: an RMS norm over a feature dimension that a colwise layer shards (OLMo2's q_norm and k_norm
normalise the whole q and k projections, every head together).

Each rank holds its slice x_r of the features and the matching slice w_r of the norm's weight. The only
cross-rank quantity is the sum of squares over all F features, so each rank computes

    y_r = w_r · x_r / sqrt(Σ_ranks Σ x_r² / F + eps)

with one all-reduce of a (batch, seq, 1) buffer in the forward pass and one of its gradient in the backward
pass (every rank's output depends on every rank's sum: Megatron's f and g around a scalar per token). The
weight's gradient needs no reduction: each rank's slice is its own. Statistics are kept in at least float32,
as Hugging Face's RMSNorms keep them.

A part list (`sharded_norm(packed=[repeat(kv)])`) lays the weight out as the colwise projection before it:
with key/value heads repeated over ranks (tp a multiple of them), each head is held by tp/H ranks, so the
all-reduced sum counts every head tp/H times over tp·F_local = (tp/H)·F features: the mean is exact, and the
repeated weight rows' gradient is summed over the ranks that share them (dtp/layouts.py).

What the module computes is not assumed: `check` runs its own forward on a probe input and compares it with
the formula above, so a norm with another formula (Gemma's 1 + weight, a LayerNorm's mean) is refused.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from dtp.layouts import all_reduce_grad, distribute_param, equal_parts
from dtp.placement import Placement
from dtp.resolve import generic_path, sharded_colwise

if TYPE_CHECKING:
    from dtp import ir
    from dtp.resolve import Resolution


def epsilon(module: nn.Module) -> float | None:
    """The norm's epsilon (`variance_epsilon` in Hugging Face, `eps` in torch; None: torch's default)."""
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None, features: int,
             reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """w · x / sqrt(reduce(Σ x²) / features + eps), the statistics in at least float32."""
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    squares = reduce(xf.pow(2).sum(-1, keepdim=True))  # (batch, seq, 1)
    eps = torch.finfo(dtype).eps if eps is None else eps
    normed = xf * torch.rsqrt(squares / features + eps)
    return (weight.to(xf.dtype) * normed).to(dtype)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce forward; all-reduce of the gradient backward (every rank's output reads the sum)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return all_reduce_grad(t.contiguous(), mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_grad(grad.contiguous(), ctx.mesh), None


class ShardedNorm(ParallelStyle):
    """An RMS norm on this rank's slice of a colwise-sharded feature dimension: weight sharded like the
    features (`placement`), the sum of squares all-reduced; reads and hands on local slices."""

    def __init__(self, placement: Placement):
        super().__init__()
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_param(module, "weight", self.placement, device_mesh)
        tp, eps = device_mesh.size(), epsilon(module)

        def reduce(t: torch.Tensor) -> torch.Tensor:
            return _SumOverRanks.apply(t, device_mesh) if tp > 1 else t

        def forward(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
            x = args[0] if args else next(iter(kwargs.values()))  # the norm's one input, however it is passed
            if isinstance(x, DTensor):
                x = x.redistribute(placements=[Shard(-1)]).to_local()
            return rms_norm(x, module.weight.to_local(), eps, x.shape[-1] * tp, reduce)

        module.forward = forward
        return module

    def __repr__(self) -> str:
        return f"ShardedNorm({self.placement})"


# ---- check rules --------------------------------------------------------------------------------------

def _probe_error(module: nn.Module) -> str | None:
    """None when the module's own forward computes `rms_norm` (on a random probe, float32), else why not."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return "sharded_norm applies to a norm with a 1-D weight"
    gen = torch.Generator().manual_seed(0)
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")  # beside any buffers
    w = (torch.randn(weight.shape, generator=gen, device="cpu") + 1).to(device)  # whatever the default device
    x = torch.randn(2, 3, weight.shape[0], generator=gen, device="cpu").to(device)
    try:
        got = torch.func.functional_call(module, {"weight": w}, (x,))
    except Exception as err:  # a module whose forward cannot run on the probe (needs other inputs)
        return f"its forward could not run on a probe input ({type(err).__name__})"
    want = rms_norm(x, w, epsilon(module), x.shape[-1], lambda t: t)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(got, want, 1e-5, 1e-6):
        return ("its forward is not an RMS norm w · x / sqrt(mean(x²) + eps) (checked on a probe input), the one "
                "formula sharded_norm computes from a sum of squares")
    return None


def _width(module: nn.Module) -> int:
    return module.weight.shape[0]


def check_sharded_norm(res: Resolution, path: str, style: ir.Style, rep) -> None:
    """The module is an RMS norm (probed), no part is replicated, and a colwise sibling of the same width is
    laid out alike (the norm's slice must be the features its rank holds)."""
    module = res.modules[path]
    length = len(style.name)
    problem = _probe_error(module)
    if problem:
        rep.add(style.pos, length, path, f"{problem}; this module is {type(module).__name__}")
        return
    mine = res.placements(path)["weight"]
    if any(kind is False for _, kind in mine.parts):
        rep.add(style.pos, length, path, "sharded_norm cannot keep a part whole (replicate(…)): the sum of squares "
                "would count it once per rank; list only sharded or repeat(kv) parts")
        return
    parent = path.rpartition(".")[0]
    siblings = [p for p, r in res.claims.items() if p.rpartition(".")[0] == parent and r.style.name == "colwise"
                and getattr(res.modules[p], "out_features", None) == _width(module)]
    layout = _parts(mine, _width(module))
    if siblings and not any(_parts(res.placements(p)["weight"], _width(module)) == layout for p in siblings):
        name = siblings[0].rsplit(".", 1)[-1]
        theirs = res.claims[siblings[0]].style.option("packed")
        hint = f"sharded_norm(packed={theirs})" if theirs is not None else "sharded_norm without packed"
        rep.add(style.pos, length, path, f"its {_width(module)} features are laid out unlike those of {name}, the "
                f"colwise projection of that width beside it, so a rank's weight slice would not match its "
                f"features; use {hint}")


def _parts(placement: Placement, width: int) -> tuple:
    return placement.parts or equal_parts(width, placement.packed)


def check_unsharded_norms(res: Resolution, rep) -> None:
    """A norm inside attention as wide as a colwise sibling's sharded output normalises that whole output
    (OLMo2's q_norm over q_proj): left unsharded it would read a slice as the full features."""
    from dtp.attention import attention_like
    from dtp.placement import is_norm

    from dtp.models import heads

    info = heads(res.modules[""]) if "" in res.modules else None
    colwise = sharded_colwise(res)
    for path, module in res.modules.items():
        rule = res.claims.get(path)
        if not is_norm(module) or (rule and rule.style.name != "replicate") or "." not in path:
            continue
        parent = path.rpartition(".")[0]
        weight = getattr(module, "weight", None)
        if not attention_like(res.modules[parent]) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        if info is not None and weight.shape[0] == info.head_dim:
            continue  # a per-head norm (Qwen3's, Phi's qk_layernorm): one key/value head is as wide as its output
        for proj in colwise.get(parent, ()):
            claim = res.claims[proj]
            if getattr(res.modules[proj], "out_features", None) != weight.shape[0]:
                continue
            name = path.rsplit(".", 1)[-1]
            rep.add(claim.style.pos, len(claim.style.name), proj, f"{name} ({type(module).__name__}) normalises over "
                    f"{weight.shape[0]} features, the whole output of this colwise layer, of which each rank holds a "
                    f"slice; shard it too with `{generic_path(path)}: sharded_norm` (its sum of squares is all-reduced), "
                    "or gather this output (output=replicate)")
            break
