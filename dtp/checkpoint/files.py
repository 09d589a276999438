"""A checkpoint directory on disk: written beside its final name, then renamed; read only when complete.

Layout of DIR: DCP's files (`.metadata`, `__R_0.distcp`), `dtp.json` (plan, mesh, per-tensor shapes,
dtypes and fingerprints) and, written last, `COMPLETE` (every file's size, the hashes of the two metadata
files). A save writes `DIR.tmp-XXXX`, fsyncs every file, then renames it to DIR (a previous DIR is moved
aside first and removed after). A run killed at any point leaves DIR as it was, or absent, or complete.
No process group here: `dtp export` reads checkpoints offline.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import secrets
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from dtp.errors import UsageError

FORMAT = "dtp-checkpoint"
VERSION = 1
LAYOUT = "canonical-1"  # packed parts stored as (K, out/K, …) in the model's order (dtp.checkpoint.canonical)
META = "dtp.json"
MARKER = "COMPLETE"
DCP_META = ".metadata"
MAX_META_BYTES = 64 << 20  # dtp.json holds the plan text and one entry per tensor


class CheckpointError(UsageError):
    """A checkpoint that is missing, incomplete, corrupt, or written for another plan or model: exit 2."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _leftovers(directory: Path) -> list[Path]:
    """Directories an interrupted save of `directory` may have left beside it."""
    parent = directory.parent
    if not parent.is_dir():
        return []
    prefixes = (f"{directory.name}.tmp-", f"{directory.name}.old-")
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes))


def prepare(directory: Path) -> Path:
    """Make the temporary directory a save writes into; refuse to replace anything but a dtp checkpoint."""
    if directory.exists():
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint path {directory} exists and is not a directory")
        if any(directory.iterdir()) and not (directory / MARKER).exists() and not (directory / META).exists():
            raise CheckpointError(f"{directory} exists and is not a dtp checkpoint; refusing to replace it")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.parent / f"{directory.name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as err:
        raise CheckpointError(f"cannot create checkpoint directory beside {directory}: {err.strerror}") from None
    return tmp


def seal(directory: Path) -> int:
    """Sync every file of a written checkpoint and write its completion marker, last; its total bytes."""
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != MARKER}
    for name in files:  # DCP's writer syncs its files; this also covers dtp.json
        with (directory / name).open("rb") as f:
            os.fsync(f.fileno())
    marker = {"format": FORMAT, "files": files, "sha256": {n: _sha256(directory / n) for n in (META, DCP_META)}}
    _write_synced(directory / MARKER, json.dumps(marker, indent=1, sort_keys=True) + "\n")
    _fsync_dir(directory)
    return sum(files.values()) + (directory / MARKER).stat().st_size


def finalize(tmp: Path, directory: Path, meta: dict) -> int:
    """Write dtp.json and the completion marker into `tmp`, sync, and rename it to `directory`; its bytes."""
    try:
        _write_synced(tmp / META, json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
        nbytes = seal(tmp)
        old = None
        if directory.exists():
            old = directory.parent / f"{directory.name}.old-{tmp.name.rpartition('-')[2]}"
            os.rename(directory, old)
        os.rename(tmp, directory)
        _fsync_dir(directory.parent)
    except OSError as err:
        raise CheckpointError(f"cannot write checkpoint {directory}: {err.strerror or err}") from None
    for stale in _leftovers(directory):  # this save's old copy, and what killed saves left behind
        shutil.rmtree(stale, ignore_errors=True)
    return nbytes


def _missing(directory: Path) -> CheckpointError:
    left = _leftovers(directory)
    hint = ""
    if left:
        hint = (f"; an interrupted save left {', '.join(p.name for p in left)} beside it "
                f"(a .old-* directory is the previous complete checkpoint; .tmp-* ones are incomplete)")
    return CheckpointError(f"no checkpoint at {directory}{hint}")


def _read_json(path: Path, what: str) -> dict:
    try:
        if path.stat().st_size > MAX_META_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_META_BYTES >> 20} MiB: not a dtp {what}")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path.parent} is corrupt: cannot read its {what} {path.name} "
                              f"({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {path.parent} is corrupt: its {what} {path.name} is not a JSON object")
    return data


def read_meta(directory: Path | str) -> dict:
    """dtp.json of a complete, intact checkpoint (sizes and metadata hashes checked); else CheckpointError."""
    directory = Path(directory)
    if not directory.exists():
        raise _missing(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint directory")
    if not (directory / MARKER).is_file():
        raise CheckpointError(f"{directory} is not a complete dtp checkpoint: it has no {MARKER} marker "
                              "(the save that wrote it did not finish, or it is not a dtp checkpoint)")
    marker = _read_json(directory / MARKER, "completion marker")
    files, hashes = marker.get("files"), marker.get("sha256")
    if marker.get("format") != FORMAT or not isinstance(files, dict) or not isinstance(hashes, dict):
        raise CheckpointError(f"checkpoint {directory} is corrupt: its {MARKER} marker is not dtp's")
    for name, size in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointError(f"checkpoint {directory} is corrupt: {name} has {path.stat().st_size} bytes, "
                                  f"the checkpoint recorded {size} (truncated or altered)")
    for name, digest in sorted(hashes.items()):
        if (directory / name).is_file() and _sha256(directory / name) != digest:
            raise CheckpointError(f"checkpoint {directory} is corrupt: {name} does not match its recorded hash")
    meta = _read_json(directory / META, "metadata")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{directory}: not a version-{VERSION} dtp checkpoint "
                              f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    if meta.get("layout") != LAYOUT:
        raise CheckpointError(f"{directory}: tensors are stored in layout {meta.get('layout')!r}; this dtp reads "
                              f"{LAYOUT!r} only (loading another layout would scramble packed rows)")
    return meta


def some(names: list[str]) -> str:
    """The first few of `names` for a message."""
    return ", ".join(names[:4]) + (" …" if len(names) > 4 else "")


def plan_label(name: str | None, version: int | None, digest: str) -> str:
    """How an error names a plan: its name and version from the header, and its hash."""
    label = f"plan '{name}'" if name else "an unnamed plan"
    return f"{label}{f' version {version}' if version is not None else ''} (sha256 {digest[:12]})"


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its `.metadata`; this unpickler accepts only the classes such a file holds, so that
    loading a checkpoint never runs code named by it."""

    def find_class(self, module: str, name: str):
        attr = getattr(torch, name, None) if module == "torch" else None
        if (module == "torch.distributed.checkpoint.metadata"
                or (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                      ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                                      ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("torch", "Size")}
                or isinstance(attr, (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise CheckpointError(f"{DCP_META} refers to {module}.{name}, which DCP metadata never does; "
                              "refusing to unpickle it")


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, reading `.metadata` with an unpickler restricted to DCP's own classes."""

    def read_metadata(self, *args, **kwargs):
        """The checkpoint's DCP metadata (the top-level `.metadata` only)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(Path(self.path) / DCP_META, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata
