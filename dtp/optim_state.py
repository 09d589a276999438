"""Optimizer state in a checkpoint: created before a load (DCP loads in place), param-group hyperparameters
and non-tensor state restored after it, and plain data carried as byte tensors that read back without
running code."""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.nn as nn

from dtp.checkpoint_files import CheckpointError

GROUPS = "optim/param_groups"  # the stored key of the param groups' hyperparameters and parameter names


def pack(obj: Any) -> torch.Tensor:
    """Plain data as a byte tensor: DCP stores it like any tensor, and reading it back runs no code."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: torch.Tensor, what: str) -> Any:
    """The inverse of `pack`, with torch.load's weights_only unpickler (tensors, numbers, strings, containers)."""
    try:
        return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"{what} cannot be read back as plain data: {str(err).splitlines()[0][:300]}") from None


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state where it has none, so that DCP can load into it in place: one step at
    learning rate 0 on zero gradients (as torchtitan does), leaving the parameters bit-for-bit unchanged."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def restore_optimizer(optimizer: torch.optim.Optimizer, objects: dict, model: nn.Module) -> None:
    """Hyperparameters of each param group and non-tensor per-parameter state, from the checkpoint."""
    groups = objects[GROUPS]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
                              f"{len(optimizer.param_groups)}")
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    for i, (saved, group) in enumerate(zip(groups, optimizer.param_groups)):
        if saved["params"] != [names[id(p)] for p in group["params"]]:
            raise CheckpointError(f"parameter group {i} of the checkpoint's optimizer holds other parameters "
                                  "than this one's")
        group.update({k: v for k, v in saved.items() if k != "params"})
    for key, value in objects.items():
        if key != GROUPS:
            _, name, field = key.split("/", 2)
            optimizer.state[params[name]][field] = value
