"""Files written beside their final name, then renamed over it: a reader never sees half a file, and
processes writing the same file at once (torchrun ranks preparing one cache) each use a name of their own."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from dtp.errors import UsageError


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
