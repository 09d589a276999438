"""dtp's own files, the files it writes, and the data files it reads.

`shipped(name)` finds data that ships with dtp (the grammar, `plans/hf`, hardware profiles): inside
the package in an installed wheel (pyproject's force-include), at the checkout's top level in a
source tree.

`writable_file` and `writable_dir` prove a path the user named can be written before any work
starts; `replace_atomically` writes beside the final name, then renames over it: a reader never sees
half a file, and processes writing the same file at once (torchrun ranks preparing one cache) each
use a name of their own. Every output refuses what is not a regular file or directory (a device, a
FIFO, /proc): renaming over `/dev/null` as root would replace the device node.

`read_bounded`, `load_yaml` and `load_json` read what a user hands in (model configs, hardware
profiles, fuzz cases): regular files only, the size checked before reading, YAML without aliases,
nesting at most `MAX_DEPTH` deep, every message one short paragraph.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Callable

import yaml

from dtp.errors import UsageError, clip

_CHECKOUT = Path(__file__).resolve().parent.parent  # dtp/files.py → the checkout's root
_PSEUDO = (Path("/proc"), Path("/sys"))  # the kernel's files: writing there is never an output
MAX_DEPTH = 32  # nesting of user YAML/JSON: every real file is < 6 deep; deeper is a recursion bomb


def shipped(name: str) -> Path:
    """The shipped file or folder `name` (e.g. "grammar/tp.lark", "plans/hf", "profiles"): the
    wheel's copy inside the package where there is one, else the checkout's."""
    packaged = Path(str(importlib.resources.files("dtp") / name))
    for place in (packaged, _CHECKOUT / name):
        if place.exists():
            return place
    raise FileNotFoundError(
        f"dtp is installed without its {name}: neither {packaged} nor {_CHECKOUT / name} exists "
        "(a wheel built without pyproject's force-include?)"
    )


# ---- outputs ----------------------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_output(
    path: str | Path, flag: str, directory: bool = False, kernel: bool = False
) -> Path:
    """`path` resolved (symlinks followed), once it is known to be a place for a regular file (or,
    with `directory`, a directory): nothing under /proc or /sys (unless `kernel`: the caller tries a
    write there), no device, FIFO or socket; else UsageError."""
    shown = clip(str(path), 200)
    try:
        target = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
        raise UsageError(f"{flag} {shown}: not a usable path ({clip(str(err), 120)})") from None
    if not kernel and any(target == p or p in target.parents for p in _PSEUDO):
        raise UsageError(
            f"{flag} {shown}: cannot write there (/{target.parts[1]} holds the kernel's files; give "
            ""
            "a path in a normal directory)"
        )
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        return target
    except NotADirectoryError:  # a file where a folder of the path should be
        if not directory:
            # nothing there to clobber; the write (or writable_file) says its folder is missing
            return target
        blocking = next(p for p in reversed(target.parents) if p.exists() and not p.is_dir())
        raise UsageError(
            f"{flag} {shown}: {blocking} is a file, so no directory can be made there"
        ) from None
    except OSError as err:
        raise UsageError(f"{flag} {shown}: cannot use it ({err.strerror})") from None
    if directory and not stat.S_ISDIR(mode):
        what = "a file" if stat.S_ISREG(mode) else _kind(mode)
        raise UsageError(f"{flag} {shown} exists and is {what}, not a directory; give a directory")
    if not directory and not stat.S_ISREG(mode):
        what = (
            "a directory; give a file path"
            if stat.S_ISDIR(mode)
            else f"{_kind(mode)}; dtp writes only regular files"
        )
        raise UsageError(f"{flag} {shown} is {what}")
    return target


def replace_atomically(path: Path, write: Callable[[Path], object], flag: str = "output") -> None:
    """Write a file beside `path` with `write(tmp)`, then rename it over `path` (over the file a
    symlink names); a target that is not a regular file, or an OSError, is a UsageError."""
    path = check_output(path, flag)
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str, flag: str = "output") -> None:
    """Write `text` to the file `path` (atomically, regular files only)."""
    replace_atomically(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"), flag)


def writable_file(path: str, flag: str) -> str:
    """`path` made absolute, once it is known that a regular file can be written there (before any
    rank starts)."""
    target = check_output(path, flag)
    if not target.parent.is_dir():
        raise UsageError(f"{flag} {clip(path, 200)}: directory {target.parent} does not exist")
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        raise UsageError(f"{flag} {clip(path, 200)}: cannot write there (permission denied)")
    return str(target)


def writable_dir(path: str, flag: str = "--save", create: bool = True) -> Path:
    """A directory output (--save, --out, --checkpoint) proven usable before any work starts:
    created and probed with `create`, else only checked (its nearest existing ancestor must be a
    writable directory)."""
    # creating it tries /proc for real
    target = check_output(path, flag, directory=True, kernel=create)
    if not create:
        ancestor = next(p for p in (target, *target.parents) if p.exists())
        if not ancestor.is_dir():
            raise UsageError(
                f"{flag} {clip(path, 200)}: {ancestor} is a file, so no directory can be made there"
            )
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise UsageError(
                f"{flag} {clip(path, 200)}: cannot write in {ancestor} (permission denied)"
            )
        return target
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".dtp-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"{flag} {clip(path, 200)}: cannot write there ({err.strerror})") from None
    return target


# ---- inputs -----------------------------------------------------------------------------------------------


def read_bounded(path: str | Path, kind: str, max_bytes: int, name: str | None = None) -> str:
    """The UTF-8 text of the regular file `path`, refused (UsageError) before reading when it is
    larger than `max_bytes`; O_NONBLOCK so that a FIFO swapped in after the check cannot hang the
    open."""
    name = clip(str(path) if name is None else name, 200)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise UsageError(f"cannot read {kind} {name}: {err.strerror or err}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # before fdopen, which refuses a directory with a traceback
        os.close(fd)
        raise UsageError(f"{kind} {name} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > max_bytes:
            raise UsageError(
                f"{kind} {name} is {info.st_size} bytes; a {kind} is at most {max_bytes // 1024} "
                "KiB"
            )
        try:
            data = f.read(max_bytes + 1)  # a file growing while read is still cut at the cap
            if len(data) > max_bytes:
                raise UsageError(
                    f"{kind} {name} is over {max_bytes} bytes; a {kind} is at most "
                    f"{max_bytes // 1024} KiB"
                )
            return data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"cannot read {kind} {name}: {clip(str(err), 200)}") from None


class _TooDeep(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader without aliases (a 441-byte 'billion laughs' file must not expand to gigabytes)
    and with nodes at most MAX_DEPTH deep (the composer recurses: deeper would be a RecursionError)."""

    kind = "YAML file"
    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                f"aliases (*name) are not allowed in a {self.kind}",
                self.peek_event().start_mark,
            )
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _TooDeep()
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def parse_yaml(text: str, kind: str, name: str) -> object:
    """YAML text as plain data (no aliases, no tags beyond safe_load's, at most MAX_DEPTH deep);
    UsageError."""
    loader = _BoundedLoader(text)
    loader.kind = kind
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise UsageError(
            f"{kind} {clip(name, 200)} is not valid YAML: {clip(' '.join(str(err).split()), 300)}"
        ) from None
    except (_TooDeep, RecursionError):
        raise UsageError(f"{kind} {clip(name, 200)} nests too deeply to be a {kind}") from None
    except ValueError as err:  # an integer of more than 4,300 digits
        raise UsageError(
            f"{kind} {clip(name, 200)} is not valid YAML: {clip(str(err), 200)}"
        ) from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path, kind: str, max_bytes: int, name: str | None = None) -> object:
    """The YAML file `path` as plain data: `read_bounded`, then `parse_yaml`."""
    return parse_yaml(
        read_bounded(path, kind, max_bytes, name), kind, str(path) if name is None else name
    )


def _depth(data: object) -> int:
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse_json(text: str, kind: str, name: str) -> object:
    """JSON text as plain data, at most MAX_DEPTH deep; UsageError."""
    try:
        data = json.loads(text)
    except RecursionError:
        data = None
        deep = True
    except ValueError as err:  # JSONDecodeError, and an integer of more than 4,300 digits
        raise UsageError(
            f"{kind} {clip(name, 200)} is not valid JSON: {clip(str(err), 300)}"
        ) from None
    else:
        deep = _depth(data) > MAX_DEPTH
    if deep:
        raise UsageError(f"{kind} {clip(name, 200)} nests too deeply to be a {kind}")
    return data


def load_json(path: str | Path, kind: str, max_bytes: int, name: str | None = None) -> object:
    """The JSON file `path` as plain data: `read_bounded`, then `parse_json`."""
    return parse_json(
        read_bounded(path, kind, max_bytes, name), kind, str(path) if name is None else name
    )
