"""The optimizer every run uses, and rank 0's unsharded references (see dtp.parity for the rule).

`MixedSGD` is Megatron's mixed precision for SGD: parameters held in bfloat16 (or float16) are trained
through float32 master copies (gradients cast up, the step taken on the masters, the result rounded back
into the parameters), so updates far below a bfloat16 step still accumulate. Parameters in float32 or
float64 are their own masters.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

LOW_PRECISION = (torch.bfloat16, torch.float16)
MOMENTUM = 0.9


class MixedSGD:
    """SGD with momentum on master weights (float32 copies of low-precision parameters)."""

    def __init__(self, model: nn.Module, lr: float):
        self.params = dict(model.named_parameters())
        self.masters = {n: (p.detach().float().requires_grad_(p.requires_grad) if p.dtype in LOW_PRECISION else p)
                        for n, p in self.params.items()}
        self.opt = torch.optim.SGD(list(self.masters.values()), lr=lr, momentum=MOMENTUM)

    @torch.no_grad()
    def step(self) -> None:
        """One step on the masters, then the parameters take their rounded values."""
        for n, p in self.params.items():
            m = self.masters[n]
            if m is not p:
                m.grad = p.grad.float() if p.grad is not None else None
        self.opt.step()
        for n, p in self.params.items():
            m = self.masters[n]
            if m is not p:
                p.copy_(m)

    def zero_grad(self) -> None:
        """Drop every gradient (parameters' and masters')."""
        for n, p in self.params.items():
            p.grad = None
            self.masters[n].grad = None

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype parameters are trained in."""
        return next(iter(self.masters.values())).dtype if self.masters else torch.float32


class Reference:
    """One unsharded copy of a model with its own optimizer, in a given dtype."""

    def __init__(self, model: nn.Module, lr: float, dtype: torch.dtype | None = None):
        self.model = copy.deepcopy(model)
        if dtype is not None:
            self.model.to(dtype)
        self.opt = MixedSGD(self.model, lr)

    def param(self, name: str) -> torch.Tensor | None:
        """A parameter as trained (its master copy)."""
        return self.opt.masters.get(name)

    def grad(self, name: str) -> torch.Tensor | None:
        """A parameter's gradient."""
        p = self.opt.params.get(name)
        return p.grad if p is not None else None
