"""Megatron's column- and row-parallel linear layers as ParallelStyles (`MegatronColwise`,
`MegatronRowwise`).

Between a column- and a row-parallel layer the layout is known when the plan is compiled: the
column-parallel input is replicated, its output is this rank's features, the row-parallel product is
a partial sum. torch's ColwiseParallel/RowwiseParallel run each Linear as a DTensor op (sharding
propagation and wrapping on every call, forward and backward); these styles shard the parameters as
they do — DTensors, so checkpoints, gradients, clipping and the optimizer see the same thing — and
make the module a layer that computes on the local shards (dtp.compiler.layer), with Megatron's f
and g (dtp.compiler.mappings) as its only communication:

- `ColumnParallelLinear`: f on the input; the output is this rank's features (Shard(-1), handed on
  local);
- `RowParallelLinear`: this rank's input features; g on the product; the bias added after the sum,
  on every rank (Megatron's RowParallelLinear): its gradient is the same everywhere without an
  all-reduce.

Both take nn.Linear and transformers' Conv1D (weight (in, out)), with packed parts
(dtp/compiler/placed.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from dtp.compiler.layer import TensorParallelGroup, become
from dtp.compiler.local_params import LocalParams
from dtp.compiler.mappings import copy_to_ranks, features_of_rank, sum_over_ranks
from dtp.compiler.placed import distribute_param
from dtp.layout.modules import is_conv1d
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles import Style


def linear(module: nn.Module, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """`module`'s product on local tensors: F.linear, or Conv1D's (its forward reads the global
    width `nf`)."""
    weight, bias = params["weight"], params.get("bias")
    if not is_conv1d(module):
        return F.linear(x, weight, bias)
    # matmul folds the leading dimensions itself; its output is not a view (a row-parallel layer's g
    # reduces it in place, which on a view autograd would pay with a copy of the base in backward)
    y = x @ weight
    return y if bias is None else y + bias


class ColumnParallel:
    """The forward of a column-parallel layer (replicated input → this rank's output features)."""

    _tp: TensorParallelGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - the class says it
        return linear(self, copy_to_ranks(x, self._tp.group), self._tp.params(self))


class RowParallel:
    """The forward of a row-parallel layer (this rank's input features → the sum over ranks,
    replicated)."""

    _tp: TensorParallelGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - the class says it
        params = self._tp.params(self)
        bias = params.pop("bias", None)
        y = sum_over_ranks(linear(self, features_of_rank(x), params), self._tp.group)
        # a new tensor either way: it may be updated in place
        return y if bias is None else y + bias


def megatron_layouts(
    module: nn.Module, style: str, layouts: tuple[Placement | None, Placement | None], local: bool
) -> bool:
    """Whether `style` on `module` has Megatron's layouts, which these layers compute: a plain
    nn.Linear or a Conv1D (a subclass has a forward of its own), replicated input → local Shard(-1)
    output (colwise), local Shard(-1) input → replicated output (rowwise). Else torch's style runs
    it (sequence parallelism, DTensor or partial outputs)."""
    if type(module) is not nn.Linear and not is_conv1d(module) or not local:
        return False
    if style == Style.COLWISE:
        return layouts == (Replicate(), Shard(-1))
    return style == Style.ROWWISE and layouts == (Shard(-1), Replicate())


class LayerStyle(ParallelStyle):
    """A ParallelStyle that shards a module's parameters and makes the module its `layer`
    (dtp.compiler.layer), reading them through `leaves` (None: DTensor's `to_local()`)."""

    layer: type

    def __init__(self, leaves: LocalParams | None):
        super().__init__()
        self.leaves = leaves

    def placements(self, module: nn.Module) -> dict[str, ParamPlacement]:
        """Each of `module`'s own parameters' placement."""
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements(module).items():
            distribute_param(module, name, placement, device_mesh)
        return become(module, self.layer, TensorParallelGroup.of(device_mesh, self.leaves))


class _Megatron(LayerStyle):
    def __init__(self, placements: dict[str, ParamPlacement], leaves: LocalParams | None):
        super().__init__(leaves)
        self.given = dict(placements)

    def placements(self, module: nn.Module) -> dict[str, ParamPlacement]:
        """The placements the compiler gave (packed parts, Conv1D's transposed weight)."""
        return self.given

    def __repr__(self) -> str:
        return f"{type(self).__name__}({ {k: str(v) for k, v in self.given.items()} })"


class MegatronColwise(_Megatron):
    """Shard a Linear or Conv1D by output features (`placements`) and make it a `ColumnParallel`
    layer."""

    layer = ColumnParallel


class MegatronRowwise(_Megatron):
    """Shard a Linear or Conv1D by input features (`placements`) and make it a `RowParallel` layer."""

    layer = RowParallel
