"""Memory per GPU: parameters, gradients and optimizer state from the plan's placements (sharded
again over dp with FSDP), activations from Korthikanti et al. 2022 (Table 2), generalised to any
element size, dropout on or off, grouped-query attention, a gated (SwiGLU) MLP, attention that does
or does not keep its s × s scores (a fused/flash kernel keeps only its output and a row statistic),
and four recompute policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from dtp.layout.resolve import Resolution

GiB = 1024**3
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
    kv_heads: int = 0  # 0: as many as heads (no grouped-query attention)
    ffn: int = 0  # the MLP's inner width; 0: 4 × hidden (a GPT's)
    gated: bool = False  # SwiGLU: gate and up matrices, four ffn-wide tensors saved instead of two
    fused_qkv: bool = False  # one q/k/v matrix (GPT-2's c_attn): one GEMM instead of three
    dropout: bool = True  # the model runs dropout (its masks are kept for backward)

    def mm_outputs(self, tp: int) -> list[float]:
        """Elements per token of each matrix multiply's output in one layer, in forward order (per
        rank: a rowwise layer's output is a full-width partial sum on every rank)."""
        h = self.hidden
        kv = h * (self.kv_heads or self.heads) // self.heads
        f = self.ffn or 4 * h
        attn = [(h + 2 * kv) / tp] if self.fused_qkv else [h / tp, kv / tp, kv / tp]
        mlp = [f / tp, f / tp] if self.gated else [f / tp]
        return [*attn, float(h), *mlp, float(h)]


def activation_bytes(
    shape: Shape,
    batch: int,
    seq: int,
    tp: int,
    *,
    elem: int,
    recompute: str,
    sequence_parallel: bool = False,
    dropout: bool = True,
    flash: bool = False,
    residual_elem: int | None = None,
    gathered_inputs: bool = False,
    working_set: bool = True,
) -> float:
    """Bytes of activations one rank keeps for backward (Korthikanti et al. 2022, Table 2 and §4.3).

    With elem=2, dropout, stored scores and a GPT's MLP this is K22's sbh(10 + 24/t + 5as/(ht)) per
    layer (TP), sbh(34/t + 5as/(ht)) with sequence parallelism, the score terms dropped with
    selective recompute, and 2sbh per layer with full recompute plus one layer's working set while
    it is recomputed. `op` is per-op selective checkpointing (torchtitan's): each layer keeps its
    input, every other matrix multiply's output and the attention output (with its row statistic);
    the rest is recomputed.

    `residual_elem` (default `elem`): the element size of the residual stream, which every norm
    reads and every block takes in: 4 under autocast over fp32 weights (the residual adds promote to
    fp32, and the norms run in fp32), where only the matrix multiplies' inputs and outputs are in
    the training precision.

    `gathered_inputs`: with sequence parallelism, each column-parallel layer (attention, MLP, the
    head) saves its all-gathered input, whole, as torch's DTensor layers do; Megatron (K22's
    formula, the default) saves the sequence shard and all-gathers it again in backward.

    `working_set` False: what the forward leaves allocated, without the recomputed layer's working
    set (full and per-op recompute bring one layer's tensors back while its backward runs; the
    forward has freed them): what a meter reads between forward and backward."""
    res = residual_elem or elem
    sb = seq * batch
    h = shape.hidden
    mask = 1 if dropout else 0
    rep_div = tp if sequence_parallel else 1
    input_div = 1 if gathered_inputs else rep_div  # a column-parallel layer's saved input
    kv = h * (shape.kv_heads or shape.heads) // shape.heads
    f = shape.ffn or 4 * h
    # replicated: 2 norm inputs (the residual stream), the attention and MLP inputs, 2 dropout masks
    replicated = (2 * res + 2 * mask) * sb * h / rep_div + 2 * elem * sb * h / input_div
    # split over tp: q, k, v, the attention output (= projection input), the MLP's saved inner
    # tensors (a GPT: GeLU input and output; SwiGLU: gate, up, silu(gate) and the product)
    split = elem * sb * (2 * h + 2 * kv + (4 if shape.gated else 2) * f) / tp
    lse = 4 * shape.heads * sb / tp  # flash attention's log-sum-exp row statistic, fp32
    if flash:
        scores = lse
    else:  # softmax output, its dropout mask and dropout output
        scores = ((2 * elem + mask) if dropout else elem) * shape.heads * seq * sb / tp
    layer = replicated + split + scores
    if recompute == "selective":
        layer -= scores
    # final LN, head input, fp32 logits
    outside = (
        (res + mask) * sb * h / rep_div + elem * sb * h / input_div + 4 * sb * shape.vocab / tp
    )
    # kept after the forward, and what is back while one layer's backward recomputes it
    if recompute == "full":  # each block's input
        saved, working = shape.layers * res * sb * h / rep_div + outside, layer
    elif recompute == "op":
        products = shape.mm_outputs(tp)[0::2]  # the 1st, 3rd, … matrix multiply of the layer
        kept = res * sb * h / rep_div + elem * sb * (sum(products) + h / tp) + lse
        saved, working = shape.layers * kept + outside, layer - kept
    else:
        saved, working = shape.layers * layer + outside, 0.0
    return saved + (working if working_set else 0.0)


def loss_bytes(shape: Shape, batch: int, seq: int, tp: int, elem: int) -> float:
    """The cross-entropy's transient peak beyond the fp32 logits counted in the activations: the
    logits in the training precision and the fp32 log-softmax next to them (the vocabulary split
    over tp)."""
    return (elem + 4) * seq * batch * shape.vocab / tp


@dataclass(frozen=True)
class Memory:
    """One rank's memory for one iteration (bytes)."""

    params: float
    weights: float
    grads: float
    optimizer: float
    activations: float
    capacity: float
    buffers: float = 0.0  # transient: FSDP's unsharded units, the loss's working set

    @property
    def total(self) -> float:
        """Everything the model keeps (no allocator fragmentation or workspace)."""
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        """Whether it fits in the accelerator's memory."""
        return self.total <= self.capacity


def memory(
    params: float,
    elem: int,
    optimizer: str,
    activations: float,
    capacity_GiB: float,
    *,
    fsdp_dp: int = 1,
    unit_params: float = 0.0,
    transient: float = 0.0,
) -> Memory:
    """Weights and gradients in the training precision, fp32 optimizer state (and a master copy when
    the precision is below fp32: mixed precision, 16 bytes per parameter with Adam). With FSDP over
    `fsdp_dp` ranks (FSDP2's mixed precision): fp32 sharded weights, fp32 sharded gradients and the
    optimizer state, all divided by dp, plus the all-gathered low-precision copies of two units at
    once (the one computing and the one prefetched) and one unit's unsharded gradient before its
    reduce-scatter."""
    state = OPTIMIZER_BYTES[optimizer]
    if fsdp_dp > 1:
        shard = params / fsdp_dp
        buffers = unit_params * (2 * elem + 4) + transient
        return Memory(
            params, shard * 4, shard * 4, shard * state, activations, capacity_GiB * GiB, buffers
        )
    state += 4 if elem < 4 else 0  # below fp32: an fp32 master copy too
    return Memory(
        params,
        params * elem,
        params * elem,
        params * state,
        activations,
        capacity_GiB * GiB,
        transient,
    )
