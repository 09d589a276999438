"""dtp's own files and the files it writes.

`shipped(name)` finds data that ships with dtp (the grammar, `plans/hf`, hardware profiles): inside the package
in an installed wheel (pyproject's force-include), at the checkout's top level in a source tree.

`writable_file` and `writable_dir` prove a path the user named can be written before any work starts.

`replace_atomically` writes beside the final name, then renames over it: a reader never sees half a file, and
processes writing the same file at once (torchrun ranks preparing one cache) each use a name of their own.
"""
from __future__ import annotations

import importlib.resources
import os
import secrets
from pathlib import Path

from dtp.errors import UsageError

_CHECKOUT = Path(__file__).resolve().parent.parent  # dtp/files.py → the checkout's root


def shipped(name: str) -> Path:
    """The shipped file or folder `name` (e.g. "grammar/tp.lark", "plans/hf", "profiles"): the wheel's copy
    inside the package where there is one, else the checkout's."""
    packaged = Path(str(importlib.resources.files("dtp") / name))
    for place in (packaged, _CHECKOUT / name):
        if place.exists():
            return place
    raise FileNotFoundError(f"dtp is installed without its {name}: neither {packaged} nor {_CHECKOUT / name} exists "
                            "(a wheel built without pyproject's force-include?)")


def replace_atomically(path: Path, write) -> None:
    """Write a file beside `path` with `write(tmp)`, then rename it over `path`; an OSError is a UsageError."""
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        tmp.unlink(missing_ok=True)


def writable_file(path: str, flag: str) -> str:
    """`path` made absolute, once it is known that a file can be written there (before any rank starts)."""
    target = Path(path).absolute()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file path")
    if not target.parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {target.parent} does not exist")
    existed = target.exists()
    try:  # try it: permissions, read-only mounts and /proc all answer the same way
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot write there ({err.strerror})") from None
    if not existed:
        target.unlink()
    return str(target)


def writable_dir(path: str) -> Path:
    """--save DIR, created if need be and proven writable before any example runs."""
    target = Path(path).absolute()
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".dtp-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--save {path}: cannot write there ({err.strerror})") from None
    return target
