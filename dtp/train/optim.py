"""The optimizer side of training: AdamW on DTensor parameters, warm-up + cosine, global-norm clipping.

Parameters stay float32 (the master weights); `--dtype bfloat16` runs forward and loss under autocast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to `min_lr` at `steps`."""

    lr: float
    min_lr: float
    warmup: int
    steps: int

    def __call__(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


def adamw(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (nanoGPT's split: no decay on biases, norms)."""
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights appear once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: one group mixes DTensors on different meshes (tp, FSDP2's dp) and plain tensors.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate (the schedule is a pure function of the step: nothing to save)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm(parameters, shared: dict[int, tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
    """The global L2 norm of all gradients, equal to the unsharded model's: each DTensor contributes its
    norm over the whole mesh (one collective per mesh), each plain tensor (replicated) its local norm. A
    parameter in `shared` (id → dtp.runtime.rows.shared_rows' dim and row weights) holds some rows on several
    ranks: its gradient is gathered and each row weighted so that every model row counts once."""
    shared = shared or {}
    by_mesh: dict[object, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    squares = []
    for p in parameters:
        if p.grad is None:
            continue
        if id(p) in shared:
            dim, weights = shared[id(p)]
            full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            shape = [1] * full.dim()
            shape[dim] = -1
            squares.append((full.double().pow(2) * weights.to(full.device).view(shape)).sum().float())
        elif isinstance(p.grad, DTensor):
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
        else:
            plain.append(p.grad)
    for grads in by_mesh.values():
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        squares.append((total.full_tensor() if isinstance(total, DTensor) else total).float() ** 2)
    if plain:
        squares.append(torch.nn.utils.get_total_norm(plain, 2.0).float() ** 2)
    if not squares:
        return torch.zeros(())
    return torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()


@torch.no_grad()
def clip_(parameters, max_norm: float, shared: dict[int, tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm` (0: no clipping); returns the
    norm before clipping (`shared`: see grad_norm)."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = grad_norm(parameters, shared)
    if max_norm > 0:
        scale = min(1.0, max_norm / (float(norm) + 1e-6))
        for p in parameters:
            p.grad.mul_(scale)
    return norm
