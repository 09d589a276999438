"""Keyed initialisation for the one build path (dtp.runtime.build): each rank draws only its own
shards.

Every element of the *full* model's parameters is a pure function of (seed, parameter name, element
index in the model's own layout): a counter-based generator (splitmix64 of the index, then the
inverse normal CDF). A rank computes the global indices of the elements it holds (torch.chunk's
layout, packed parts put back in the model's row order) and draws only those, so the full weights
are identical at any tp and dp, and no rank ever holds more than its shards (plus one parameter's
index block at a time).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
import torch.nn as nn

from dtp import models
from dtp.errors import UsageError
from dtp.layout.norms import is_norm
from dtp.runtime.rows import ParamLayout, param_layouts
from dtp.runtime.shard import Applied

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_BLOCK = 1 << 16  # elements drawn at once: transient arrays stay near 2 MiB, whatever the model


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(seed: int, name: str) -> np.uint64:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return np.uint64(h)


def normal_at(seed: int, name: str, index: np.ndarray, std: float) -> np.ndarray:
    """N(0, std²) draws keyed on (seed, name, element index): the same value for an index on any
    rank."""
    with np.errstate(over="ignore"):
        bits = _mix(index.astype(np.uint64) * _GOLDEN + _key(seed, name))
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # (0, 1), never 0 or 1
    return torch.special.ndtri(torch.from_numpy(u)).numpy() * std


def init_rule(
    model: nn.Module, module: nn.Module, pname: str, full_name: str, ndim: int
) -> tuple[str, float]:
    """('normal', std) | ('zeros', 0) | ('ones', 0): the field's initialisation of one parameter
    (GPT-2's: normal(0, initializer_range) matrices, scaled residual projections, zero biases, unit
    norms)."""
    config = getattr(model, "config", None)
    std = float(getattr(config, "initializer_range", 0.02))
    if is_norm(module):
        return ("ones", 0.0) if pname == "weight" else ("zeros", 0.0)
    if pname.endswith("bias"):
        return "zeros", 0.0
    if isinstance(model, models.GPT) and full_name.endswith("c_proj.weight"):
        return "normal", std / math.sqrt(2 * config.n_layer)  # GPT-2's scaled residual projections
    if ndim >= 2:  # Linear, Embedding, Conv1D, 3-D expert weights
        return "normal", std
    raise UsageError(
        f"dtp train's keyed initialisation knows matrices, biases and norms; {full_name} is a "
        f"{ndim}-D parameter of a {type(module).__name__}; train from the model's own "
        "initialisation "
        "(--init model, the default)"
    )


def _fill(lay: ParamLayout, seed: int, std: float) -> None:
    """Draw this rank's elements of one parameter, `_BLOCK` at a time, at their model-layout
    indices."""
    shape, local = lay.shape, lay.local
    dims = [np.arange(n, dtype=np.int64) for n in shape]
    if lay.dim is not None:
        dims[lay.dim] = lay.rows(lay.param.device_mesh.get_local_rank()).numpy()
    strides = [int(np.prod(shape[k + 1 :], dtype=np.int64)) for k in range(len(shape))]
    rows = dims[0] if dims else np.zeros(1, dtype=np.int64)
    per_row = max(1, int(np.prod([len(d) for d in dims[1:]], dtype=np.int64)))
    step = max(1, _BLOCK // per_row)
    rest = np.zeros(1, dtype=np.int64)
    for k in range(1, len(dims)):  # the flat offsets of one row's local elements
        rest = (rest[..., None] + dims[k] * strides[k]).reshape(-1)
    flat_local = local.view(-1) if local.dim() else local.view(1)
    for i in range(0, len(rows), step):
        idx = (rows[i : i + step, None] * (strides[0] if dims else 1) + rest[None, :]).reshape(-1)
        values = torch.from_numpy(normal_at(seed, lay.name, idx, std)).to(local.dtype)
        flat_local[i * per_row : i * per_row + len(idx)].copy_(values)


@torch.no_grad()
def fill_keyed(applied: Applied, seed: int) -> None:
    """Initialise this rank's (allocated) shards of `applied.model` from the keyed generator."""
    for lay in param_layouts(applied):
        kind, std = init_rule(applied.model, lay.module, lay.pname, lay.name, len(lay.shape))
        if kind != "normal":
            lay.local.fill_(1.0 if kind == "ones" else 0.0)
        else:
            _fill(lay, seed, std)
