"""Compute time of one micro-batch, op by op, split into the parts that communication can hide
behind: the forward and the backward (recompute included) of the repeated blocks, and of everything
else.

A GEMM costs its FLOPs at the profile's rate × its size's efficiency; a memory-bound op its elements
read and written over `hbm_GBps`; each op pays `op_overhead_us` (hidden behind the work when ops run
asynchronously). Backward costs twice the forward (two GEMMs per GEMM; the gradient of an
elementwise op reads and writes about twice its traffic); a flash kernel's backward 2.5× (it
recomputes the scores: five matrix products against two). What each recompute policy runs again:

| policy | forward ops of a block run again in backward |
|---|---|
| none | nothing |
| full | all of them (Megatron's per-layer checkpoint) |
| selective | the attention core: QKᵀ, softmax, dropout, × V (Megatron's) |
| op | every other GEMM and all memory-bound ops; the attention kernel's output is kept (torchtitan's per-op policy) |

Attention: the meta device records the math decomposition of attention, so its s × s score ops are
memory ops at least heads × seq² elements large. `unfused` prices them as recorded (separate scale,
mask, softmax and dropout kernels: the 2019 Megatron code); `fused` as Megatron-LM's
FusedScaleMaskSoftmax (2020–2022) plus dropout: the scores read and written once by the softmax, and
read, written and masked (1 byte) once more by dropout; `flash` drops them (the scores never reach
memory). `compile` halves the traffic of the other memory-bound ops (Inductor fuses
producer–consumer chains: an intermediate is written and read back once instead of twice; assumed,
not fitted) and leaves GEMMs alone.

The training loss (log-softmax and NLL over the logits, recorded after the forward) is priced only
by a profile with a measured figure for its kernels (`--calibrate`'s op_GBps): on a CPU rank it is
~5 % of a small GPT's step; the GPU profiles have no published figure for it, and there (< 1 % of
the rows' iterations) the fitted GEMM fraction absorbs it, as it absorbs every other unmodelled
kernel. A calibrated CPU profile also prices each GEMM's backward at the measured rate of a Linear's
whole backward (its transposed GEMMs, bias gradient and copies), attention at SDPA's measured rate
and backward ratio, each memory-bound op at its own measured bandwidth and backward ratio, and an
op's backward dispatch at its measured cost; on a CPU more ranks than cores (`compute_slots`) slow
dispatch as well as work.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPILED_TRAFFIC = 0.5  # assumed: a fused chain keeps each intermediate on chip
ELEM = {"fp16": 2, "bf16": 2, "fp32": 4}  # bytes per element of each training precision


@dataclass(frozen=True)
class Compute:
    """Seconds of one micro-batch's compute on one rank."""

    block_forward: float  # all repeated blocks, forward
    block_backward: float  # their backward, recompute included
    other_forward: float  # embedding, final norm, head
    other_backward: float
    # the blocks' forward GEMMs: what a weight-gradient GEMM costs again
    block_gemm_forward: float = 0.0

    @property
    def total(self) -> float:
        """All of it."""
        return self.block_forward + self.block_backward + self.other_forward + self.other_backward


