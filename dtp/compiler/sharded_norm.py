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
repeated weight rows' gradient is summed over the ranks that share them (dtp/compiler/placed.py).

What the module computes is not assumed: `check` runs its own forward on a probe input and compares it with
the formula above, so a norm with another formula (Gemma's 1 + weight, a LayerNorm's mean) is refused.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from dtp.compiler.placed import all_reduce_grad, distribute_param
from dtp.layout.norms import epsilon, rms_norm
from dtp.layout.placement import ParamPlacement


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

    def __init__(self, placement: ParamPlacement):
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
