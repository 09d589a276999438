"""The one way every command builds a sharded model: meta → shard → materialise.

The model is built with its parameters on the meta device (buffers real), sharded in place by the
plan, and then each rank allocates only its own shards and fills them from one of three sources:

- keyed (`dtp train --init keyed`): dtp.runtime.keyed_init's counter-based generator, a pure
  function of (seed, parameter, element index), so no rank ever holds more than its shards, but
  GPT-2's init replaces the model's own;
- rank 0's model (`dtp apply`, `dtp train`'s default `--init model`, the fuzz pools, `dtp bench`):
  the model's own initialisation, built whole on rank 0 only, each rank's block scattered from it
  (`build_from_model`);
- a pretrained Hugging Face directory (`dtp train PLAN DIR`, whose `--init model` is the file's
  weights): each rank reads only its own rows of each tensor from the safetensors files
  (dtp.runtime.pretrained.fill_pretrained).

Every way a parameter's full value does not depend on tp or dp. All fillers see a parameter through
the same index map (`row_order`, `ParamLayout.rows`): which rows of the model's own layout a rank
holds, packed parts included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtp import models
from dtp.checks.checker import Checked
from dtp.errors import UsageError
from dtp.runtime.data_parallel import data_parallel
from dtp.runtime.keyed_init import fill_keyed
from dtp.runtime.pretrained import fill_pretrained
from dtp.runtime.rows import param_layouts
from dtp.runtime.shard import Applied, apply, retie, tied_groups


@contextlib.contextmanager
def parameters_to_meta():
    """Every parameter moves to meta as it is registered; buffers stay where __init__ built them.
    Non-persistent buffers (HF rotary `inv_freq`) are computed in __init__ and restored by nothing
    else, so they must be real; parameters are filled later (keyed, or from rank 0). A parameter
    exists on CPU only between its allocation (torch.empty: untouched pages) and its registration."""
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


def build_on_meta(
    source: models.ModelSource | Callable[[], nn.Module], dtype: torch.dtype | None = torch.float32
) -> nn.Module:
    """The model (from a ModelSource, or a factory called as is) with its parameters on meta and its
    buffers real (on CPU), in `dtype` (None: as built)."""
    with parameters_to_meta():
        if not callable(source):
            # filled after sharding
            return models.build(source, device="cpu", dtype=dtype, weights=False)
        with torch.device("cpu"):
            model = source()
        return models.cast(model, dtype)


def allocate(model: nn.Module, device: torch.device) -> None:
    """Give the sharded meta model real, uninitialised storage on `device`, buffers kept as built."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    if any(b.is_meta for b in buffers.values()):
        raise UsageError(
            "the model's buffers were built on the meta device; build it with dtp.runtime.build."
            "build_on_meta, which keeps buffers (e.g. rotary frequencies) real"
        )
    groups = tied_groups(model)
    # a new Parameter per owner: tied weights come apart, so tie them again
    model.to_empty(device=device)
    retie(model, groups)
    # to_empty left them uninitialised: put back the values __init__ computed
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b.to(device)


