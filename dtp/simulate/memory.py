"""Memory per GPU: parameters, gradients and optimizer state from the plan's placements, activations
from Korthikanti et al. 2022 (Table 2), generalised to any element size, dropout on or off and attention
that does or does not keep its s × s scores (a fused/flash kernel keeps only q, k, v, the output and a
row statistic).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from dtp.layout.resolve import Resolution

GiB = 1024 ** 3
OPTIMIZER_BYTES = {"adam": 8, "sgd": 4}  # fp32 state per parameter: Adam's m and v; SGD's momentum


def params_per_rank(model: nn.Module, resolution: Resolution, tp: int) -> float:
    """Parameters one tensor-parallel rank holds (tied weights once; sharded ones divided by tp)."""
    seen: set[int] = set()
    total = 0.0
    for path, module in model.named_modules():
        placements = resolution.placements(path)
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel() / (tp if placements[name].shard_dim is not None else 1)
    return total


@dataclass(frozen=True)
class Shape:
    """What the activation formulas need to know about a transformer."""

    layers: int
    hidden: int
    heads: int
    vocab: int


def activation_bytes(shape: Shape, batch: int, seq: int, tp: int, *, elem: int, recompute: str,
                     sequence_parallel: bool = False, dropout: bool = True, flash: bool = False) -> float:
    """Bytes of activations one rank keeps for backward (Korthikanti et al. 2022, Table 2 and §4.3).

    With elem=2, dropout and stored scores this is K22's sbh(10 + 24/t + 5as/(ht)) per layer (TP),
    sbh(34/t + 5as/(ht)) with sequence parallelism, the score terms dropped with selective recompute,
    and 2sbh per layer with full recompute plus one layer's working set while it is recomputed."""
    sbh = seq * batch * shape.hidden
    mask = 1 if dropout else 0
    rep_div = tp if sequence_parallel else 1
    # replicated: 2 LayerNorm inputs, the attention and MLP inputs (4 elements), 2 dropout masks
    replicated = (4 * elem + 2 * mask) * sbh / rep_div
    # split over tp: q, k, v, the projection input (4), GeLU input and output (8)
    split = 12 * elem * sbh / tp
    scores_elems = shape.heads * seq * seq * batch
    if flash:
        scores = 4 * shape.heads * seq * batch / tp  # the log-sum-exp row statistic, fp32
    else:  # softmax output, its dropout mask and dropout output
        scores = ((2 * elem + mask) if dropout else elem) * scores_elems / tp
    layer = replicated + split + scores
    if recompute == "selective":
        layer -= scores
    outside = (2 * elem * sbh + mask * sbh) / rep_div + 4 * seq * batch * shape.vocab / tp  # final LN, head input, fp32 logits
    if recompute == "full":
        return shape.layers * elem * sbh / rep_div + layer + outside
    return shape.layers * layer + outside


@dataclass(frozen=True)
class Memory:
    """One rank's memory for one iteration (bytes)."""

    params: float
    weights: float
    grads: float
    optimizer: float
    activations: float
    capacity: float

    @property
    def total(self) -> float:
        """Everything the model keeps (no allocator fragmentation or workspace)."""
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        """Whether it fits in the accelerator's memory."""
        return self.total <= self.capacity


def memory(params: float, elem: int, optimizer: str, activations: float, capacity_GiB: float) -> Memory:
    """Weights and gradients in the training precision, fp32 optimizer state (and a master copy when the
    precision is below fp32: mixed precision, 16 bytes per parameter with Adam)."""
    state = OPTIMIZER_BYTES[optimizer] + (4 if elem < 4 else 0)  # below fp32: an fp32 master copy too
    return Memory(params, params * elem, params * elem, params * state, activations, capacity_GiB * GiB)
