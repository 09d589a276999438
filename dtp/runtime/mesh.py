"""The device mesh every command builds over an initialised world: (tp,) alone, or (dp, tp) with
FSDP2 over dp."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def make_mesh(tp: int, dp: int = 1, device: str = "cpu") -> DeviceMesh:
    """The ("tp",) mesh, or the ("dp", "tp") one when dp > 1, on CUDA or the CPU."""
    kind = "cuda" if device == "cuda" else "cpu"
    if dp > 1:
        return init_device_mesh(kind, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(kind, (tp,), mesh_dim_names=("tp",))


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (before reading a clock); a CPU computes as it is called."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
