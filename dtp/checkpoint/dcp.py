"""Checkpoints that reshard: save a sharded model and its optimizer at one tp/dp, load them at
another.

torch.distributed.checkpoint (DCP) writes every rank's shards and, at load, reads whatever chunks
the new layout needs. dtp hands it each tensor in a tp-independent form (dtp.checkpoint.canonical:
packed parts as (K, out/K, …), FSDP2 shards gathered per tp rank), records the plan, the mesh and a
sharding-independent fingerprint of every tensor (dtp.checkpoint.fingerprint), and checks all of it
at load, so a checkpoint whose content does not match what dtp wrote is refused instead of loaded
scrambled. On disk: dtp.checkpoint.files.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh

from dtp.checkpoint.canonical import View, chunk_range, packed_dims, packed_parts, view
from dtp.checkpoint.files import (
    FORMAT,
    LAYOUT,
    VERSION,
    CheckpointError,
    NoSpaceError,
    finalize,
    free_space,
    no_space,
    plan_label,
    read_meta,
    some,
)
from dtp.checkpoint.fingerprint import chunk_sums, finish
from dtp.checkpoint.lock import begin_save, release
from dtp.checkpoint.optim_state import GROUPS, init_state, pack, restore_optimizer, unpack
from dtp.checkpoint.untrusted import SafeReader
from dtp.checkpoint.zoo_hf import zoo_hf_config
from dtp.compiler.compiler import tp_mesh
from dtp.errors import DtpError
from dtp.lang import ir
from dtp.lang.parse import parse
from dtp.runtime.shard import tied_groups

__all__ = ["save_checkpoint", "load_checkpoint"]

# what a stored tensor adds to its bytes: torch.save's zip records (1.6 KiB, DCP saves each tensor
# on its own) and its entries in `.metadata` and dtp.json
ENTRY_BYTES = 2048


class _Writer(FileSystemWriter):
    """torch's FileSystemWriter, whose failures keep their OSError: torch.save reports a full disk
    as a RuntimeError ("unexpected pos …") whose context is the OSError, and DCP drops the context
    when it gathers the ranks' failures, and with it the reason."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as err:  # noqa: BLE001 - re-raised, as what the file system said
            raise _underlying(err) from None

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as err:  # noqa: BLE001 - re-raised, as what the file system said
            raise _underlying(err) from None


def _underlying(err: Exception) -> BaseException:
    """The OSError in `err`'s chain (what the file system said), else `err`."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return err


def wrapped(err: BaseException) -> list[BaseException]:
    """The exceptions a DCP CheckpointException wraps (each failed rank's, in rank order), else
    [err]."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return [err]
    return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]


def raise_interrupt(err: BaseException) -> None:
    """Raise the Ctrl-C or SIGTERM (dtp's Terminated) that DCP caught and wrapped into `err`: DCP
    catches BaseException, and an interrupted read or write is a stop, never a corrupt checkpoint."""
    for e in wrapped(err):
        if isinstance(e, KeyboardInterrupt):
            raise e from None


def _meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    names = mesh.mesh_dim_names or ()
    return tp_mesh(mesh), (mesh["dp"] if mesh.ndim > 1 and "dp" in names else None)