def compute_parts(
    flops, run, prof, share: float = 1.0, *, shape=None, sequence_parallel: bool = False
) -> Compute:
    """One micro-batch's compute by part (see the module docstring); `shape` finds the score ops.
    `share`: the fraction of a processor each rank gets (more ranks than cores); it slows a CPU
    rank's dispatch too."""
    rate = prof.flops_per_s(run.precision) * share
    overhead = prof.op_overhead_us * 1e-6 / (1.0 if prof.async_ops else share)
    back_overhead = (
        prof.backward_overhead_us * 1e-6 / (1.0 if prof.async_ops else share)
        if prof.backward_overhead_us >= 0
        else 2 * overhead
    )
    b, elem = run.micro_batch, ELEM[run.precision]
    attention = getattr(run, "attention", "unfused")
    compiled = getattr(run, "compile", False)
    scores_at = shape.heads * flops.seq**2 if shape else float("inf")
    scale = _fused_scale(flops, shape, elem, scores_at) if attention == "fused" else 1.0
    parts = [0.0, 0.0, 0.0, 0.0]
    gemm = 0.0
    measured = dict(prof.op_GBps)
    for op in flops.ops:
        score = op.kind == "memory" and op.score and op.in_block
        if score and attention == "flash":
            continue  # never materialised
        if op.loss and op.name not in measured:
            # see the module docstring: the loss is priced where the profile measured its kernels
            continue
        name = op.name
        if op.loss and op.split and run.tp > 1 and f"loss.parallel{run.tp}" in measured:
            if op.name != "_log_softmax":
                # the whole vocabulary-parallel loss is measured as one, priced on its log-softmax
                continue
            name = f"loss.parallel{run.tp}"
        n = run.tp if op.split or (sequence_parallel and op.kind == "memory") else 1
        if op.kind == "memory":
            factor = scale if score else (COMPILED_TRAFFIC if compiled else 1.0)
            # read once per micro-batch
            params = op.params / (run.tp if op.params_split else 1) * elem
            work = (op.elements * b / n * elem * factor + params) / (prof.bandwidth(name) * share)
            back = prof.backward_ratio(name) * work
            # a dense weight gradient (an embedding's), measured
            if op.params and prof.has(name + ".grad"):
                back = (
                    prof.backward_ratio(name)
                    * op.elements
                    * b
                    / n
                    * elem
                    * factor
                    / prof.bandwidth(name)
                    + params / prof.bandwidth(name + ".grad")
                ) / share
        elif op.kind == "attention":
            size = op.flops * b / n
            # a fused kernel: its own rate, no GEMM-size table
            work = size / (rate * prof.attention_efficiency)
            back = (prof.attention_backward or (2.5 if attention == "flash" else 2.0)) * work
        # dx = dy·W and dW = dyᵀ·x: two GEMMs of the forward's size, at their own layouts' rate (as
        else:
            # measured on a CPU: with the bias gradient and the copies a Linear's backward makes)
            size = op.flops * b / n
            work = size / (rate * prof.gemm_fraction(size))
            back = 2 * size / (rate * prof.gemm_backward_fraction(size))
        # a GPU queues kernels: the launch hides behind the work of the ones before
        if prof.async_ops:
            one, backward = op.count * max(overhead, work), op.count * max(2 * overhead, back)
        else:
            one, backward = op.count * (work + overhead), op.count * (back + back_overhead)
        again = _recomputed(op, run.recompute, score) * one if op.in_block else 0.0
        k = 0 if op.in_block else 2
        parts[k] += one
        parts[k + 1] += backward + again
        gemm += one if op.in_block and op.kind == "gemm" else 0.0
    return Compute(parts[0], parts[1], parts[2], parts[3], gemm)


def _fused_scale(flops, shape, elem: int, scores_at: float) -> float:
    """Megatron's fused softmax (+ dropout) score traffic over the recorded decomposition's."""
    recorded = sum(
        op.count * op.elements
        for op in flops.ops
        if op.kind == "memory" and op.score and op.in_block
    )
    # softmax in + out; dropout in, out, mask
    per_score = 2 + ((2 + 1 / elem) if shape.dropout else 0)
    return shape.layers * scores_at * per_score / recorded if recorded else 1.0


def _recomputed(op, recompute: str, score: bool) -> float:
    """The fraction of a block op's forward that `recompute` runs again."""
    if recompute == "full":
        return 1.0
    if recompute == "selective":
        return 1.0 if op.kind == "attention" or score else 0.0
    if recompute == "op":
        return {"gemm": 0.5, "attention": 0.0}.get(op.kind, 1.0)
    return 0.0


def kernel_time(flops, run, prof, share: float = 1.0, **kw) -> float:
    """One micro-batch's compute, op by op (the sum of `compute_parts`)."""
    return compute_parts(flops, run, prof, share, **kw).total
