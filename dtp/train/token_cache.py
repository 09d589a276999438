"""The token cache under OUT/cache/, trusted by its content, never by its name.

Each `tokens-*.bin` has a record beside it (`.json`): the corpus's sha256, the tokenizer and its
version, the vocabulary, the number of tokens and the tokens' own sha256. A cache is reused only
when its record matches the corpus and tokenizer at hand, the file matches the record, and every id
is below the vocabulary; otherwise it is rebuilt from the corpus, with one warning. (A planted file
of ids outside the vocabulary once trained to "validation loss 0.0000", exit 0.)

Under torchrun every rank prepares the cache at once: the record is written before the tokens (each
atomically), so a reader that sees tokens also sees the record of a complete write.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dtp.files import replace_atomically

MAX_RECORD_BYTES = 4096  # a record is a few hundred bytes; anything larger is not one
MAX_TOKENIZER_BYTES = 64 * 2**20  # a BPE of 65,536 ids is a few MiB of JSON
_CHUNK = 2**24  # ids hashed and range-checked 16 Mi at a time: bounded memory on a 1 GiB cache


def warn(message: str) -> None:
    """One line on stderr: a cache that was not trusted."""
    print(f"warning: {message}", file=sys.stderr)


def regular_size(path: Path) -> int | None:
    """The size of `path` if it is a regular file (after links), else None (absent, FIFO, device,
    loop)."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def scan(path: Path, n: int, dtype, digest: bool = True) -> tuple[str, int]:
    """(sha256 or '', largest id) of the `n` ids in `path`, read in bounded chunks."""
    ids = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    sha, top = hashlib.sha256(), 0
    for i in range(0, n, _CHUNK):
        part = np.asarray(ids[i : i + _CHUNK])
        if digest:
            sha.update(part.tobytes())
        top = max(top, int(part.max()))
    return sha.hexdigest() if digest else "", top


def _record(path: Path) -> dict | None:
    size = regular_size(path)
    if size is None or size > MAX_RECORD_BYTES:
        return None
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def reuse(out: Path, expect: dict, dtype) -> int | None:
    """The number of tokens in `out` if its record matches `expect` (corpus, tokenizer, vocabulary)
    and its content the record; None when there is no cache; a warning and None when one is there
    but not trusted."""
    size = regular_size(out)
    if size is None and not os.path.lexists(out):
        return None
    record = _record(out.with_suffix(".json"))
    n = record.get("n_tokens") if record else None
    problem = None
    if size is None:
        problem = "is not a regular file"
    elif record is None:
        problem = "has no readable record of what it holds"
    elif any(record.get(k) != v for k, v in expect.items()):
        problem = "was made from another corpus, tokenizer or vocabulary"
    elif not isinstance(n, int) or n <= 0 or size != n * np.dtype(dtype).itemsize:
        problem = f"holds {size} bytes where its record says {n} tokens"
    else:
        digest, top = scan(out, n, dtype)
        if top >= expect["vocab"]:
            problem = f"holds token id {top}, outside the vocabulary of {expect['vocab']}"
        elif digest != record.get("tokens_sha256"):
            problem = "does not hold the tokens its record names (sha256 differs)"
    if problem:
        warn(f"the token cache {out} {problem}; rebuilt from the corpus")
        return None
    return n


def store(out: Path, expect: dict, ids: np.ndarray) -> None:
    """Write the record, then the tokens, each atomically (a planted link or FIFO is removed, not
    followed)."""
    for path in (out.with_suffix(".json"), out):
        if path.is_symlink() or (os.path.lexists(path) and regular_size(path) is None):
            path.unlink(missing_ok=True)
    record = {
        **expect,
        "n_tokens": len(ids),
        "tokens_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
    }
    text = json.dumps(record, indent=1) + "\n"
    replace_atomically(
        out.with_suffix(".json"), lambda tmp: Path(tmp).write_text(text, encoding="utf-8")
    )
    replace_atomically(out, ids.tofile)


def load_tokenizer(cache: Path, train: Callable[[], object]):
    """The BPE saved at `cache` if it loads, else `train()`'s (a truncated, oversized or foreign
    file: warned, retrained and saved again)."""
    from tokenizers import Tokenizer

    if not os.path.lexists(cache):
        return train()
    size = regular_size(cache)
    if size is not None and size <= MAX_TOKENIZER_BYTES:
        try:
            return Tokenizer.from_file(str(cache))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises plain Exception on bad JSON
            reason = " ".join(str(err).split())[:120]
    else:
        reason = (
            "not a regular file"
            if size is None
            else f"{size} bytes, over {MAX_TOKENIZER_BYTES >> 20} MiB"
        )
    warn(f"the BPE cache {cache} cannot be used ({reason}); trained again from the corpus")
    return train()


def tokenizer_id(tok) -> str:
    """Names a BPE by its content: a different merges file makes a different cache."""
    import tokenizers

    return (
        f"bpe tokenizers-{tokenizers.__version__} "
        + hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
    )
