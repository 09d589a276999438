"""`--max-rank-memory`: refuse, before any rank starts, a tp whose per-rank training state exceeds
the budget.

A rank of `dtp train` holds its parameter shards in float32 (master weights, whatever --dtype), a
gradient of the same shape and AdamW's two moments: 4 × its row of the placement table
(dtp.cost.param_bytes). The model is built on meta and only those shards are ever materialised
(dtp.runtime.build), so at tp 1 the whole model counts against one rank and at tp 2 about half of
it: the budget decides which tp can train. Activations are not counted (they scale with --batch ×
--seq, not with the model).

`--init model` (the default) adds rank 0's copy of the whole model, built with the model's own init
and held until every rank has its shards: `check_init_memory` refuses a run whose host cannot hold
it. `check_train_memory` then adds what `--max-rank-memory` leaves out, for every local rank
together: the activations of its share of --batch × --seq
(dtp.runtime.preflight.activation_elements) and torch's own floor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtp.cost.explain import human_bytes
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.errors import UsageError
from dtp.runtime.preflight import activation_elements, available_bytes

if TYPE_CHECKING:
    import torch.nn as nn

    from dtp.checks.checker import Checked

STATE_COPIES = 4  # parameter, gradient, AdamW exp_avg and exp_avg_sq, all float32
TORCH_FLOOR = 128 * 2**20  # a rank's own torch, gloo buffers and Python objects, before any tensor


def state_bytes_per_rank(checked: Checked, model: nn.Module, tp: int, dp: int = 1) -> list[int]:
    """Each rank's parameters, gradients and AdamW moments (float32), from the placement table."""
    return [STATE_COPIES * b for b in param_bytes_per_rank(checked, model, tp, dp, elem=4)]


def check_budget(checked: Checked, model: nn.Module, tp: int, dp: int, budget: int) -> None:
    """Exit 2 (UsageError) when a rank's training state at `tp` × `dp` would exceed `budget` bytes."""
    need = max(state_bytes_per_rank(checked, model, tp, dp))
    if need > budget:
        raise UsageError(
            f"at --tp {tp} --dp {dp} a rank would hold {human_bytes(need)} ({need} B) of "
            "parameters, "
            f"gradients and AdamW state, over --max-rank-memory {human_bytes(budget)} ({budget} B); "
            ""
            "shard the model over more ranks (a larger --tp)"
        )


def check_init_memory(
    checked: Checked, model: nn.Module, tp: int, dp: int, device: str, available: int | None = None
) -> None:
    """Exit 2 when rank 0's whole float32 model (`--init model`) and, on the CPU, every local rank's
    shards would not fit the memory this host has available (`available`, default: measured now)."""
    available = available_bytes() if available is None else available
    if available is None:
        return
    full = sum(p.numel() for p in model.parameters()) * 4 + sum(
        b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point()
    )
    # else on GPUs
    shards = sum(param_bytes_per_rank(checked, model, tp, dp, elem=4)) if device == "cpu" else 0
    if full + shards > available:
        raise UsageError(
            f"--init model builds the whole model on rank 0 with its own initialisation before "
            f"scattering the shards: {human_bytes(full)} in float32"
            + (f", next to the ranks' {human_bytes(shards)} of shards" if shards else "")
            + f", but this host has {human_bytes(available)} available; use --init keyed, which "
            "draws each rank's shards where they live (GPT-2's init — normal matrices, unit norms, "
            "zero biases — instead of the model's own), or a host with more memory"
        )


def train_memory(
    checked: Checked,
    model: nn.Module,
    tp: int,
    dp: int,
    *,
    batch: int,
    seq: int,
    vocab: int | None,
    act_elem: int,
    init_model: bool,
    shards: int | None = None,
) -> tuple[int, int, int]:
    """(total, training state, activations) in bytes for every local rank of a run together, plus
    rank 0's whole float32 model under `--init model`; `batch` is what the ranks run at once (the
    global micro-batch); `shards`: how many dp ranks share the state (TrainConfig.state_shards;
    default dp: FSDP2's), each group of them holding it all."""
    shards = shards or dp
    state = sum(state_bytes_per_rank(checked, model, tp, shards)) * (dp // shards)
    acts = tp * dp * activation_elements(model, batch // dp, seq, vocab, tp) * act_elem
    full = sum(p.numel() for p in model.parameters()) * 4 if init_model else 0
    return state + acts + full + tp * dp * TORCH_FLOOR, state, acts


def check_train_memory(
    checked: Checked,
    model: nn.Module,
    tp: int,
    dp: int,
    *,
    batch: int,
    seq: int,
    vocab: int | None,
    act_elem: int,
    init_model: bool,
    available: int | None = None,
    shards: int | None = None,
) -> None:
    """Exit 2 when the local ranks' training state, activations and torch itself would not fit the
    memory this host has available (`available`, default: measured now), before any rank starts."""
    available = available_bytes() if available is None else available
    total, state, acts = train_memory(
        checked,
        model,
        tp,
        dp,
        batch=batch,
        seq=seq,
        vocab=vocab,
        act_elem=act_elem,
        init_model=init_model,
        shards=shards,
    )
    if available is not None and total > available:
        raise UsageError(
            f"at --tp {tp} --dp {dp}, --batch {batch} × --seq {seq} this run needs about "
            f"{human_bytes(total)} of memory (parameters, gradients and AdamW state "
            f"{human_bytes(state)}, activations {human_bytes(acts)}, {tp * dp} × "
            f"{human_bytes(TORCH_FLOOR)} for torch itself"
            + (", rank 0's whole model for --init model" if init_model else "")
            + f") but this host has {human_bytes(available)} available; use a smaller model, "
            "--batch or --seq, or run on more machines with torchrun"
        )
