"""A checkpoint directory on disk: written beside its final name, then renamed; read only when
complete.

Layout of DIR: DCP's files (`.metadata`, `__R_0.distcp`), `dtp.json` (plan, mesh, per-tensor shapes,
dtypes and fingerprints) and, written last, `COMPLETE` (every file's size, the hashes of the two
metadata files). A save writes `DIR.tmp-XXXX`, fsyncs every file, then renames it to DIR (a previous
DIR is moved aside first and removed after). A run killed at any point leaves DIR as it was, or
absent, or complete; a save that finds the disk full is a NoSpaceError that leaves DIR as it was. No
process group here: `dtp export` reads checkpoints offline.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

import torch

from dtp.cost.explain import human_bytes
from dtp.errors import UsageError
from dtp.files import load_json

FORMAT = "dtp-checkpoint"
VERSION = 1
# packed parts stored as (K, out/K, …) in the model's order (dtp.checkpoint.canonical)
LAYOUT = "canonical-1"
META = "dtp.json"
MARKER = "COMPLETE"
DCP_META = ".metadata"
MAX_META_BYTES = 64 << 20  # dtp.json holds the plan text and one entry per tensor
# a write that found no room, by errno, in a message's words
NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


class CheckpointError(UsageError):
    """A checkpoint that is missing, incomplete, corrupt, or written for another plan or model: exit
    2."""


class NoSpaceError(UsageError):
    """A write that found no room (a full disk or quota), in one line: what failed and why, about
    how many bytes it needed and how many were free on which file system, and what was left as it
    was. Exit 2 as a command's own error (`dtp export`); a rank's, it fails the run (exit 1)."""

    def __init__(
        self,
        what: str,
        reason: str,
        after: str,
        needed: int | None = None,
        free: int | None = None,
        mount: str | None = None,
    ):
        self.what, self.reason, self.after = what, reason, after
        self.needed, self.free, self.mount = needed, free, mount
        room = [f"needs about {human_bytes(needed)}"] if needed is not None else []
        if free is not None:
            room.append(f"{human_bytes(free)} free on {mount}")
        space = f" ({', '.join(room)})" if room else ""
        super().__init__(f"{what} failed: {reason}{space}; {after}")

    def __reduce__(self):
        # sent between ranks (a collective save agrees on it): rebuilt from its parts, not its text
        return type(self), (self.what, self.reason, self.after, self.needed, self.free, self.mount)

    def told(self, **changes) -> NoSpaceError:
        """The same failure with some parts replaced (a caller that knows the step, the space)."""
        parts = dict(
            what=self.what,
            reason=self.reason,
            after=self.after,
            needed=self.needed,
            free=self.free,
            mount=self.mount,
        )
        return NoSpaceError(**{**parts, **changes})


def no_space(err: BaseException) -> str | None:
    """Why `err` is a full disk or quota ("no space left on device"), else None. Its errno, or one
    in its chain (torch.save raises a RuntimeError whose context is the OSError), or the words of an
    error that keeps only the text (safetensors': "No space left on device (os error 28)")."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in NO_SPACE:
            return NO_SPACE[err.errno]
        for code, words in NO_SPACE.items():
            if os.strerror(code).lower() in str(err).lower():
                return words
        err = err.__cause__ or err.__context__
    return None


def free_space(path: Path) -> tuple[int | None, str]:
    """The bytes free to this process on the file system holding `path` (or its nearest existing
    ancestor: a save may create it), and that file system's mount point; None when it cannot be
    read."""
    here = Path(os.path.abspath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    mount = here
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        return shutil.disk_usage(here).free, str(mount)
    except OSError:
        return None, str(mount)


def check_room(path: Path, needed: int, what: str, after: str) -> None:
    """A NoSpaceError, before anything is written, when the file system of `path` has fewer than
    `needed` bytes free. (A write can still find the disk full: others write too.)"""
    free, mount = free_space(path)
    if free is not None and free < needed:
        raise NoSpaceError(what, NO_SPACE[errno.ENOSPC], after, needed, free, mount)


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
    """Make the temporary directory a save writes into; refuse to replace anything but a dtp
    checkpoint."""
    if directory.exists():
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint path {directory} exists and is not a directory")
        if (
            any(directory.iterdir())
            and not (directory / MARKER).exists()
            and not (directory / META).exists()
        ):
            raise CheckpointError(
                f"{directory} exists and is not a dtp checkpoint; refusing to replace it"
            )
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.parent / f"{directory.name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as err:
        reason = no_space(err)
        if reason:
            raise NoSpaceError(
                f"saving checkpoint {directory}", reason, f"{directory} is as it was"
            ) from None
        raise CheckpointError(
            f"cannot create checkpoint directory beside {directory}: {err.strerror}"
        ) from None
    return tmp


def seal(directory: Path) -> int:
    """Sync every file of a written checkpoint and write its completion marker, last; its total
    bytes."""
    files = {
        p.name: p.stat().st_size
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MARKER
    }
    for name in files:  # DCP's writer syncs its files; this also covers dtp.json
        with (directory / name).open("rb") as f:
            os.fsync(f.fileno())
    marker = {
        "format": FORMAT,
        "files": files,
        "sha256": {n: _sha256(directory / n) for n in (META, DCP_META)},
    }
    _write_synced(directory / MARKER, json.dumps(marker, indent=1, sort_keys=True) + "\n")
    _fsync_dir(directory)
    return sum(files.values()) + (directory / MARKER).stat().st_size


def finalize(tmp: Path, directory: Path, meta: dict) -> int:
    """Write dtp.json and the completion marker into `tmp`, sync, and rename it to `directory`; its
    bytes."""
    renamed = False
    try:
        _write_synced(tmp / META, json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
        nbytes = seal(tmp)
        old = None
        if directory.exists():
            old = directory.parent / f"{directory.name}.old-{tmp.name.rpartition('-')[2]}"
            os.rename(directory, old)
        os.rename(tmp, directory)
        renamed = True
        _fsync_dir(directory.parent)
    except OSError as err:
        reason = no_space(err)
        if reason and not renamed:  # dtp.json or the marker did not fit: DIR is untouched
            raise NoSpaceError(
                f"saving checkpoint {directory}", reason, f"{directory} is as it was"
            ) from None
        raise CheckpointError(
            f"cannot write checkpoint {directory}: {err.strerror or err}"
        ) from None
    for stale in _leftovers(directory):  # this save's old copy, and what killed saves left behind
        shutil.rmtree(stale, ignore_errors=True)
    return nbytes


def _missing(directory: Path) -> CheckpointError:
    left = _leftovers(directory)
    hint = ""
    if left:
        hint = (
            f"; an interrupted save left {', '.join(p.name for p in left)} beside it "
            f"(a .old-* directory is the previous complete checkpoint; .tmp-* ones are incomplete)"
        )
    return CheckpointError(f"no checkpoint at {directory}{hint}")


def read_json(path: Path, what: str) -> dict:
    """A JSON object from a regular file of at most MAX_META_BYTES (dtp.files' bounded loader: no
    FIFO, device or endless file, nesting bounded), or a CheckpointError naming the checkpoint."""
    try:
        data = load_json(path, what, MAX_META_BYTES, path.name)
    except UsageError as err:
        raise CheckpointError(
            f"checkpoint {path.parent} is corrupt: cannot read its {what} {path.name} ({err})"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"checkpoint {path.parent} is corrupt: its {what} {path.name} is not a JSON object"
        )
    return data


def _is_int(value: object, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < 1 << 62


def _check_schema(meta: dict, directory: Path, on_disk: int) -> None:
    """Every field of dtp.json that dtp reads has the type it writes; the tensors fit in the files."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {directory} is corrupt: its {META} has {what}")

    plan, mesh, tensors, objects = (meta.get(k) for k in ("plan", "mesh", "tensors", "objects"))
    if not (
        isinstance(plan, dict)
        and all(isinstance(plan.get(k), str) for k in ("sha256", "text"))
        and isinstance(plan.get("name"), (str, type(None)))
        and isinstance(plan.get("version"), (int, type(None)))
    ):
        raise bad("no valid plan (name, version, sha256, text)")
    if not (isinstance(mesh, dict) and all(_is_int(mesh.get(k), 1) for k in ("tp", "dp"))):
        raise bad("no valid mesh (tp, dp)")
    if not isinstance(tensors, dict) or not isinstance(objects, dict):
        raise bad("no table of tensors and objects")
    total = 0
    for key, info in tensors.items():
        info = info if isinstance(info, dict) else {}
        shape, name = info.get("shape"), info.get("dtype")
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(_is_int(n) for n in shape)
            or not isinstance(dtype, torch.dtype)
            or not isinstance(info.get("fingerprint"), str)
        ):
            raise bad(f"an invalid entry for tensor {key[:200]!r} (shape, dtype, fingerprint)")
        total += torch.Size(shape).numel() * dtype.itemsize
    if not all(re.fullmatch(r"model/[^/]+|optim/[^/]+/[^/]+", k) for k in tensors):
        raise bad(
            "a tensor named other than model/NAME or optim/NAME/STATE "
            f"({some(sorted(tensors))[:200]})"
        )
    for key, n in objects.items():
        if not re.fullmatch(
            r"optim/param_groups|optim/[^/]+/[^/]+|extra/rank\d{1,6}", key
        ) or not _is_int(n):
            raise bad(f"an invalid size for {key[:200]!r}")
        total += n
    # DCP stores raw bytes: a larger claim is a corrupt dtp.json, not a reason to allocate
    if total > on_disk:
        raise bad(f"tensors of {total} bytes, but its files hold {on_disk}")
    packed, tied = meta.get("packed"), meta.get("tied")
    if not (
        isinstance(packed, dict)
        and all(isinstance(k, str) and _is_int(v, 1) for k, v in packed.items())
    ):
        raise bad("no valid table of packed parts")
    dims = meta.get("packed_dims", {})
    if not (
        isinstance(dims, dict)
        and all(
            isinstance(k, str) and k in packed and _is_int(v) and 0 <= v < 8
            for k, v in dims.items()
        )
    ):
        raise bad("no valid table of packed dims")
    if not (
        isinstance(tied, list)
        and all(isinstance(g, list) and g and all(isinstance(n, str) for n in g) for g in tied)
    ):
        raise bad("no valid list of tied weights")
    if not isinstance(meta.get("optimizer"), str) or not isinstance(
        meta.get("hf_config"), (dict, type(None))
    ):
        raise bad("no valid optimizer name or Hugging Face config")


def _kind(directory: Path) -> str | None:
    """Why `directory` cannot be a checkpoint directory (a symlink loop, a file, a FIFO…), or None."""
    try:
        mode = directory.stat().st_mode
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symlink loop"
        if err.errno == errno.ENOENT:
            return "absent"
        return f"cannot be read ({err.strerror})"
    return (
        None
        if stat.S_ISDIR(mode)
        else "is not a directory (a checkpoint is a directory written by dtp)"
    )


def read_meta(directory: Path | str) -> dict:
    """dtp.json of a complete, intact checkpoint (sizes and metadata hashes checked); else
    CheckpointError."""
    directory = Path(directory)
    kind = _kind(directory)
    if kind == "absent":
        raise _missing(directory)
    if kind is not None:
        raise CheckpointError(f"checkpoint {directory} {kind}")
    if not (directory / MARKER).is_file():
        raise CheckpointError(
            f"{directory} is not a complete dtp checkpoint: it has no {MARKER} marker "
            "(the save that wrote it did not finish, or it is not a dtp checkpoint)"
        )
    marker = read_json(directory / MARKER, "completion marker")
    files, hashes = marker.get("files"), marker.get("sha256")
    if (
        marker.get("format") != FORMAT
        or not isinstance(files, dict)
        or not isinstance(hashes, dict)
    ):
        raise CheckpointError(
            f"checkpoint {directory} is corrupt: its {MARKER} marker is not dtp's"
        )
    for name, size in sorted(files.items()):
        path = directory / name
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not _is_int(size):
            raise CheckpointError(
                f"checkpoint {directory} is corrupt: its {MARKER} marker lists {str(name)[:80]!r}"
            )
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {directory} is corrupt: {name} has {path.stat().st_size} bytes, "
                f"the checkpoint recorded {size} (truncated or altered)"
            )
    if sorted(hashes) != sorted((META, DCP_META)) or not set(hashes) <= set(files):
        raise CheckpointError(
            f"checkpoint {directory} is corrupt: its {MARKER} marker does not cover "
            f"{META} and {DCP_META}"
        )
    for name, digest in sorted(hashes.items()):
        if _sha256(directory / name) != digest:
            raise CheckpointError(
                f"checkpoint {directory} is corrupt: {name} does not match its recorded hash"
            )
    meta = read_json(directory / META, "metadata")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(
            f"{directory}: not a version-{VERSION} dtp checkpoint "
            f"(format {meta.get('format')!r}, version {meta.get('version')!r})"
        )
    if meta.get("layout") != LAYOUT:
        raise CheckpointError(
            f"{directory}: tensors are stored in layout {meta.get('layout')!r}; this dtp reads "
            f"{LAYOUT!r} only (loading another layout would scramble packed rows)"
        )
    _check_schema(meta, directory, sum(files.values()))
    return meta


def some(names: list[str]) -> str:
    """The first few of `names` for a message."""
    return ", ".join(names[:4]) + (" …" if len(names) > 4 else "")


def plan_label(name: str | None, version: int | None, digest: str) -> str:
    """How an error names a plan: its name and version from the header, and its hash."""
    label = f"plan '{name}'" if name else "an unnamed plan"
    return f"{label}{f' version {version}' if version is not None else ''} (sha256 {digest[:12]})"
