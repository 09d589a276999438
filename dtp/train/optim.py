"""The optimizer side of training: AdamW on DTensor parameters, warm-up + cosine, global-norm
clipping.

Parameters stay float32 (the master weights); `--dtype bfloat16` runs forward and loss under
autocast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from dtp.compiler.local_params import like


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


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of `t` (a DTensor's local tensor, a plain tensor itself): no copy, no
    collective."""
    return t._local_tensor if isinstance(t, DTensor) else t


def settle_grads(parameters) -> None:
    """Give every DTensor gradient its parameter's placements (a Partial gradient, e.g. of a
    sequence-parallel norm, is all-reduced here, once), so that elementwise updates may run on the
    local tensors."""
    for p in parameters:
        g = p.grad
        if (
            isinstance(g, DTensor)
            and g._spec is not p._spec
            and (g.placements != p.placements or g.device_mesh != p.device_mesh)
        ):
            p.grad = g.redistribute(p.device_mesh, p.placements)


class LocalAdamW(torch.optim.AdamW):
    """torch's AdamW, its state and param groups unchanged (checkpoints are the same), with the
    update run by torch's foreach kernels on each parameter's local tensor. AdamW is elementwise, so
    updating every shard (and every replica, which sees the same gradient) is updating the whole
    tensor; torch's own foreach path refuses a group that mixes DTensors on several meshes (tp,
    FSDP2's dp) with plain tensors, and its per-tensor path pays DTensor's dispatch for each of ~10
    ops per parameter."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        return _local_steps(self, closure, self._update)

    def _update(self, group: dict, params: list) -> None:
        for p in params:
            state = self.state[p]
            if not state:  # as torch's Adam._init_group (scalar step on the CPU)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(
            [local(p) for p in params],
            [local(p.grad) for p in params],
            [local(s["exp_avg"]) for s in states],
            [local(s["exp_avg_sq"]) for s in states],
            [],
            [s["step"] for s in states],
            foreach=True,
            capturable=False,
            differentiable=False,
            fused=None,
            grad_scale=None,
            found_inf=None,
            has_complex=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


class LocalSGD(torch.optim.SGD):
    """torch's SGD (momentum, dampening, Nesterov, decay as configured; its state as torch keeps it)
    with the update run by torch's foreach kernels on each parameter's local tensor, for the reason
    LocalAdamW gives."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        return _local_steps(self, closure, self._update)

    def _update(self, group: dict, params: list) -> None:
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        local_buffers = [None if b is None else local(b) for b in buffers]
        sgd(
            [local(p) for p in params],
            [local(p.grad) for p in params],
            local_buffers,
            foreach=True,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            has_sparse_grad=False,
        )
        for p, before, after in zip(params, buffers, local_buffers):
            # torch's first step clones the gradient: keep p's type
            if group["momentum"] and before is None:
                self.state[p]["momentum_buffer"] = (
                    like(p, after) if isinstance(p, DTensor) else after
                )


class LocalGradScaler(ShardedGradScaler):
    """torch's loss scaler for float16 training — dynamic scale, a step with a non-finite gradient
    skipped, the flag all-reduced over the world so that every rank skips alike (ShardedGradScaler)
    — unscaling each gradient's local tensor, for the reason LocalAdamW gives (torch's foreach
    unscale refuses a list mixing DTensors and tensors). Settle Partial gradients first
    (settle_grads): their local tensors are not yet the gradient."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        grads = [
            SimpleNamespace(grad=local(p.grad))
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        view = SimpleNamespace(param_groups=[{"params": grads}])
        return super()._unscale_grads_(view, inv_scale, found_inf, allow_fp16)


def _local_steps(opt: torch.optim.Optimizer, closure, update) -> object:
    """torch's step protocol around `update(group, params)`: the closure under autograd, then each
    group's parameters that have a gradient, their gradients settled to the parameters' placements
    first."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            settle_grads(params)
            update(group, params)
    return loss


def adamw(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (nanoGPT's split: no decay on biases, norms), foreach on
    local tensors."""
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights appear once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the group's flag is not read
    return LocalAdamW(groups, lr=lr, betas=betas, foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate (the schedule is a pure function of the step: nothing to
    save)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm(
    parameters, shared: dict[int, tuple[int, torch.Tensor]] | None = None
) -> torch.Tensor:
    """The global L2 norm of all gradients, equal to the unsharded model's: each DTensor contributes
    its norm over the whole mesh (one collective per mesh), each plain tensor (replicated) its local
    norm. A parameter in `shared` (id → dtp.runtime.rows.shared_rows' dim and row weights) holds
    some rows on several ranks: its gradient is gathered and each row weighted so that every model
    row counts once."""
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
            squares.append(
                (full.double().pow(2) * weights.to(full.device).view(shape)).sum().float()
            )
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
def clip_(
    parameters, max_norm: float, shared: dict[int, tuple[int, torch.Tensor]] | None = None
) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm` (0: no clipping); returns
    the norm before clipping (`shared`: see grad_norm). No host sync: the scale stays a tensor, and
    one foreach multiply scales every local gradient (a shard scaled is the DTensor scaled)."""
    parameters = [p for p in parameters if p.grad is not None]
    settle_grads(parameters)
    norm = grad_norm(parameters, shared)
    if max_norm > 0 and parameters:
        scale = (max_norm / (norm.double() + 1e-6)).clamp(max=1.0).float()
        grads = [local(p.grad) for p in parameters]
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return norm
