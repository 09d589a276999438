"""Check rules for norms on sharded features: a `sharded_norm` must be an RMS norm (its forward is
probed against the formula the style computes) laid out as the colwise output it normalises, and a
norm left whole over a sharded output is refused (the style: dtp/compiler/sharded_norm.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from dtp.layout.attention import attention_like, config_heads
from dtp.layout.norms import epsilon, is_norm, rms_norm
from dtp.layout.parts import equal_parts
from dtp.layout.placement import ParamPlacement
from dtp.layout.resolve import generic_path, sharded_colwise
from dtp.layout.styles import Style

if TYPE_CHECKING:
    from dtp.lang import ir
    from dtp.layout.resolve import Resolution


def _probe_error(module: nn.Module) -> str | None:
    """None when the module's own forward computes `rms_norm` (on a random probe, float32), else why
    not."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return "sharded_norm applies to a norm with a 1-D weight"
    gen = torch.Generator().manual_seed(0)
    # beside any buffers
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")
    # whatever the default device
    w = (torch.randn(weight.shape, generator=gen, device="cpu") + 1).to(device)
    x = torch.randn(2, 3, weight.shape[0], generator=gen, device="cpu").to(device)
    try:
        got = torch.func.functional_call(module, {"weight": w}, (x,))
    except Exception as err:  # noqa: BLE001 - a module whose forward cannot run on the probe (needs other inputs)
        return f"its forward could not run on a probe input ({type(err).__name__})"
    want = rms_norm(x, w, epsilon(module), x.shape[-1], lambda t: t)
    if (
        not isinstance(got, torch.Tensor)
        or got.shape != want.shape
        or not torch.allclose(got, want, 1e-5, 1e-6)
    ):
        return (
            "its forward is not an RMS norm w · x / sqrt(mean(x²) + eps) (checked on a probe "
            "input), the one "
            "formula sharded_norm computes from a sum of squares"
        )
    return None


def _width(module: nn.Module) -> int:
    return module.weight.shape[0]


def check_sharded_norm(res: Resolution, path: str, style: ir.Style, rep) -> None:
    """The module is an RMS norm (probed), no part is replicated, and a colwise sibling of the same
    width is laid out alike (the norm's slice must be the features its rank holds)."""
    module = res.modules[path]
    length = len(style.name)
    problem = _probe_error(module)
    if problem:
        rep.add(style.pos, length, path, f"{problem}; this module is {type(module).__name__}")
        return
    mine = res.placements(path)["weight"]
    if any(kind is False for _, kind in mine.parts):
        rep.add(
            style.pos,
            length,
            path,
            "sharded_norm cannot keep a part whole (replicate(…)): the sum of squares "
            "would count it once per rank; list only sharded or repeat(kv) parts",
        )
        return
    parent = path.rpartition(".")[0]
    siblings = [
        p
        for p, r in res.claims.items()
        if p.rpartition(".")[0] == parent
        and r.style.name == Style.COLWISE
        and getattr(res.modules[p], "out_features", None) == _width(module)
    ]
    layout = _parts(mine, _width(module))
    if siblings and not any(
        _parts(res.placements(p)["weight"], _width(module)) == layout for p in siblings
    ):
        name = siblings[0].rsplit(".", 1)[-1]
        theirs = res.claims[siblings[0]].style.option("packed")
        hint = (
            f"sharded_norm(packed={theirs})"
            if theirs is not None
            else "sharded_norm without packed"
        )
        rep.add(
            style.pos,
            length,
            path,
            f"its {_width(module)} features are laid out unlike those of {name}, the "
            "colwise projection of that width beside it, so a rank's weight slice would not match "
            "its "
            f"features; use {hint}",
        )


def _parts(placement: ParamPlacement, width: int) -> tuple:
    return placement.parts or equal_parts(width, placement.packed)


def check_unsharded_norms(res: Resolution, rep) -> None:
    """A norm inside attention as wide as a colwise sibling's sharded output normalises that whole
    output (OLMo2's q_norm over q_proj): left unsharded it would read a slice as the full features."""
    info = config_heads(res.modules[""]) if "" in res.modules else None
    colwise = sharded_colwise(res)
    for path, module in res.modules.items():
        rule = res.claims.get(path)
        if not is_norm(module) or (rule and rule.style.name != Style.REPLICATE) or "." not in path:
            continue
        parent = path.rpartition(".")[0]
        weight = getattr(module, "weight", None)
        if (
            not attention_like(res.modules[parent])
            or not isinstance(weight, torch.Tensor)
            or weight.dim() != 1
        ):
            continue
        if info is not None and weight.shape[0] == info.head_dim:
            # a per-head norm (Qwen3's, Phi's qk_layernorm): one key/value head is as wide as its
            # output
            continue
        for proj in colwise.get(parent, ()):
            claim = res.claims[proj]
            if getattr(res.modules[proj], "out_features", None) != weight.shape[0]:
                continue
            name = path.rsplit(".", 1)[-1]
            rep.add(
                claim.style.pos,
                len(claim.style.name),
                proj,
                f"{name} ({type(module).__name__}) normalises over "
                f"{weight.shape[0]} features, the whole output of this colwise layer, of which each "
                "rank holds a "
                f"slice; shard it too with `{generic_path(path)}: sharded_norm` (its sum of squares "
                "is all-reduced), "
                "or gather this output (output=replicate)",
            )
            break
