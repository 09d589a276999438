"""Scale-ready initialisation: build on meta, shard, then materialise only this rank's shards.

Every element of the *full* model's parameters is a pure function of (seed, parameter name, element
index in the model's own layout): a counter-based generator (splitmix64 of the index, then the inverse
normal CDF). A rank computes the global indices of the elements it holds (torch.chunk's layout, packed
parts put back in the model's row order) and draws only those, so the full weights are identical at any
tp and dp, and no rank ever holds more than its shards (plus one parameter's index block at a time).
"""
from __future__ import annotations

import contextlib
import hashlib
import math

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtp import models
from dtp.check import Checked
from dtp.errors import UsageError
from dtp.placement import is_norm
from dtp.shard import Applied, apply
from dtp.styles import pack_rows

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
    """N(0, std²) draws keyed on (seed, name, element index): the same value for an index on any rank."""
    with np.errstate(over="ignore"):
        bits = _mix(index.astype(np.uint64) * _GOLDEN + _key(seed, name))
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53  # (0, 1), never 0 or 1
    return torch.special.ndtri(torch.from_numpy(u)).numpy() * std


def init_rule(model: nn.Module, module: nn.Module, pname: str, full_name: str) -> tuple[str, float]:
    """('normal', std) | ('zeros', 0) | ('ones', 0): the model's own initialisation of one parameter
    (GPT-2's: normal(0, 0.02) weights, scaled residual projections, zero biases, unit norms)."""
    config = getattr(model, "config", None)
    std = float(getattr(config, "initializer_range", 0.02))
    if is_norm(module):
        return ("ones", 0.0) if pname == "weight" else ("zeros", 0.0)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        if pname == "bias":
            return "zeros", 0.0
        if isinstance(model, models.GPT) and full_name.endswith("c_proj.weight"):
            return "normal", std / math.sqrt(2 * config.n_layer)  # GPT-2's scaled residual projections
        return "normal", std
    raise UsageError(f"dtp train initialises nn.Linear, nn.Embedding and norm parameters; {full_name} belongs "
                     f"to a {type(module).__name__}")


def local_indices(shape: tuple[int, ...], shard_dim: int | None, tp: int, tp_rank: int,
                  packed: int = 1) -> list[np.ndarray]:
    """Per dimension, the model-layout indices of the elements `tp_rank` holds (torch.chunk's layout;
    packed parts in Megatron's order, see dtp.styles.pack_rows)."""
    dims = [np.arange(n, dtype=np.int64) for n in shape]
    if shard_dim is not None:
        n = shape[shard_dim]
        order = dims[shard_dim]
        if packed > 1:
            order = pack_rows(torch.from_numpy(order), packed, tp).numpy()
        chunk = -(-n // tp)
        dims[shard_dim] = order[tp_rank * chunk:(tp_rank + 1) * chunk]
    return dims


def _fill(local: torch.Tensor, seed: int, name: str, shape: tuple[int, ...], dims: list[np.ndarray],
          std: float) -> None:
    strides = [int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape))]
    rows = dims[0] if dims else np.zeros(1, dtype=np.int64)
    per_row = max(1, int(np.prod([len(d) for d in dims[1:]], dtype=np.int64)))
    step = max(1, _BLOCK // per_row)
    rest = np.zeros(1, dtype=np.int64)
    for k in range(1, len(dims)):  # the flat offsets of one row's local elements
        rest = (rest[..., None] + dims[k] * strides[k]).reshape(-1)
    flat_local = local.view(-1) if local.dim() else local.view(1)
    for i in range(0, len(rows), step):
        idx = (rows[i:i + step, None] * (strides[0] if dims else 1) + rest[None, :]).reshape(-1)
        values = torch.from_numpy(normal_at(seed, name, idx, std)).to(local.dtype)
        flat_local[i * per_row:i * per_row + len(idx)].copy_(values)


@torch.no_grad()
def materialise(applied: Applied, device: torch.device, seed: int) -> None:
    """Allocate this rank's shards of `applied.model` (built on meta, then sharded) and initialise them."""
    model = applied.model
    buffers = dict(model.named_buffers(remove_duplicate=False))  # built on CPU by `build_on_meta`
    if any(b.is_meta for b in buffers.values()):
        raise UsageError("the model's buffers were built on the meta device; build it with dtp.train.init."
                         "build_on_meta, which keeps buffers (e.g. rotary frequencies) real")
    model.to_empty(device=device)
    for name, b in buffers.items():  # to_empty left them uninitialised: put back the values __init__ computed
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b.to(device)
    seen: set[int] = set()
    for path, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # a tied weight is initialised once, under its first owner's name
            seen.add(id(p))
            full_name = f"{path}.{pname}" if path else pname
            kind, std = init_rule(model, module, pname, full_name)
            local = p.to_local() if isinstance(p, DTensor) else p
            if kind != "normal":
                local.fill_(1.0 if kind == "ones" else 0.0)
                continue
            shard_dim, tp, tp_rank = None, 1, 0
            if isinstance(p, DTensor):
                placement = p.placements[0]  # the tp mesh: materialise runs before FSDP2
                if placement.is_shard():
                    shard_dim, tp, tp_rank = placement.dim, p.device_mesh.size(), p.device_mesh.get_local_rank()
            dims = local_indices(tuple(p.shape), shard_dim, tp, tp_rank, applied.compiled.packed.get(path, 1))
            if tuple(len(d) for d in dims) != tuple(local.shape):
                raise AssertionError(f"{full_name}: local shape {tuple(local.shape)} is not the chunk layout")
            _fill(local, seed, full_name, tuple(p.shape), dims, std)


@contextlib.contextmanager
def _parameters_to_meta():
    """Every parameter moves to meta as it is registered; buffers stay where __init__ built them. Non-persistent
    buffers (HF rotary `inv_freq`) are computed in __init__ and restored by nothing else, so they must be real;
    parameters are drawn later by the keyed init. A parameter exists on CPU only between its allocation
    (torch.empty: untouched pages) and its registration."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_on_meta(source: models.ModelSource) -> nn.Module:
    """The model in float32 with its parameters on meta and its buffers real (on CPU)."""
    with _parameters_to_meta():
        return models.build(source, device="cpu", dtype=torch.float32)


def build_sharded(plan: Checked, source: models.ModelSource, mesh: DeviceMesh, *, seed: int,
                  device: torch.device, dp: int = 1) -> Applied:
    """The one way to build a sharded model: meta (buffers real) → shard on `mesh`'s tp dimension →
    materialise this rank's shards in float32 → FSDP2 over dp (which shards the materialised tp-local tensors again)."""
    from dtp.data_parallel import data_parallel

    model = build_on_meta(source)
    applied = apply(plan, model, mesh, seed)
    materialise(applied, device, seed)
    if dp > 1:
        data_parallel(model, mesh["dp"])
    return applied