def _agree(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0 and hand every rank its result, or raise its DtpError on every rank."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (fn(), None)
        except DtpError as err:
            box[0] = (None, err)
    dist.broadcast_object_list(box, src=0)
    result, err = box[0]
    if err is not None:
        raise err
    return result


def _reason(err: BaseException) -> str:
    """One line saying why DCP failed (its CheckpointException wraps each rank's exception)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, first = sorted(failures.items())[0]
        err = first[0] if isinstance(first, tuple) else first
        text = f"{type(err).__name__}: {err} (rank {rank})"
    else:
        text = f"{type(err).__name__}: {err}"
    return text.splitlines()[0][:400] if text else type(err).__name__


def _views(
    model: nn.Module, optimizer: torch.optim.Optimizer, plan: ir.Plan, mesh: DeviceMesh
) -> tuple[dict[str, View], dict[str, Any]]:
    """Every parameter, persistent buffer and optimizer-state tensor in canonical form, keyed as
    stored (`model/NAME`, `optim/NAME/KEY`); and the optimizer's non-tensor state. Tied weights
    appear once."""
    tp, dp = _meshes(mesh)
    parts = packed_parts(plan, model)
    # remove_duplicate: a tied weight keeps its first name
    names = {id(p): n for n, p in model.named_parameters()}
    views = {f"model/{n}": view(p, parts.get(n, 1), tp, dp) for n, p in model.named_parameters()}
    persistent = model.state_dict(keep_vars=True).keys()
    views.update(
        {f"model/{n}": view(b, 1, tp, dp) for n, b in model.named_buffers() if n in persistent}
    )
    objects: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer holds a parameter that is not the model's")
            name = names[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                stored = f"optim/{name}/{key}"
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim()
                    and tuple(value.shape) == tuple(p.shape)
                ):
                    views[stored] = view(value, parts.get(name, 1), tp, dp)
                elif isinstance(value, torch.Tensor) and not value.dim():
                    views[stored] = view(value, 1, tp, dp)
                else:
                    objects[stored] = value
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    objects[GROUPS] = groups
    return views, objects


def _fingerprints(views: dict[str, View]) -> dict[str, str]:
    """Each stored tensor's fingerprint, summed over the chunks of the lowest rank holding each (a
    collective)."""
    keys = sorted(views)
    sums = torch.zeros(len(keys), 2, dtype=torch.int64)
    for i, key in enumerate(keys):
        v = views[key]
        if v.lead:
            sums[i] = torch.tensor(chunk_sums(v.local, v.offsets, tuple(v.stored.shape)))
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        sums = sums.cuda()
    dist.all_reduce(sums)
    return {key: finish(sums[i].tolist()) for i, key in enumerate(keys)}


def _plan_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _hf_config(model: nn.Module) -> dict | None:
    """A Hugging Face model's config as a dict (for `dtp export --hf-dir`), else None."""
    # the zoo's GPT and Llama export as GPT2LMHeadModel and LlamaForCausalLM
    zoo = zoo_hf_config(model)
    if zoo is not None:
        return zoo
    config = getattr(model, "config", None)
    if (
        config is None
        or not hasattr(config, "to_dict")
        or not hasattr(type(model), "from_pretrained")
    ):
        return None
    data = config.to_dict()
    data["architectures"] = data.get("architectures") or [type(model).__name__]
    return data


def save_checkpoint(
    directory,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    mesh: DeviceMesh,
    plan_text: str,
    extra: dict,
) -> dict:
    """Save with DCP: model, optimizer state, the plan text and its hash, tp/dp, and `extra` (plain
    picklable data, kept per rank). Atomic: a run killed mid-save never leaves a checkpoint that
    loads as complete. A full disk, found before writing or while writing, is the same NoSpaceError
    on every rank, and leaves the previous checkpoint in `directory` as it was. Returns stats: path,
    bytes, seconds. Every rank calls it."""
    t0 = time.perf_counter()
    directory = Path(directory)
    plan = parse(plan_text)  # once per save: the layout it records
    views, objects = _views(model, optimizer, plan, mesh)
    state: dict[str, Any] = {k: v.stored for k, v in views.items()}
    state.update({k: pack(v) for k, v in objects.items()})
    mine = state[f"extra/rank{dist.get_rank()}"] = pack(extra)
    try:  # refuse now what a resume could not read back
        unpack(
            mine,
            "`extra` (it must hold plain data: numbers, strings, lists, dicts, tuples, tensors)",
        )
        problem = None
    except CheckpointError as err:
        problem = str(err)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine.numel(), problem))
    if any(p for _, p in gathered):
        raise CheckpointError(next(p for _, p in gathered if p))
    sizes = [n for n, _ in gathered]
    # what the save writes, all ranks together: every stored tensor once (the lowest rank holding a
    # replicated chunk writes it), each rank's `extra`, and each entry's headers
    needed = sum(sizes) + sum(
        t.numel() * t.dtype.itemsize + ENTRY_BYTES
        for k, t in state.items()
        if not k.startswith("extra/")
    )
    tmp_name, locked = _agree(lambda: begin_save(directory, needed))
    tmp = Path(tmp_name)
    try:
        try:
            stats = _write(
                state, views, tmp, directory, model, optimizer, mesh, plan, objects, sizes
            )
        finally:  # on rank 0, which made them: a failed save leaves no DIR.tmp-* and no lock
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                if locked:
                    release(directory)
    except NoSpaceError as err:
        # counted on rank 0 once the partial files are gone: every rank says the same
        free, mount = _agree(lambda: free_space(directory))
        raise err.told(needed=needed, free=free, mount=mount) from None
    return {**stats, "seconds": time.perf_counter() - t0}


