"""Activation recomputation (`dtp train --recompute`), with the meaning `dtp simulate` prices:

- `full`: each block's whole forward again in backward (Megatron's `--recompute-granularity full`);
  the block keeps only its input;
- `selective`: the attention core again (Korthikanti et al. 2022, §5: the scores, their softmax and
  dropout, and their product with V; with a fused kernel, the kernel), and with it what is cheap
  to make again: of the rest only the outputs of `_KEPT`'s ops are kept (the matrix multiplies'
  products; the outputs of the nonlinearities, of a LayerNorm or fused RMSNorm, of aten's
  native_dropout), while views, casts, residual adds and other elementwise ops (an eager RMSNorm's
  or a CPU dropout's pieces among them) run again. Nothing quadratic in the sequence is kept, and
  less than under K22's selective recomputation, which `dtp simulate` prices (everything but
  attention kept); dtp.train.predict counts what this policy keeps;
- `op`: torchtitan's per-op policy: keep the output of every other matrix multiply, of attention
  and of the collectives; recompute the rest.

All three run torch's non-reentrant checkpoint over each block (dtp.cost.fsdp.units); `selective`
and `op` through torch's selective checkpointing policies. Their collectives are always kept, so
none runs again in backward (dtp reduces a copy of the product there: torch refuses a kept tensor
mutated later); with `full` the block's forward collectives run again, as simulate counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from dtp.compiler.layer import layer_class
from dtp.cost.fsdp import units
from dtp.runtime.comm import is_collective

_ATTENTION = {
    name
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(torch.ops.aten, name)
}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}


def _name(op) -> str:
    return op._overloadpacket.__name__ if hasattr(op, "_overloadpacket") else str(op)


# what the selective policy keeps: the products and the nonlinear ops' and norms' outputs, the
# tensors backward reads; everything else (views, casts, adds, masks, a norm's pieces) runs again.
# A kept tensor must not be mutated later (torch refuses it), so the list is of ops whose output
# nobody edits in place; dtp's own in-place all-reduce reduces a copy under the policy.
_KEPT = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "linear",
    "gelu",
    "silu",
    "relu",
    "tanh",
    "sigmoid",
    "native_layer_norm",
    "_fused_rms_norm",
    "native_dropout",
    "embedding",
}


def _scores(seq: int, t) -> bool:
    """Whether `t` is an attention score tensor: (…, seq, seq), three or more dimensions."""
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and tuple(t.shape[-2:]) == (seq, seq)


def _score_product(seq: int, args) -> bool:
    """A batched product of attention: q·kᵀ, (…, seq, d) × (…, d, seq), or the scores times v."""
    a, b = args[-2], args[-1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (a.shape[-2], b.shape[-1]) == (seq, seq) or _scores(seq, a)


def selective_policy(seq: int):
    """Megatron's selective recomputation: the attention core (its kernel, or the products and
    softmax of an eager attention: every op on seq × seq scores) runs again in backward; of the
    rest, the outputs backward reads are kept (_KEPT: products, activations, norms, dropout,
    embeddings, and the collectives), and what is cheap to make again from them (views, casts,
    residual adds, masks) runs again."""

    def policy(ctx, op, *args, **kwargs):
        name = _name(op)
        if is_collective(op):
            return CheckpointPolicy.MUST_SAVE
        if name in _ATTENTION or any(_scores(seq, a) for a in args):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if name in _KEPT and not (name in {"bmm", "baddbmm"} and _score_product(seq, args)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_policy():
    """torchtitan's per-op policy: matrix multiplies kept except every second one, attention and
    collectives kept, everything else recomputed. The count restarts with each block's forward (and
    again in its recomputation, so both see the same parity)."""
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        name = _name(op)
        if is_collective(op) or name in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if name in _MATMULS:
            phase = "recompute" if ctx.is_recompute else "forward"
            count[phase] += 1
            keep = count[phase] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(make_policy: Callable) -> Callable:
    """A context_fn for torch's checkpoint: a fresh policy (its own counts) per block call."""
    return lambda: create_selective_checkpoint_contexts(make_policy())


class _Recomputed:
    """The forward of a block whose activations are recomputed in backward (torch.utils.checkpoint,
    non-reentrant). early_stop=False recomputes the whole block as Megatron does, so under `full`
    every forward collective of a block runs again in backward (torch's early stop would skip the
    last one, whose output nothing saves). `_context_fn` is the block class's: None for `full`."""

    _context_fn = None

    def forward(self, *args, **kwargs):
        extra = {"context_fn": self._context_fn} if self._context_fn is not None else {}
        return checkpoint(
            super().forward, *args, use_reentrant=False, early_stop=False, **extra, **kwargs
        )


def recompute_blocks(model: nn.Module, policy: str, seq: int) -> list[str]:
    """Make each block of `model` recompute under `policy` (a subclass, as dtp's styles make their
    layers: the block's own forward and parameter names stay); the blocks' paths."""
    if policy == "none":
        return []
    context = {
        "full": None,
        "selective": _contexts(partial(selective_policy, seq)),
        "op": _contexts(op_policy),
    }[policy]
    fn = None if context is None else staticmethod(context)
    mixin = type(
        f"Recomputed_{policy}", (_Recomputed,), {"_context_fn": fn, "prefix": "Recomputed"}
    )
    classes: dict[type, type] = {}  # one class per kind of block
    blocks = units(model)
    for path in blocks:
        block = model.get_submodule(path)
        kind = type(block)
        block.__class__ = classes.setdefault(kind, layer_class(mixin, kind))
    return blocks
