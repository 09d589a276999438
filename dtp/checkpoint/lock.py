"""One writer per checkpoint: `DIR.lock` beside DIR names the process saving into it.

A save's rank 0 takes the lock around its write (`claim`/`release`), and a launcher can hold it for
a whole run (`held`), which also refuses a second run before any rank starts and, on the way out,
removes the `DIR.tmp-*` a save killed with its ranks left behind. The lock file is created whole
(written aside, then hard-linked into place), so a reader never sees it half-written; one whose
process is gone (same host) is stale and replaced. Only the lock holder removes `DIR.tmp-*`, so two
runs never delete each other's work in progress.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from dtp import files
from dtp.checkpoint.files import CheckpointError, check_room, prepare
from dtp.errors import UsageError

MAX_LOCK_BYTES = 1024  # {"pid": …, "host": …}


def lock_path(directory: Path) -> Path:
    """The lock file of checkpoint `directory`."""
    return directory.parent / f"{directory.name}.lock"


def _owner(lock: Path) -> dict | None:
    """The lock's {pid, host}, or None when it is unreadable (then it is not a live dtp lock)."""
    try:  # a regular file of at most 1 KB, opened without blocking (never /dev/zero or a FIFO)
        data = json.loads(files.read_bounded(lock, "checkpoint lock", MAX_LOCK_BYTES))
    except (UsageError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def _alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        # another machine's process (a shared file system): it cannot be checked from here
        return True
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return owner["pid"] > 0  # EPERM: the process exists, another user's
    return True


def _ours(owner: dict) -> bool:
    """Held by this process, or by the launcher that started it (a rank of a run that holds the
    lock)."""
    return owner.get("host") == socket.gethostname() and owner["pid"] in (os.getpid(), os.getppid())


def refuse_if_held(directory: Path) -> None:
    """A CheckpointError naming the live other process that holds DIR's lock (nothing when none
    does, or this process or its launcher does): before a run reads DIR, not only when it saves."""
    lock = lock_path(directory)
    owner = _owner(lock) if lock.exists() else None
    if owner is not None and not _ours(owner) and _alive(owner):
        raise CheckpointError(
            f"checkpoint {directory} is being saved by another run (pid {owner['pid']} on "
            f"{owner.get('host')}); two runs must not save into one checkpoint — wait for it, or "
            f"use another --checkpoint (if that process is not a dtp run, remove {lock})"
        )


def claim(directory: Path) -> bool:
    """Take DIR's lock for this process; False when this process or its launcher holds it already.
    A live other holder is a CheckpointError naming it; a stale lock is replaced."""
    lock = lock_path(directory)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        aside = lock.parent / f".{lock.name}.{secrets.token_hex(4)}"
        aside.write_text(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n", encoding="utf-8"
        )
    except OSError as err:
        raise CheckpointError(f"cannot create checkpoint lock {lock}: {err.strerror}") from None
    try:
        for _ in range(3):
            try:
                os.link(aside, lock)  # atomic, and fails if the lock exists
                return True
            except FileExistsError:
                pass
            owner = _owner(lock)
            if owner is not None and _ours(owner):
                return False
            refuse_if_held(directory)
            with contextlib.suppress(FileNotFoundError):  # stale: its process is gone
                lock.unlink()
        raise CheckpointError(
            f"cannot take checkpoint lock {lock}: another process keeps replacing it"
        )
    except OSError as err:
        raise CheckpointError(f"cannot create checkpoint lock {lock}: {err.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            aside.unlink()


def release(directory: Path) -> None:
    """Remove DIR's lock if this process holds it."""
    lock = lock_path(directory)
    owner = _owner(lock)
    if (
        owner is not None
        and owner["pid"] == os.getpid()
        and owner.get("host") == socket.gethostname()
    ):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def begin_save(directory: Path, needed: int) -> tuple[str, bool]:
    """Refuse a save of about `needed` bytes that the file system has no room for (a NoSpaceError,
    before anything is written: the previous checkpoint stays until the new one is complete, so the
    new one needs its whole size), take the lock (unless this run holds it already) and make the
    save's temporary directory: (its path, whether this call took the lock and must release it)."""
    check_room(directory, needed, f"saving checkpoint {directory}", f"{directory} is as it was")
    locked = claim(directory)
    try:
        return str(prepare(directory)), locked
    except BaseException:
        if locked:
            release(directory)
        raise


def remove_partial(directory: Path) -> None:
    """Remove the `DIR.tmp-*` of interrupted saves (call it holding the lock), and put back a
    previous checkpoint that a save killed between its two renames left as the only `DIR.old-*`."""
    parent = directory.parent
    if not parent.is_dir():
        return
    name = glob.escape(directory.name)  # a name is a name, not a pattern (`ck[ab]`)
    for tmp in parent.glob(f"{name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    old = sorted(parent.glob(f"{name}.old-*"), key=lambda p: p.stat().st_mtime)
    if old and not os.path.lexists(directory):
        with contextlib.suppress(OSError):
            os.rename(old[-1], directory)


@contextlib.contextmanager
def held(directory: str | Path | None) -> Iterator[None]:
    """Hold DIR's lock for a whole run (in the launcher, before ranks start); on the way out, also
    after Ctrl-C or SIGTERM, remove what a killed save left and release it. No-op when `directory`
    is None."""
    if directory is None:
        yield
        return
    directory = Path(directory)
    mine = claim(directory)
    try:
        yield
    finally:
        if mine:
            remove_partial(directory)
            release(directory)
