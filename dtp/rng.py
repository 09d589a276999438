"""Dropout under tensor parallelism: Megatron's RNG tracker, scoped by module hooks.

Replicated activations must see the same dropout mask on every rank (else the replicas diverge), and
sharded ones different masks (else every rank drops the same pattern from different heads). dtp keeps
the default generator in step on all ranks, and switches to a per-rank generator state (seeded with
seed + 2718 + tp rank, as Megatron's `model-parallel-rng`) from the output of each colwise layer to the
input of the next rowwise layer: exactly the sharded region between Megatron's f and g.
"""
from __future__ import annotations

import torch
import torch.nn as nn

TP_SEED_OFFSET = 2718  # Megatron's offset for the model-parallel RNG


class TensorParallelRNG:
    """Swaps the device's default generator state in and out of the sharded regions."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = device
        saved = self._get()
        torch.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self.sharded_state = self._get()
        self._set(saved)
        self.replicated_state: torch.Tensor | None = None  # set while inside a sharded region

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def enter(self) -> None:
        """Entering a sharded region (after a colwise layer); repeated entries (q, k, v) are one."""
        if self.replicated_state is None:
            self.replicated_state = self._get()
            self._set(self.sharded_state)

    def leave(self) -> None:
        """Leaving it (before a rowwise layer)."""
        if self.replicated_state is not None:
            self.sharded_state = self._get()
            self._set(self.replicated_state)
            self.replicated_state = None


def track(model: nn.Module, colwise: list[str], rowwise: list[str], rng: TensorParallelRNG) -> None:
    """Install the region hooks on the model's colwise and rowwise modules."""
    for path in colwise:
        model.get_submodule(path).register_forward_hook(lambda m, a, o: rng.enter())
    for path in rowwise:
        model.get_submodule(path).register_forward_pre_hook(lambda m, a: rng.leave())