def _write(
    state: dict[str, Any],
    views: dict[str, View],
    tmp: Path,
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh,
    plan: ir.Plan,
    objects: dict,
    sizes: list,
) -> dict:
    """DCP's save into `tmp`, then dtp.json and the marker, and the rename to `directory` (every
    rank)."""
    prints = _fingerprints(views)
    try:
        # Replicated chunks are written by the lowest rank holding them: the one `_fingerprints`
        # hashes.
        dcp.save(
            state,
            storage_writer=_Writer(tmp),
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
        )
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
        raise_interrupt(err)
        # every rank holds every rank's failure (DCP gathers them): all raise the same error
        reason = next(filter(None, map(no_space, wrapped(err))), None)
        if reason:
            raise NoSpaceError(
                f"saving checkpoint {directory}", reason, f"{directory} is as it was"
            ) from None
        raise CheckpointError(f"cannot save checkpoint {directory}: {_reason(err)}") from None
    tp, dp = _meshes(mesh)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "layout": LAYOUT,
        "torch": torch.__version__,
        "plan": {
            "name": plan.name,
            "version": plan.plan_version,
            "sha256": _plan_digest(plan.source),
            "text": plan.source,
        },
        "mesh": {
            "tp": tp.size(),
            "dp": dp.size() if dp is not None else 1,
            "world": dist.get_world_size(),
        },
        "tensors": {
            k: {
                "shape": list(v.stored.shape),
                "dtype": str(v.stored.dtype).removeprefix("torch."),
                "fingerprint": prints[k],
            }
            for k, v in views.items()
        },
        "objects": {
            **{k: v.numel() for k, v in state.items() if k in objects},
            **{f"extra/rank{r}": n for r, n in enumerate(sizes)},
        },
        "packed": packed_parts(plan, model),
        "packed_dims": packed_dims(plan, model),  # absent or {}: every packed tensor on dim 0
        "tied": [[f"{path}.{name}".lstrip(".") for path, name in g] for g in tied_groups(model)],
        "model_class": type(model).__name__,
        "hf_config": _hf_config(model),
        "optimizer": type(optimizer).__name__,
    }
    nbytes = _agree(lambda: finalize(tmp, directory, meta))
    return {"path": str(directory), "bytes": nbytes}


def check_plan_matches(meta: dict, plan: ir.Plan, directory: Path, convert: bool) -> None:
    """A checkpoint written by another plan is a CheckpointError, unless `convert` re-cuts its
    tensors."""
    saved = meta["plan"]
    digest = _plan_digest(plan.source)
    if saved["sha256"] == digest or convert:
        return
    written = plan_label(saved["name"], saved["version"], saved["sha256"])
    raise CheckpointError(
        f"checkpoint {directory} was written by {written}, "
        f"not by {plan_label(plan.name, plan.plan_version, digest)}; load it with convert=True "
        "to re-cut its tensors for this plan"
    )


def model_shape(
    key: str, shape: tuple[int, ...], parts: dict[str, int], dims: dict[str, int]
) -> tuple[int, ...]:
    """The shape in the model of the tensor stored under `key` with `shape`, under packing `parts`
    along `dims`."""
    name = key.split("/")[1]
    if parts.get(name, 1) <= 1:
        return shape
    d = dims.get(name, 0)
    return (*shape[:d], shape[d] * shape[d + 1], *shape[d + 2 :])


def _match(
    meta: dict,
    views: dict[str, View],
    parts: dict[str, int],
    dims: dict[str, int],
    directory: Path,
    convert: bool,
) -> set[str]:
    """Compare the checkpoint's tensors with the model's; the keys whose stored shape differs only
    by packing (re-cut when converting). Anything else that differs is a CheckpointError naming the
    tensors."""
    saved = meta["tensors"]
    problems, recut = [], set()
    missing = sorted(set(views) - set(saved))
    if missing:
        problems.append(f"it has no {some(missing)}")
    unexpected = sorted(set(saved) - set(views))
    if unexpected:
        problems.append(f"this model and optimizer have no {some(unexpected)}")
    for key in sorted(set(views) & set(saved)):
        shape, dtype = (
            tuple(views[key].stored.shape),
            str(views[key].stored.dtype).removeprefix("torch."),
        )
        s_shape = tuple(saved[key]["shape"])
        if saved[key]["dtype"] != dtype:
            problems.append(f"{key} is {saved[key]['dtype']} in the checkpoint, {dtype} here")
        elif s_shape != shape:
            if convert and (
                model_shape(key, s_shape, meta["packed"], meta.get("packed_dims", {}))
                == model_shape(key, shape, parts, dims)
            ):
                recut.add(key)  # packed differently: same elements in the model's order
            else:
                problems.append(
                    f"{key} has shape {list(s_shape)} in the checkpoint, {list(shape)} here"
                )
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} does not fit this model: " + "; ".join(problems[:6])
        )
    return recut


