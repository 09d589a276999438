"""Before any rank starts: is the world one this machine can host, and does the run fit in its memory?

The estimate is deliberately simple and stated in the message: rank 0 builds the whole model (P bytes) and
scatters the shards (dtp.runtime.build), every rank holds its shards, their gradients and momentum; rank 0 also keeps the unsharded
references — one in float64, the truth, and one in the run's dtype — each with parameters, gradients and
momentum, and runs both on the whole batch; a bfloat16 run adds float32 master weights and momentum
across the ranks; activations follow the
Megatron-SP paper's per-layer count (Korthikanti et al., 2022: 34·s·b·h + 5·a·s²·b bytes at 16 bits, i.e.
17·s·b·h + 2.5·a·s²·b elements) plus the logits and their gradient.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from dtp.errors import UsageError

_LAYER_KEYS = ("n_layer", "num_hidden_layers", "n_layers", "num_layers")
_HIDDEN_KEYS = ("n_embd", "hidden_size", "dim", "d_model")
_HEAD_KEYS = ("n_head", "num_attention_heads", "n_heads", "num_heads")


def max_cpu_world() -> int:
    """The most local CPU ranks dtp will start: 4 per core (at least 8)."""
    return max(4 * (os.cpu_count() or 1), 8)


def check_world(world: int, device: str) -> None:
    """Refuse a local world this machine cannot host (each rank is a process with its own torch)."""
    if device == "cpu" and world > max_cpu_world():
        raise UsageError(f"tp × dp = {world} ranks is far more than this machine's {os.cpu_count()} cores can host "
                         f"(at most {max_cpu_world()} local CPU ranks); use a smaller --tp/--dp, or torchrun on "
                         "more machines")


def available_bytes() -> int | None:
    """Memory this process may still use: MemAvailable, bounded by a cgroup (v2) limit if there is one."""
    avail = None
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max", encoding="ascii").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current", encoding="ascii").read())
        if limit != "max":
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def _config_int(model, keys: tuple[str, ...]) -> int | None:
    config = getattr(model, "config", None)
    return next((getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None)


def activation_elements(model, batch: int, seq: int, vocab: int | None, tp: int = 1) -> int:
    """Elements one forward+backward saves for `batch` × `seq` tokens on a rank of a tp group: per layer
    5·s·b·h replicated and 12·s·b·h + 2.5·a·s²·b split over tp (Korthikanti et al.; tp 1: 17·s·b·h + 2.5·a·s²·b),
    plus the logits and their gradient (3·b·s·V, split over tp)."""
    layers, hidden = _config_int(model, _LAYER_KEYS), _config_int(model, _HIDDEN_KEYS)
    heads = _config_int(model, _HEAD_KEYS) or 1
    acts = 0
    if layers and hidden:
        acts = layers * (5 * seq * batch * hidden + (12 * seq * batch * hidden + (5 * heads * seq * seq * batch) // 2) // tp)
    return acts + 3 * batch * seq * (vocab or 0) // tp


@dataclass(frozen=True)
class Estimate:
    """Bytes the whole local run needs, and its parts."""

    params: int  # P: the unsharded model's parameters
    activations: int  # one forward+backward of the whole batch on the unsharded model
    total: int


def estimate(model, tp: int, dp: int, batch: int, seq: int, elem: int, vocab: int | None) -> Estimate:
    """Memory for `dtp apply` on one machine, all ranks together (`model` may live on the meta device)."""
    params = sum(p.numel() for p in model.parameters()) * elem
    acts = activation_elements(model, batch, seq, vocab) * elem
    world = tp * dp
    # Rank 0: the whole model it scatters from; every rank: its shards + their gradients and momentum
    # (≈ 3·P/tp/dp) and its share of the activations; rank 0: the float64 and same-dtype references (3 copies
    # each) and their activations on the whole batch; bfloat16: float32 master weights and momentum, split.
    elements = params // elem
    references = 3 * elements * 8 + 3 * params + acts * 8 // elem + acts
    masters = 2 * elements * 4 if elem < 4 else 0
    total = params + world * (3 * params // world + acts // world) + references + masters
    return Estimate(params, acts, total)


def check_memory(est: Estimate, device: str) -> None:
    """Refuse a CPU run whose estimate exceeds the memory available (a CUDA run is bounded by its GPUs)."""
    avail = available_bytes() if device == "cpu" else None
    if avail is not None and est.total > avail:
        raise UsageError(f"this run needs about {_gib(est.total)} of memory (parameters {_gib(est.params)}, "
                         f"activations {_gib(est.activations)}, for every rank plus the unsharded references) but "
                         f"{_gib(avail)} is available; use a smaller model, --batch or --seq, or run on more "
                         "machines with torchrun")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def cuda_device_count() -> int:
    """GPUs visible to this process."""
    import torch

    return torch.cuda.device_count()
