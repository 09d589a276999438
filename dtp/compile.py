"""Checked plan → the `parallelize_module` plan: torch's own ParallelStyles wherever torch has one.

| plan style                 | ParallelStyle                                                          |
|----------------------------|------------------------------------------------------------------------|
| colwise                    | ColwiseParallel (PackedColwiseParallel with packed=K)                  |
| rowwise                    | RowwiseParallel                                                        |
| vocab_parallel, Embedding  | RowwiseParallel: rows sharded, output all-reduced (VocabParallelEmbedding) |
| vocab_parallel, Linear     | ColwiseParallel(output Shard(-1), DTensor output) + loss under loss_parallel |
| sequence_parallel          | SequenceParallel                                                        |
| replicate                  | nothing (the module stays a plain replicated module)                   |
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from dtp import ir
from dtp.check import Checked, check, evaluate
from dtp.styles import PackedColwiseParallel, SetAttributes


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The tensor-parallel dimension of a 1-D or (dp, tp) mesh."""
    names = mesh.mesh_dim_names or ()
    return mesh["tp"] if "tp" in names and mesh.ndim > 1 else mesh


def to_placement(layout: ir.Layout) -> Placement:
    """A plan LAYOUT as a DTensor placement."""
    if layout.kind == "shard":
        return Shard(layout.dim)
    return Partial() if layout.kind == "partial" else Replicate()


@dataclass(frozen=True)
class Compiled:
    """What `apply` needs: the styles, the per-rank attribute rewrites, and facts the run must know."""

    styles: dict[str, ParallelStyle]
    rewrites: dict[str, SetAttributes]  # module path ("" = the model) → attribute values at this tp
    packed: dict[str, int] = field(default_factory=dict)  # module path → parts, for gathering parameters back
    loss_parallel: bool = False  # the output projection keeps logits sharded on the vocabulary


def _layout(style: ir.Style, key: str, default: Placement) -> Placement:
    value = style.option(key)
    return to_placement(value) if isinstance(value, ir.Layout) else default


def _style(style: ir.Style, module: nn.Module) -> ParallelStyle | None:
    local = style.option("local", True)
    if style.name == "colwise":
        kw = dict(input_layouts=_layout(style, "input", Replicate()), output_layouts=_layout(style, "output", Shard(-1)),
                  use_local_output=local)
        parts = style.option("packed", 1)
        return PackedColwiseParallel(parts, **kw) if parts > 1 else ColwiseParallel(**kw)
    if style.name == "rowwise":
        return RowwiseParallel(input_layouts=_layout(style, "input", Shard(-1)),
                               output_layouts=_layout(style, "output", Replicate()), use_local_output=local)
    if style.name == "vocab_parallel":
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=_layout(style, "input", Replicate()),
                                   output_layouts=_layout(style, "output", Replicate()), use_local_output=local)
        # Logits stay a DTensor sharded on the vocabulary: the loss runs under loss_parallel.
        return ColwiseParallel(input_layouts=_layout(style, "input", Replicate()), output_layouts=Shard(-1),
                               use_local_output=False)
    if style.name == "sequence_parallel":
        return SequenceParallel()
    return None  # replicate


def compile_plan(plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh) -> Compiled:
    """Compile `plan` for `model` on `mesh` (checking it first if it is not a Checked plan yet)."""
    tp = tp_mesh(mesh).size()
    checked = plan if isinstance(plan, Checked) and plan.tp == tp else check(
        plan.plan if isinstance(plan, Checked) else plan, model, tp)
    res = checked.resolution
    styles: dict[str, ParallelStyle] = {}
    packed: dict[str, int] = {}
    loss_parallel = False
    for path, rule in res.claims.items():
        module = res.modules[path]
        style = _style(rule.style, module)
        if style is None:
            continue
        styles[path] = style
        if isinstance(style, PackedColwiseParallel):
            packed[path] = style.parts
        if rule.style.name == "vocab_parallel" and isinstance(module, nn.Linear):
            loss_parallel = True
    values: dict[str, dict[str, int]] = {}
    for (path, attr), stmt in res.sets.items():
        attrs = vars(res.modules[path])
        values.setdefault(path, {})[attr] = evaluate(stmt.expr, lambda v: tp if v.name == "tp" else attrs[v.name])
    rewrites = {path: SetAttributes(v) for path, v in values.items()}
    return Compiled(styles, rewrites, packed, loss_parallel)


def compile(plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan for `model` on `mesh` (module path → ParallelStyle)."""
    return compile_plan(plan, model, mesh).styles