@torch.no_grad()
def scatter_from(full: nn.Module | None, applied: Applied, device: torch.device) -> None:
    """Fill every rank's shards from rank 0's unsharded `full` (None on the other ranks): one
    scatter per sharded parameter, one broadcast per replicated parameter and buffer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_ranks: list = [None] * world
    layouts = list(param_layouts(applied))
    tp_rank = next(
        (lay.param.device_mesh.get_local_rank() for lay in layouts if lay.dim is not None), 0
    )
    dist.all_gather_object(tp_ranks, tp_rank)
    sources = dict(full.named_parameters()) if rank == 0 else {}
    for lay in layouts:
        local = lay.local
        if rank == 0:
            value = sources.get(lay.name)
            if value is None or tuple(value.shape) != lay.shape:
                raise AssertionError(
                    f"{lay.name}: rank 0's model has "
                    f"{None if value is None else tuple(value.shape)}, "
                    f"the sharded model {lay.shape}"
                )
        if lay.dim is None:
            if rank == 0:
                local.copy_(value)
            dist.broadcast(local, src=0)
            continue
        longest = max(len(lay.rows(r)) for r in range(lay.tp)) * (
            local.numel() // max(local.shape[lay.dim], 1)
        )
        received = torch.empty(longest, dtype=local.dtype, device=device)
        blocks = None
        if rank == 0:  # uneven chunks (vocabulary 257 at tp 2) travel padded to the longest
            padded = [torch.zeros(longest, dtype=local.dtype, device=device) for _ in range(lay.tp)]
            for r, block in enumerate(padded):
                piece = value.index_select(lay.dim, lay.rows(r).to(value.device)).reshape(-1)
                block[: piece.numel()].copy_(piece)
            blocks = [padded[tp_ranks[w]] for w in range(world)]
        dist.scatter(received, blocks, src=0)
        local.view(-1).copy_(received[: local.numel()])


@torch.no_grad()
def share_buffers(model: nn.Module, full: nn.Module | None) -> None:
    """Every plain buffer as rank 0 holds it (`full`'s, where rank 0 built the whole model), on
    every rank: one drawn in __init__ would differ otherwise, floating or not (a permutation, a
    mask). Booleans travel as bytes: gloo has no bool."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    full_buffers = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if isinstance(buf, DTensor):
            continue
        if name in full_buffers and full_buffers[name].shape == buf.shape:
            buf.copy_(full_buffers[name])
        dist.broadcast(buf.view(torch.uint8) if buf.dtype == torch.bool else buf, src=0)


def build_sharded(
    plan: Checked,
    source: models.ModelSource | Callable[[], nn.Module],
    mesh: DeviceMesh,
    *,
    seed: int,
    device: torch.device,
    dp: int = 1,
    dtype: torch.dtype | None = torch.float32,
    full: nn.Module | None = None,
    from_rank0: bool = False,
    pretrained: bool = False,
    plain: bool = False,
    dp_mode: str = "fsdp",
) -> Applied:
    """The one way to build a sharded model: meta (buffers real) → shard on `mesh`'s tp dimension →
    materialise this rank's shards (keyed init, scattered from rank 0's `full` model when
    `from_rank0` — every rank then continues from rank 0's CPU generator state —, read from a
    pretrained directory's files when `pretrained`) → FSDP2 over dp (which shards the materialised
    tp-local tensors again; `dp_mode` "ddp": replicated, dtp.runtime.data_parallel). `plain`: on a one-rank world (tp 1, dp 1) the model stays plain PyTorch
    (dtp.runtime.shard.apply)."""
    model = build_on_meta(source, dtype)
    applied = apply(plan, model, mesh, seed, plain=plain and dp == 1)
    allocate(model, device)
    if from_rank0:
        if (dist.get_rank() == 0) != (full is not None):
            raise AssertionError(
                "build_sharded(from_rank0=True) takes the full model on rank 0 only"
            )
        scatter_from(full, applied, device)
        # Only rank 0 drew the weights: every rank continues from its generator state, so a stream
        # the ranks share (dropout on replicated activations) starts equal everywhere, as if each
        # had built the model.
        state = [torch.get_rng_state()]
        dist.broadcast_object_list(state, src=0)
        torch.set_rng_state(state[0])
    elif pretrained:
        if not isinstance(source, models.ModelSource) or source.pretrained is None:
            raise AssertionError(
                "build_sharded(pretrained=True) takes a pretrained directory's ModelSource"
            )
        fill_pretrained(applied, source.pretrained)
    else:
        fill_keyed(applied, seed)
    share_buffers(model, full)
    if dp > 1:
        data_parallel(model, mesh["dp"], dp_mode)
    return applied


def build_from_model(
    plan: Checked,
    source: models.ModelSource,
    mesh: DeviceMesh,
    *,
    seed: int,
    device: torch.device,
    dp: int = 1,
    dtype: torch.dtype = torch.float32,
    plain: bool = False,
    dp_mode: str = "fsdp",
) -> Applied:
    """The model's own initialisation, sharded: rank 0 seeds torch's generators with `seed` and
    builds the whole model on the CPU (what `torch.manual_seed(seed); models.build(source,
    device="cpu", dtype=dtype)` gives, at any tp and dp), every rank receives its blocks; rank 0
    holds the whole model until they are scattered. A pretrained directory's own initialisation is
    its weights: every rank reads its slices, none the whole."""
    torch.manual_seed(seed)
    # every rank seeded alike and draws nothing: no state to share
    if source.pretrained is not None:
        return build_sharded(
            plan,
            source,
            mesh,
            seed=seed,
            device=device,
            dp=dp,
            dtype=dtype,
            pretrained=True,
            plain=plain,
            dp_mode=dp_mode,
        )
    full = models.build(source, device="cpu", dtype=dtype) if dist.get_rank() == 0 else None
    applied = build_sharded(
        plan,
        source,
        mesh,
        seed=seed,
        device=device,
        dp=dp,
        dtype=dtype,
        full=full,
        from_rank0=True,
        plain=plain,
        dp_mode=dp_mode,
    )
    del full
    return applied
