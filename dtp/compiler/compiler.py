"""Checked plan → the `parallelize_module` plan: dtp's Megatron layers where the layout is
Megatron's, torch's own ParallelStyles elsewhere.

Two steps. `dtp.layout.lower` decides every module's input/output layouts with no process group (so
the checker and `explain` read the same decisions); `compile_plan` turns them into styles. What the
table names is what runs: each style's `_apply` shards the parameters and installs the module's
forward, nothing is undone.

| plan style                  | ParallelStyle                                                                |
|-----------------------------|------------------------------------------------------------------------------|
| colwise → rowwise (Megatron) | MegatronColwise / MegatronRowwise: local GEMMs, f and g (dtp/compiler/megatron.py) |
| colwise, other layouts      | ColwiseParallel (PlacedColwise with packed=K, each part sharded alone)       |
| rowwise, other layouts      | PlacedRowwise (torch's RowwiseParallel; also Conv1D)                         |
| vocab_parallel, Embedding   | VocabParallelEmbedding (dtp/compiler/vocab_parallel.py); RowwiseEmbedding under SP |
| vocab_parallel, Linear      | VocabParallelHead: `Shard(-1)` logits; `Compiled.loss` the vocabulary-parallel loss |
| sequence_parallel           | SequenceParallel (a plain input read as replicated); switches to Megatron-SP   |
| replicate                   | nothing (the module stays a plain replicated module)                         |
| replicate(reduce_grad=true) | ReplicateReduceGrad: whole parameters, gradients all-reduced                 |
| experts                     | ExpertsParallel: each expert's FFN dimension split, f and g around it        |
| slice_input(name=X, dim=D)  | SliceHeadsInput: inputs X holding every head at dim D cut to this rank's heads |
| slice_params(name=X, dim=D) | SliceHeadsParams: the module's own per-head parameters X, Shard(D)          |
| sharded_norm                | ShardedNorm: RMS norm on this rank's features, sum of squares all-reduced    |
| colwise siblings            | SharedInput on their parent: one input redistribution for q/k/v, gate/up     |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from dtp.checks.checker import Checked, checked_for
from dtp.compiler.head_slices import SliceHeadsInput, SliceHeadsParams
from dtp.compiler.local_params import LocalParams
from dtp.compiler.megatron import MegatronColwise, MegatronRowwise, megatron_layouts
from dtp.compiler.placed import (
    ExpertsParallel,
    PlacedColwise,
    PlacedRowwise,
    ReplicateReduceGrad,
    RowwiseEmbedding,
)
from dtp.compiler.sharded_norm import ShardedNorm
from dtp.compiler.styles import (
    Chained,
    SequenceParallelFromReplicated,
    SetAttributes,
    SharedInput,
)
from dtp.compiler.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelHead,
    cross_entropy,
    vocab_layouts,
)
from dtp.lang import ir
from dtp.layout.lower import SEQUENCE, Lowered, ModuleLayout, lower
from dtp.layout.placement import ParamPlacement, param_placements


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The tensor-parallel dimension of a 1-D or (dp, tp) mesh."""
    names = mesh.mesh_dim_names or ()
    return mesh["tp"] if "tp" in names and mesh.ndim > 1 else mesh


@dataclass(frozen=True)
class Compiled:
    """What `apply` needs: the styles, the per-rank attribute rewrites, and facts the run must know."""

    styles: dict[str, ParallelStyle]
    rewrites: dict[str, SetAttributes]
    lowered: Lowered
    # parameter → placement, to gather it back
    packed: dict[str, ParamPlacement] = field(default_factory=dict)

    @property
    def loss_parallel(self) -> bool:
        """Whether the head leaves the logits split by vocabulary (`loss` then reduces over ranks)."""
        return self.lowered.loss_parallel

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean token cross-entropy of the sharded model's logits (..., V): vocabulary-parallel
        on the local shard where the head left them split by vocabulary, plain otherwise; equal on
        every rank."""
        return cross_entropy(logits, targets)


def _style(m: ModuleLayout, module: nn.Module, leaves: LocalParams | None) -> ParallelStyle:
    layouts = (m.input, m.output)
    if m.style in ("colwise", "rowwise") and megatron_layouts(module, m.style, layouts, m.local):
        placements = dict(m.placements) or param_placements(m.style, module)
        return (MegatronColwise if m.style == "colwise" else MegatronRowwise)(placements, leaves)
    if m.style == "vocab_parallel" and vocab_layouts(module, m.embedding, layouts, m.local):
        return VocabParallelEmbedding(leaves) if m.embedding else VocabParallelHead(leaves)
    if m.style == "colwise":
        kw = dict(input_layouts=m.input, output_layouts=m.output, use_local_output=m.local)
        if m.placements:
            return PlacedColwise(dict(m.placements), **kw)
        return ColwiseParallel(**kw)
    if m.style == "rowwise":
        return PlacedRowwise(
            input_layouts=m.input, output_layouts=m.output, use_local_output=m.local
        )
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
        return RowwiseEmbedding(
            input_layouts=m.input, output_layouts=m.output, use_local_output=m.local
        )
    if m.style == "vocab_parallel":
        return ColwiseParallel(
            input_layouts=m.input, output_layouts=m.output, use_local_output=False
        )
    return SequenceParallelFromReplicated()


def placed_params(low: Lowered, model: nn.Module) -> dict[str, ParamPlacement]:
    """Parameter name → placement, for every parameter gathered back through `placed.unpack_placed`
    (Conv1D with packed parts, unequal or replicated parts, experts' packed gate_up_proj)."""
    out: dict[str, ParamPlacement] = {}
    for path, m in low.modules.items():
        for name, placement in m.placements:
            if placement.parts or placement.packed > 1:
                out[f"{path}.{name}"] = placement
        if m.style == "experts":
            module = model.get_submodule(path)
            for name, placement in param_placements("experts", module).items():
                if placement.packed > 1:  # [gate; up] halves
                    out[f"{path}.{name}"] = placement
    return out


def compile_plan(
    plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh, *, fsdp_follows: bool = False
) -> Compiled:
    """Compile `plan` for `model` on `mesh` (checking it first if it is not a Checked plan for this
    tp).

    `fsdp_follows`: FSDP2 will shard the model next and swap its own parameters in around each
    forward, so the Megatron layers read their parameters through DTensor's `to_local()` instead of
    dtp's leaves."""
    tp = tp_mesh(mesh).size()
    checked = checked_for(plan, model, tp)
    low = lower(checked.resolution, tp)
    leaves = None if fsdp_follows else LocalParams()  # one per model: a tied weight has one leaf
    styles = {path: _style(m, model.get_submodule(path), leaves) for path, m in low.modules.items()}
    for parent in low.shared_inputs:
        shared = SharedInput(SEQUENCE if low.sequence_parallel else Replicate())
        styles[parent] = Chained(shared, styles[parent]) if parent in styles else shared
    packed = placed_params(low, model)
    rewrites = {path: SetAttributes(v) for path, v in low.rewrites.items()}
    return Compiled(styles, rewrites, low, packed)
