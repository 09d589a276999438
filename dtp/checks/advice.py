"""Advice about a plan as a whole: how much of the model it leaves replicated, and whether its
`mesh` header agrees with the data-parallel size it runs at (`mesh dp, tp` needs --dp ≥ 2; `mesh tp`
admits any --dp)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtp.errors import NOWHERE, Diagnostic, Pos
from dtp.lang import ir

if TYPE_CHECKING:  # a model's resolution: torch; `check_mesh` runs in `dtp check PLAN`
    from dtp.layout.resolve import Resolution

# warn when more than this fraction of the parameter bytes stays on every rank
REPLICATED_WARNING = 0.5


def replicated_share(res: Resolution) -> tuple[float, dict[str, int]]:
    """The fraction of parameter bytes no rule shards, and those bytes by module (layer indices as
    `*`)."""
    seen: set[int] = set()
    total = 0
    replicated: dict[str, int] = {}
    for path, module in res.modules.items():
        placements = res.placements(path)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            nbytes = param.numel() * param.element_size()
            total += nbytes
            if placements[name].shard_dim is None:
                key = (
                    ".".join("*" if part.isdigit() else part for part in path.split("."))
                    or "(the model)"
                )
                replicated[key] = replicated.get(key, 0) + nbytes
    return (sum(replicated.values()) / total if total else 0.0), replicated


def replication_warning(plan: ir.Plan, res: Resolution) -> list[Diagnostic]:
    """A warning, at the plan's `dtp 1` line, when most parameter bytes stay replicated."""
    share, by_module = replicated_share(res)
    if share <= REPLICATED_WARNING:
        return []
    total = sum(by_module.values()) / share
    top = sorted(by_module.items(), key=lambda kv: -kv[1])[:3]
    largest = ", ".join(f"{path} {nbytes / total:.0%}" for path, nbytes in top)
    # the `dtp 1` line: the plan as a whole
    where = Pos(plan.version_pos.file, plan.version_pos.line, 1)
    return [
        Diagnostic(
            where,
            f"this plan leaves {share:.0%} of the parameter bytes replicated on every "
            f"rank (largest unsharded: {largest}); shard those with colwise/rowwise pairs to save "
            "memory",
            5,
            "warning",
        )
    ]


def check_mesh(plan: ir.Plan, dp: int | None) -> list[Diagnostic]:
    """`mesh dp, tp` declares data parallelism, so --dp 1 contradicts it. `mesh tp` names the
    dimension the rules shard over and forbids nothing: a tensor-parallel plan runs under any --dp
    (FSDP2 over the dp dimension)."""
    if dp is None or plan.mesh_pos == NOWHERE:
        return []
    if plan.mesh == ("dp", "tp") and dp == 1:
        return [
            Diagnostic(
                plan.mesh_pos,
                "the plan declares `mesh dp, tp` (data × tensor parallel) but --dp is 1; "
                "run it with --dp N (N ≥ 2), or write `mesh tp`",
                4,
            )
        ]
    return []
