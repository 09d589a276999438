"""`dtp export CHECKPOINT`: a checkpoint's unsharded model state dict as a torch or safetensors
file, or a Hugging Face directory that `from_pretrained` loads. One process, no process group: DCP
reads every chunk into whole tensors (`no_dist`), each tensor's fingerprint is checked, packed parts
are flattened back into the model's own row order and tied weights get every name the model gives
them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dtp.checkpoint.dcp import raise_interrupt
from dtp.checkpoint.files import (
    CheckpointError,
    NoSpaceError,
    check_room,
    free_space,
    no_space,
    read_meta,
    some,
)
from dtp.checkpoint.fingerprint import fingerprint
from dtp.checkpoint.untrusted import SafeReader
from dtp.checkpoint.zoo_hf import to_hf_state
from dtp.errors import UsageError
from dtp.files import replace_atomically
from dtp.models import pretrained


def _dtype(name: object, key: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"checkpoint metadata gives {key} an unknown dtype {name!r}")
    return dtype


def read_model(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, the model's unsharded state dict) of a checkpoint, every tensor verified against
    its fingerprint."""
    directory = Path(directory)
    meta = read_meta(directory)
    tensors = {k: v for k, v in meta["tensors"].items() if k.startswith("model/")}
    wanted = sum(
        torch.Size(v["shape"]).numel() * _dtype(v["dtype"], k).itemsize for k, v in tensors.items()
    )
    on_disk = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    # DCP stores raw bytes: a larger claim is a corrupt dtp.json, not a reason to allocate
    if wanted > on_disk:
        raise CheckpointError(
            f"checkpoint {directory} is corrupt: its metadata describes {wanted} bytes of "
            f"model tensors, its files hold {on_disk}"
        )
    state = {k: torch.empty(v["shape"], dtype=_dtype(v["dtype"], k)) for k, v in tensors.items()}
    reader = SafeReader(directory)  # refuses a hostile `.metadata` before DCP starts
    try:
        # "assuming the intent is to load in a single process": it is
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
        raise_interrupt(err)  # SIGTERM or Ctrl-C mid-read: a stop (exit 143/130), not corruption
        reason = str(err).strip().splitlines()[-1][:400] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint {directory} is corrupt or unreadable: {reason}"
        ) from None
    bad = sorted(k for k, t in state.items() if fingerprint(t) != tensors[k]["fingerprint"])
    if bad:
        raise CheckpointError(
            f"checkpoint {directory}: {some(bad)} do not "
            "match the fingerprints recorded at save (corrupt data or a layout dtp did not write)"
        )
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        name = key.removeprefix("model/")
        packed, d = meta["packed"].get(name, 1) > 1, meta.get("packed_dims", {}).get(name, 0)
        if packed and (t.dim() < d + 2 or t.shape[d] != meta["packed"][name]):
            raise CheckpointError(
                f"checkpoint {directory}: {name} is recorded as {meta['packed'][name]} packed "
                f"parts but has shape {list(t.shape)}"
            )
        # (K, out/K, …) → (out, …); Conv1D (in, K, out/K) → (in, out)
        out[name] = t.flatten(d, d + 1) if packed else t
    for first, *others in meta["tied"]:
        for name in others:
            out[name] = out[first]
    return meta, out


def _write(state: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    """Write the weights file `path` (not atomic: a staging directory's, or a temporary file's)."""
    if fmt == "torch":
        # through a Python file: torch's own file writer reports a full disk without its errno
        with open(path, "wb") as f:
            torch.save(state, f)
        return
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UsageError(
            "--format safetensors needs the safetensors package: pip install safetensors"
        ) from None
    seen: set[int] = set()
    plain = {}
    # safetensors refuses shared storage: tied names get their own copy
    for name, t in state.items():
        plain[name] = t.clone() if t.untyped_storage().data_ptr() in seen else t.contiguous()
        seen.add(t.untyped_storage().data_ptr())
    save_file(plain, str(path), metadata={"format": "pt"})


def _nbytes(state: dict[str, torch.Tensor], fmt: str) -> int:
    """About what the weights file takes: torch.save writes each storage once, safetensors every
    name's tensor (tied ones copied)."""
    if fmt == "torch":
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()
        }
        return sum(storages.values())
    return sum(t.numel() * t.dtype.itemsize for t in state.values())


