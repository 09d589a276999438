"""Optimizer state in a checkpoint: created before a load (DCP loads in place), param-group
hyperparameters and non-tensor state restored after it, and plain data carried as byte tensors that
read back without running code."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.nn as nn

from dtp.checkpoint.files import CheckpointError

# the stored key of the param groups' hyperparameters and parameter names
GROUPS = "optim/param_groups"


def pack(obj: Any) -> torch.Tensor:
    """Plain data as a byte tensor: DCP stores it like any tensor, and reading it back runs no code."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: torch.Tensor, what: str) -> Any:
    """The inverse of `pack`, with torch.load's weights_only unpickler (tensors, numbers, strings,
    containers)."""
    try:
        return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(
            f"{what} cannot be read back as plain data: {str(err).splitlines()[0][:300]}"
        ) from None


def init_state(optimizer: torch.optim.Optimizer, model: nn.Module, saved: dict[str, dict]) -> None:
    """Create, as zeros, the state tensors the checkpoint holds (`saved`: its tensor table) that the
    optimizer does not have yet, so that DCP can load into them in place. Cheaper than torchtitan's
    zero-lr step and leaves the parameters untouched; scalars (Adam's `step`) live on the CPU unless
    the group is capturable or fused, as torch's optimizers keep them."""
    params = dict(model.named_parameters())
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for key, info in saved.items():
        if not key.startswith("optim/"):
            continue
        _, name, field = key.split("/", 2)
        p = params.get(name)
        if p is None or id(p) not in group_of or field in optimizer.state[p]:
            # a parameter this model lacks is reported by name when the tensors are matched
            continue
        dtype = getattr(torch, info["dtype"])
        if info["shape"]:
            optimizer.state[p][field] = torch.zeros_like(p.detach(), dtype=dtype)
        else:
            group = group_of[id(p)]
            device = (
                p.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
            )
            optimizer.state[p][field] = torch.zeros((), dtype=dtype, device=device)


def restore_optimizer(optimizer: torch.optim.Optimizer, objects: dict, model: nn.Module) -> None:
    """Hyperparameters of each param group and non-tensor per-parameter state, from the checkpoint."""
    groups = objects[GROUPS]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    for i, (saved, group) in enumerate(zip(groups, optimizer.param_groups)):
        if saved["params"] != [names[id(p)] for p in group["params"]]:
            raise CheckpointError(
                f"parameter group {i} of the checkpoint's optimizer holds other parameters "
                "than this one's"
            )
        group.update({k: v for k, v in saved.items() if k != "params"})
    for key, value in objects.items():
        if key != GROUPS:
            _, name, field = key.split("/", 2)
            optimizer.state[params[name]][field] = value
