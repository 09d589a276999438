"""Checked plan → the `parallelize_module` plan: torch's own ParallelStyles wherever torch has one.

Two steps. `lower` decides every module's input/output layouts with no process group (so `explain`
can derive the communication schedule from the same decisions); `compile_plan` turns them into styles.

| plan style                 | ParallelStyle                                                              |
|----------------------------|----------------------------------------------------------------------------|
| colwise                    | ColwiseParallel (PackedColwiseParallel with packed=K)                      |
| rowwise                    | RowwiseParallel                                                            |
| vocab_parallel, Embedding  | RowwiseParallel: rows sharded, output all-reduced (VocabParallelEmbedding) |
| vocab_parallel, Linear     | ColwiseParallel(output Shard(-1), DTensor output) + loss under loss_parallel |
| sequence_parallel          | SequenceParallel (a plain input read as replicated); switches to Megatron-SP |
| replicate                  | nothing (the module stays a plain replicated module)                       |
| replicate(reduce_grad=true) | ReplicateReduceGrad: whole parameters, gradients all-reduced              |
| colwise/rowwise on Conv1D, packed=[…] | PlacedColwise / PlacedRowwise (dtp/layouts.py)                  |
| experts                    | ExpertsParallel: each expert's FFN dimension split, f and g around it      |
| slice_input(name=X, dim=D) | SliceHeadsInput: inputs X holding every head at dim D cut to this rank's heads |
| slice_params(name=X, dim=D) | SliceHeadsParams: the module's own per-head parameters X, Shard(D)        |
| sharded_norm               | ShardedNorm: RMS norm on this rank's features, sum of squares all-reduced  |
| colwise siblings           | SharedInput on their parent: one input redistribution for q/k/v, gate/up   |
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from dtp import conditions, ir, models
from dtp.check import Checked, checked_for, evaluate, set_target
from dtp.check_slices import slice_names
from dtp.experts import experts_layout
from dtp.head_slices import SliceHeadsInput, SliceHeadsParams
from dtp.layouts import ExpertsParallel, PlacedColwise, PlacedRowwise, ReplicateReduceGrad
from dtp.placement import Placement as Placement_
from dtp.placement import is_conv1d
from dtp.sharded_norm import ShardedNorm
from dtp.styles import (Chained, PackedColwiseParallel, SequenceParallelFromReplicated, SetAttributes,
                        SharedInput)

SEQUENCE = Shard(1)
HEAD_SLICES = ("slice_input", "slice_params")  # styles that cut per-head tensors and leave activations alone


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
class ModuleLayout:
    """What one claimed module does with its activations."""

    style: str  # plan style
    embedding: bool  # vocab_parallel on nn.Embedding (else on the output Linear)
    input: Placement | None  # how its input arrives (None: not a tensor-parallel boundary)
    output: Placement | None  # what it hands on
    local: bool  # hand on a local tensor (True) or a DTensor
    packed: int = 1
    # Parameter placements for the layouts torch's styles lack (Conv1D, unequal or replicated parts):
    placements: tuple[tuple[str, Placement_], ...] = ()
    reduce_grad: bool = False  # replicate(reduce_grad=true)
    slice_names: tuple[str, ...] = ()  # slice_input / slice_params(name=…): the inputs or parameters cut
    heads: int = 0  # the config's attention heads (slice_input)
    slice_dim: int = 0  # slice_input / slice_params(dim=…): the dimension holding the heads


@dataclass(frozen=True)
class Lowered:
    """Every layout decision, made without a process group."""

    modules: dict[str, ModuleLayout]
    shared_inputs: dict[str, tuple[str, ...]]  # parent → colwise children that share its input
    # (the parent receives the block's input layout and hands its children a Replicate DTensor)
    rewrites: dict[str, dict[str, int]]  # module path ("" = the model) → attribute values at this tp
    sequence_parallel: bool  # activations between blocks are sharded on the sequence
    loss_parallel: bool  # the output projection keeps logits sharded on the vocabulary


def _layout(style: ir.Style, key: str, default: Placement) -> Placement:
    value = style.option(key)
    return to_placement(value) if isinstance(value, ir.Layout) else default


def _module_layout(style: ir.Style, module: nn.Module, sp: bool) -> ModuleLayout | None:
    # With sequence parallelism the residual stream between blocks is a DTensor sharded on the
    # sequence: colwise layers all-gather their input, rowwise layers reduce-scatter their output
    # and hand the residual a DTensor (Megatron-SP's g and ḡ).
    between = SEQUENCE if sp else Replicate()
    local = style.option("local", not sp)
    name = style.name
    if name == "colwise":
        return ModuleLayout(name, False, _layout(style, "input", between), _layout(style, "output", Shard(-1)),
                            style.option("local", True), style.option("packed", 1))
    if name == "rowwise":
        return ModuleLayout(name, False, _layout(style, "input", Shard(-1)), _layout(style, "output", between), local)
    if name == "vocab_parallel" and isinstance(module, nn.Embedding):
        return ModuleLayout(name, True, _layout(style, "input", Replicate()), _layout(style, "output", between), local)
    if name == "vocab_parallel":
        return ModuleLayout(name, False, _layout(style, "input", between), Shard(-1), False)
    if name == "sequence_parallel":
        return ModuleLayout(name, False, SEQUENCE, SEQUENCE, False)
    if name == "experts":
        return ModuleLayout(name, False, Replicate(), Replicate(), True)
    if name in HEAD_SLICES:
        return ModuleLayout(name, False, None, None, True)
    if name == "sharded_norm":  # between a colwise layer and its consumer: local feature slices in and out
        return ModuleLayout(name, False, Shard(-1), Shard(-1), True)
    if style.option("reduce_grad", False) is True:
        return ModuleLayout(name, False, None, None, True, reduce_grad=True)
    return None  # replicate


def lower(checked: Checked, tp: int) -> Lowered:
    """Layouts for every module the plan claims, the shared-input groups and the `set` values at `tp`."""
    res = checked.resolution
    sp = any(rule.style.name == "sequence_parallel" for rule in res.claims.values())
    modules: dict[str, ModuleLayout] = {}
    for path, rule in res.claims.items():
        layout = _module_layout(rule.style, res.modules[path], sp)
        if layout is not None and layout.style in HEAD_SLICES:
            info = models.heads(res.modules[""])
            layout = replace(layout, slice_names=slice_names(rule.style), heads=info.n_head if info else 0,
                             slice_dim=int(rule.style.option("dim", 0)))
        if layout is not None and layout.style == "sharded_norm":
            layout = replace(layout, placements=tuple(res.placements(path).items()))
        if layout is not None and layout.style == "colwise":
            placed = res.placements(path)
            packed = layout.packed if isinstance(layout.packed, int) else 1
            special = is_conv1d(res.modules[path]) or any(p.parts for p in placed.values())
            layout = replace(layout, packed=packed, placements=tuple(placed.items()) if special else ())
        if layout is not None:
            modules[path] = layout
    # A shared input changes what every child of the parent receives, so only a parent whose colwise
    # children all take the default input layout (written or not) gets one.
    between = SEQUENCE if sp else Replicate()
    groups: dict[str, list[str]] = {}
    for path, layout in modules.items():
        if layout.style == "colwise" and "." in path:
            groups.setdefault(path.rpartition(".")[0], []).append(path)
    # (A parent whose own style leaves its activations alone, slice_input or slice_params, may have one too.)
    shared = {parent: tuple(c) for parent, c in groups.items()
              if len(c) > 1 and (parent not in modules or modules[parent].style in HEAD_SLICES)
              and all(modules[p].input == between for p in c)}
    for children in shared.values():  # they receive the parent's input already replicated
        for path in children:
            modules[path] = replace(modules[path], input=Replicate())
    rewrites: dict[str, dict[str, int]] = {}
    for (path, attr), stmt in res.sets.items():
        attrs = vars(set_target(res.modules[path], attr)[0])
        rewrites.setdefault(path, {})[attr] = evaluate(stmt.expr, lambda v: tp if v.name == "tp" else conditions.config_int(
            res.modules[""], v) if v.name.startswith("config.") else attrs[v.name])
    loss = any(m.style == "vocab_parallel" and not m.embedding for m in modules.values())
    return Lowered(modules, shared, rewrites, sp, loss)


@dataclass(frozen=True)
class Compiled:
    """What `apply` needs: the styles, the per-rank attribute rewrites, and facts the run must know."""

    styles: dict[str, ParallelStyle]
    rewrites: dict[str, SetAttributes]
    lowered: Lowered
    packed: dict[str, int] = field(default_factory=dict)  # module path → parts, for gathering parameters back

    @property
    def loss_parallel(self) -> bool:
        """Whether the loss must run under loss_parallel."""
        return self.lowered.loss_parallel


def _style(m: ModuleLayout) -> ParallelStyle:
    if m.style == "colwise":
        kw = dict(input_layouts=m.input, output_layouts=m.output, use_local_output=m.local)
        if m.placements:
            return PlacedColwise(dict(m.placements), **kw)
        return PackedColwiseParallel(m.packed, **kw) if m.packed > 1 else ColwiseParallel(**kw)
    if m.style == "rowwise":
        return PlacedRowwise(input_layouts=m.input, output_layouts=m.output, use_local_output=m.local)
    if m.style == "experts":
        return ExpertsParallel()
    if m.reduce_grad:
        return ReplicateReduceGrad()
    if m.style == "slice_input":
        return SliceHeadsInput(m.slice_names, m.heads, m.slice_dim)
    if m.style == "slice_params":
        return SliceHeadsParams(m.slice_names, m.slice_dim)
    if m.style == "sharded_norm":
        return ShardedNorm(dict(m.placements)["weight"])
    if m.style == "vocab_parallel" and m.embedding:
        return RowwiseParallel(input_layouts=m.input, output_layouts=m.output, use_local_output=m.local)
    if m.style == "vocab_parallel":
        return ColwiseParallel(input_layouts=m.input, output_layouts=m.output, use_local_output=False)
    return SequenceParallelFromReplicated()


def placed_params(low: Lowered, model: nn.Module) -> dict[str, Placement_]:
    """Parameter name → placement, for every parameter gathered back through `layouts.unpack_parts`
    (Conv1D with packed parts, unequal or replicated parts, experts' packed gate_up_proj)."""
    out: dict[str, Placement_] = {}
    for path, m in low.modules.items():
        for name, placement in m.placements:
            if placement.parts or placement.packed > 1:
                out[f"{path}.{name}"] = placement
        if m.style == "experts":
            module = model.get_submodule(path)
            for name, placement in experts_layout(module).placements().items():
                if placement.packed > 1 and hasattr(module, name):  # [gate; up] halves
                    out[f"{path}.{name}"] = placement
    return out


def compile_plan(plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh) -> Compiled:
    """Compile `plan` for `model` on `mesh` (checking it first if it is not a Checked plan for this tp)."""
    tp = tp_mesh(mesh).size()
    checked = checked_for(plan, model, tp)
    low = lower(checked, tp)
    styles = {path: _style(m) for path, m in low.modules.items()}
    for parent in low.shared_inputs:
        shared = SharedInput(SEQUENCE if low.sequence_parallel else Replicate())
        styles[parent] = Chained(shared, styles[parent]) if parent in styles else shared
    packed = {path: m.packed for path, m in low.modules.items() if m.packed > 1 and not m.placements}
    packed.update(placed_params(low, model))
    rewrites = {path: SetAttributes(v) for path, v in low.rewrites.items()}
    return Compiled(styles, rewrites, low, packed)


def compile(plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan for `model` on `mesh` (module path → ParallelStyle)."""
    return compile_plan(plan, model, mesh).styles