def _no_room(
    err: Exception, what: str, where: Path, needed: int, after: str
) -> NoSpaceError | None:
    """A NoSpaceError when `err` is a full disk (an OSError, or torch's and safetensors' own errors
    around one), with the free space counted now that the partial file is gone; else None."""
    reason = no_space(err)
    if reason is None:
        return None
    free, mount = free_space(where)
    return NoSpaceError(what, reason, after, needed, free, mount)


def _save(state: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    """`-o PATH`: the weights written beside `path`, then renamed over it; a full disk is a
    NoSpaceError that leaves `path` as it was."""
    what, after, needed = f"writing {path}", f"{path} is as it was", _nbytes(state, fmt)

    def write(tmp: Path) -> None:
        check_room(tmp.parent, needed, what, after)  # once `path` is known to be a file's place
        _write(state, tmp, fmt)

    try:
        replace_atomically(path, write)
    except NoSpaceError:
        raise
    except Exception as err:  # torch and safetensors raise their own errors for a full disk
        full = _no_room(err, what, path.parent, needed, after)
        if full is None:
            raise
        raise full from None


# what a Hugging Face directory's weights may be stored as: all of it is the old model once a new
# one is exported (transformers and dtp would prefer an old index over the new single file)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
SHARD = re.compile(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")


def _config_text(checkpoint: str, config: dict) -> str:
    """The checkpoint's saved config as config.json: refused if it asks for code of its own (a
    tampered dtp.json), without any choice of kernels (dtp.models.pretrained)."""
    for where, key, value in pretrained.entries(config):
        if key in pretrained.REMOTE and value:
            raise UsageError(
                f"{checkpoint}: its saved Hugging Face config sets {where}, which would make "
                "transformers run code named there; dtp does not export it"
            )
    return json.dumps(pretrained.chosen_here(config), indent=2, default=str) + "\n"


def _export_dir(target: Path, config_text: str, state: dict, fmt: str | None) -> Path:
    """Write config.json and the weights into `target` as one change: both are written in a staging
    directory beside it first (a full disk or a signal leaves `target` as it was), then the weights
    are moved in, every other weight file there (an old index and its shards) removed, and the
    config moved in last. Links in `target` are replaced, never written through (a Hugging Face
    cache's snapshot links to blobs other revisions share)."""
    if target.is_symlink() or (os.path.lexists(target) and not target.is_dir()):
        raise UsageError(f"--hf-dir {target} is not a directory")
    fmt = fmt or "safetensors"
    name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    what, after = f"writing --hf-dir {target}", f"{target} is as it was"
    needed = _nbytes(state, fmt) + len(config_text)
    check_room(target, needed, what, after)  # before anything is written
    try:
        target.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as err:
        full = _no_room(err, what, target, needed, after)
        raise full or UsageError(f"cannot create {target}: {err.strerror}") from None
    try:
        _write(state, staging / name, fmt)
        (staging / "config.json").write_text(config_text, encoding="utf-8")
        os.replace(staging / name, target / name)
        for old in os.listdir(target):
            if old != name and (old in WEIGHT_FILES or SHARD.match(old)):
                if os.path.isdir(target / old) and not os.path.islink(target / old):
                    raise UsageError(f"--hf-dir {target} holds a directory named {old}")
                os.unlink(target / old)
        os.replace(staging / "config.json", target / "config.json")
    except Exception as err:  # torch and safetensors raise their own errors for a full disk
        shutil.rmtree(staging, ignore_errors=True)  # first: the free space is counted without it
        full = _no_room(err, what, target, needed, after)
        if full is not None:
            raise full from None
        if isinstance(err, OSError):
            raise UsageError(f"cannot write {target}: {err.strerror or err}") from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def export(
    checkpoint: str, fmt: str | None, output: str | None, hf_dir: str | None
) -> tuple[Path, int]:
    """Write the checkpoint's unsharded state dict; (where, number of tensors)."""
    meta, state = read_model(checkpoint)
    if hf_dir is not None:
        config = meta.get("hf_config")
        if not isinstance(config, dict):
            raise UsageError(
                f"{checkpoint} holds a {meta.get('model_class')} model, not a Hugging Face one "
                "(no config was saved); --hf-dir needs one — use -o for a plain state dict"
            )
        state = to_hf_state(str(meta.get("model_class")), config, state)  # the zoo's GPT and Llama
        target = _export_dir(Path(hf_dir), _config_text(checkpoint, config), state, fmt)
        return target, len(state)
    fmt = fmt or "torch"
    suffix = "pt" if fmt == "torch" else "safetensors"
    path = Path(output) if output else Path(f"{str(checkpoint).rstrip('/')}.{suffix}")
    _save(state, path, fmt)
    return path, len(state)