def _recut(full: torch.Tensor, v: View) -> None:
    """Copy this rank's chunk of a whole stored tensor (another packing) into `v`'s local tensor."""
    full = full.reshape(v.stored.shape)
    if isinstance(v.stored, torch.distributed.tensor.DTensor) and v.stored.placements[0].is_shard():
        dim = v.stored.placements[0].dim
        start, length = chunk_range(
            full.shape[dim], v.stored.device_mesh.size(), v.stored.device_mesh.get_local_rank()
        )
        full = full.narrow(dim, start, length)
    v.local.copy_(full)


@torch.no_grad()
def load_checkpoint(
    directory,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    mesh: DeviceMesh,
    plan_text: str,
    convert: bool = False,
    stats: dict | None = None,
) -> dict:
    """Load into an already sharded model and optimizer at any tp/dp (DCP reshards); returns
    `extra`.

    Each rank gets back its own `extra` when tp and dp are those of the save, else rank 0's. A
    checkpoint from another plan is refused unless `convert`; a missing, incomplete, corrupt or
    scrambled one is a CheckpointError (exit 2). If `stats` is given it receives bytes and seconds.
    Every rank calls it.
    """
    t0 = time.perf_counter()
    directory = Path(directory)
    meta = _agree(lambda: read_meta(directory))
    plan = parse(plan_text)  # once per load
    check_plan_matches(meta, plan, directory, convert)
    if meta["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint {directory} holds {meta['optimizer']} state; this optimizer is "
            f"{type(optimizer).__name__}"
        )
    init_state(optimizer, model, meta["tensors"])
    views, objects = _views(model, optimizer, plan, mesh)
    recut = _match(
        meta,
        views,
        packed_parts(plan, model),
        packed_dims(plan, model),
        directory,
        convert,
    )
    state: dict[str, Any] = {k: v.stored for k, v in views.items() if k not in recut}
    for key in recut:  # read whole on every rank, then cut for this layout
        state[key] = torch.empty(meta["tensors"][key]["shape"], dtype=views[key].stored.dtype)
    tp, dp = _meshes(mesh)
    same = (meta["mesh"]["tp"], meta["mesh"]["dp"]) == (
        tp.size(),
        dp.size() if dp is not None else 1,
    )
    extra_key = f"extra/rank{dist.get_rank() if same else 0}"
    for key in [*objects, extra_key]:
        if key not in meta["objects"]:
            raise CheckpointError(
                f"checkpoint {directory} does not fit this optimizer: it has no {key}"
            )
        state[key] = torch.empty(meta["objects"][key], dtype=torch.uint8)
    reader = SafeReader(directory)  # refuses a hostile `.metadata` before DCP starts
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure of DCP is one CheckpointError
        raise_interrupt(err)
        raise CheckpointError(
            f"checkpoint {directory} is corrupt or unreadable: {_reason(err)}"
        ) from None
    for key in recut:
        _recut(state[key], views[key])
    for v in views.values():
        v.write_back()
    prints = _fingerprints(views)
    bad = sorted(k for k in views if prints[k] != meta["tensors"][k]["fingerprint"])
    if bad:
        raise CheckpointError(
            f"checkpoint {directory}: {some(bad)} do not match the fingerprints recorded at "
            "save (corrupt data, or tensors not in dtp's canonical layout, e.g. packed rows in "
            "a tp-dependent order); do not resume from it"
        )
    restore_optimizer(optimizer, {k: unpack(state[k], f"{directory}: {k}") for k in objects}, model)
    if stats is not None:
        stats.update(
            path=str(directory),
            bytes=sum(p.stat().st_size for p in directory.iterdir() if p.is_file()),
            seconds=time.perf_counter() - t0,
        )
    return unpack(state[extra_key], f"{directory}: {extra_key}")
