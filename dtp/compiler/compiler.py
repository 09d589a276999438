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
from typing import Callable

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
from dtp.layout.lower import Lowered, lower
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles import Style
from dtp.layout.styles.linear import COLWISE, ROWWISE
from dtp.layout.styles.moe import EXPERTS
from dtp.layout.styles.spec import SEQUENCE, ModuleLayout


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


# A style's ParallelStyle, from its ModuleLayout: the one part of a style that needs a process group,
# so it lives here and not in its StyleSpec (dtp/layout/styles, read by the checker below this
# stage). `Factory(m, module, leaves)`; tests/compiler hold the table to every Style.
Factory = Callable[[ModuleLayout, nn.Module, LocalParams | None], ParallelStyle]


def _colwise(m: ModuleLayout, module: nn.Module, leaves: LocalParams | None) -> ParallelStyle:
    if megatron_layouts(module, m.style, (m.input, m.output), m.local):
        return MegatronColwise(dict(m.placements) or COLWISE.placements(module), leaves)
    kw = dict(input_layouts=m.input, output_layouts=m.output, use_local_output=m.local)
    return PlacedColwise(dict(m.placements), **kw) if m.placements else ColwiseParallel(**kw)


def _rowwise(m: ModuleLayout, module: nn.Module, leaves: LocalParams | None) -> ParallelStyle:
    if megatron_layouts(module, m.style, (m.input, m.output), m.local):
        return MegatronRowwise(dict(m.placements) or ROWWISE.placements(module), leaves)
    return PlacedRowwise(input_layouts=m.input, output_layouts=m.output, use_local_output=m.local)


def _vocab_parallel(
    m: ModuleLayout, module: nn.Module, leaves: LocalParams | None
) -> ParallelStyle:
    if vocab_layouts(module, m.embedding, (m.input, m.output), m.local):
        return VocabParallelEmbedding(leaves) if m.embedding else VocabParallelHead(leaves)
    kw = dict(input_layouts=m.input, output_layouts=m.output)
    if m.embedding:  # under sequence parallelism: torch's layout, reduce-scattered
        return RowwiseEmbedding(**kw, use_local_output=m.local)
    return ColwiseParallel(**kw, use_local_output=False)


PARALLEL_STYLES: dict[Style, Factory] = {
    Style.COLWISE: _colwise,
    Style.ROWWISE: _rowwise,
    Style.VOCAB_PARALLEL: _vocab_parallel,
    Style.SEQUENCE_PARALLEL: lambda m, module, leaves: SequenceParallelFromReplicated(),
    Style.REPLICATE: lambda m, module, leaves: ReplicateReduceGrad(),  # reduce_grad=true
    Style.EXPERTS: lambda m, module, leaves: ExpertsParallel(),
    Style.SLICE_INPUT: lambda m, module, leaves: SliceHeadsInput(
        m.slice_names, m.heads, m.slice_dim
    ),
    Style.SHARDED_NORM: lambda m, module, leaves: ShardedNorm(dict(m.placements)["weight"]),
    Style.SLICE_PARAMS: lambda m, module, leaves: SliceHeadsParams(m.slice_names, m.slice_dim),
}


def placed_params(low: Lowered, model: nn.Module) -> dict[str, ParamPlacement]:
    """Parameter name → placement, for every parameter gathered back through `placed.unpack_placed`
    (Conv1D with packed parts, unequal or replicated parts, experts' packed gate_up_proj)."""
    out: dict[str, ParamPlacement] = {}
    for path, m in low.modules.items():
        for name, placement in m.placements:
            if placement.parts or placement.packed > 1:
                out[f"{path}.{name}"] = placement
        if m.style == Style.EXPERTS:
            module = model.get_submodule(path)
            for name, placement in EXPERTS.placements(module).items():
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
    styles = {
        path: PARALLEL_STYLES[m.style](m, model.get_submodule(path), leaves)
        for path, m in low.modules.items()
    }
    for parent in low.shared_inputs:
        shared = SharedInput(SEQUENCE if low.sequence_parallel else Replicate())
        styles[parent] = Chained(shared, styles[parent]) if parent in styles else shared
    packed = placed_params(low, model)
    rewrites = {path: SetAttributes(v) for path, v in low.rewrites.items()}
    return Compiled(styles, rewrites, low, packed)
