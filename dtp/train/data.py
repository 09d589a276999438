"""Training data: a corpus on disk → tokens in a memory-mapped file → deterministic batches per dp
rank.

The default corpus is the Python standard library's own source (a sorted, size-bounded subset of its
top-level modules), present on every machine that runs dtp and needing no network. Tokenisation is
byte-level by default (256 ids, any model with vocab ≥ 256); `bpe` trains a byte-level BPE with the
`tokenizers` library to the model's vocabulary size, cached next to the tokens
(dtp.train.token_cache: trusted by content, not by name).

`--data` is read only if it is a regular file or a directory of them (a FIFO would block the open, a
device never ends), sized by stat before a byte is read and then read in bounded chunks, whatever
stat said.

Batches: step s draws the global batch's window starts from a generator seeded with (seed, s), so
the order is the same whatever tp and dp are; dp rank d reads rows [d·B/dp, (d+1)·B/dp); every tp
rank of a group reads the same rows.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dtp.errors import UsageError
from dtp.files import replace_atomically
from dtp.train import token_cache

DEFAULT_CORPUS_BYTES = 2 * 2**20  # the stdlib subset: the first sorted modules up to 2 MiB
MAX_TEXT_BYTES = 512 * 2**20  # a text corpus is read into memory once to tokenise it
VAL_FRACTION = 0.1
TOKEN_DTYPE = np.uint16  # ids < 65536; pre-tokenised .bin files are raw little-endian uint16
MAX_FILES = 100_000  # files in a --data directory
READ_CHUNK = 2**20
BYTES_VERSION = "bytes-1"  # the byte-level tokenizer's identity in the cache record
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def default_corpus() -> list[Path]:
    """The embedded corpus: the standard library's top-level modules, sorted by name, up to 2 MiB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        size = path.stat().st_size
        if total + size > DEFAULT_CORPUS_BYTES:
            break
        files.append(path)
        total += size
    return files


def _stat(path: Path, allow_dir: bool = False) -> os.stat_result:
    """stat (after links), refusing what is neither a regular file nor (`allow_dir`) a directory."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UsageError(f"--data {path}: no such file or directory") from None
    except (OSError, ValueError) as err:
        raise UsageError(f"--data {path}: {getattr(err, 'strerror', None) or err}") from None
    if stat.S_ISREG(st.st_mode) or (allow_dir and stat.S_ISDIR(st.st_mode)):
        return st
    kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
    raise UsageError(
        f"--data {path} is {kind}; give a text file, a directory of them or a .bin of uint16 token "
        "ids"
    )


def _too_big(name: str) -> UsageError:
    return UsageError(
        f"--data {name}: more than {MAX_TEXT_BYTES >> 20} MiB of text; tokenise it beforehand "
        "into a .bin file of uint16 token ids"
    )


def _text_files(data: str | None) -> tuple[list[Path], str]:
    """The files of a corpus and how to name it; their sizes (by stat, nothing read yet) within the
    limit."""
    if data is None:
        return (
            default_corpus(),
            f"Python {sysconfig.get_python_version()} standard library source (2 MiB)",
        )
    path = Path(data)
    if not stat.S_ISDIR(_stat(path, allow_dir=True).st_mode):
        files = [path]
    else:
        files = []
        # links to directories are not followed
        for root, dirs, names in os.walk(path, onerror=_walk_error):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += (Path(root, n) for n in names if not n.startswith("."))
            if len(files) > MAX_FILES:
                raise UsageError(f"--data {data}: more than {MAX_FILES} files")
        files.sort()
        if not files:
            raise UsageError(f"--data {data}: the directory holds no files")
    if sum(_stat(f).st_size for f in files) > MAX_TEXT_BYTES:
        raise _too_big(str(path))
    return files, str(path)


def _walk_error(err: OSError) -> None:
    raise UsageError(f"--data: cannot list {err.filename}: {err.strerror}")


def _read_file(path: Path, budget: int, name: str) -> bytes:
    """One regular file's bytes, read in chunks, at most `budget` of them (a file may grow, or lie
    in stat)."""
    try:
        # never blocks, even on a FIFO swapped in since stat
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise UsageError(f"--data: cannot read {path}: {err.strerror}") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"--data {path} is not a regular file")
        raw, decoder = bytearray(), codecs.getincrementaldecoder("utf-8")()
        try:
            while chunk := f.read(READ_CHUNK):
                if len(raw) + len(chunk) > budget:
                    raise _too_big(name)
                if not raw and b"\x00" in chunk[:65536]:
                    raise UsageError(
                        f"--data: {path} looks binary (it holds NUL bytes); give text files or a "
                        ".bin of uint16 token ids"
                    )
                decoder.decode(chunk)
                raw += chunk
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise UsageError(
                f"--data: {path} is not UTF-8 text (near byte {len(raw)}); give text files or a "
                ".bin of uint16 token ids"
            ) from None
        except OSError as err:
            raise UsageError(f"--data: cannot read {path}: {err.strerror}") from None
    return bytes(raw)


def read_text(files: list[Path], name: str) -> bytes:
    """The corpus as UTF-8 bytes; binary or non-UTF-8 files, empty corpora and huge ones are usage
    errors."""
    chunks, total = [], 0
    for path in files:
        raw = _read_file(path, MAX_TEXT_BYTES - total, name)
        total += len(raw) + 1
        chunks.append(raw)
    text = b"\n".join(chunks)
    if not text.strip():
        raise UsageError(f"--data {name}: the corpus is empty")
    return text


def _bpe(text: bytes, vocab: int, cache: Path):
    """A byte-level BPE trained on `text` to `vocab` ids, cached as JSON in `cache`."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UsageError(
            "--tokenizer bpe needs the `tokenizers` package (pip install tokenizers)"
        ) from None

    def trained():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        lines = text.decode("utf-8").splitlines(keepends=True)
        tok.train_from_iterator(
            (lines[i : i + 1000] for i in range(0, len(lines), 1000)), trainer=trainer
        )
        # our own cache folder: a planted link is removed, never written through
        if cache.is_symlink():
            cache.unlink(missing_ok=True)
        # under torchrun every rank prepares it
        replace_atomically(cache, lambda tmp: tok.save(str(tmp)))
        return tok

    return token_cache.load_tokenizer(cache, trained)


@dataclass(frozen=True)
class Corpus:
    """Tokens on disk: `path` holds uint16 ids, the first `n_train` for training, the rest for
    validation."""

    path: str
    name: str
    n_tokens: int
    n_train: int
    vocab: int  # ids are < vocab
    tokenizer: str  # "bytes", "bpe" or "pre-tokenised"

    def tokens(self) -> np.ndarray:
        """The memory-mapped token ids (read-only)."""
        return np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r", shape=(self.n_tokens,))


def prepare(
    data: str | None, cache_dir: Path, *, tokenizer: str = "bytes", model_vocab: int
) -> Corpus:
    """Tokenise the corpus once into `cache_dir` (reused when the same input was tokenised before)."""
    if data is not None and data.endswith(".bin"):
        path = Path(data)
        size = _stat(path).st_size  # a regular file: memory-mapped, never read whole
        if size == 0 or size % 2:
            raise UsageError(
                f"--data {data}: a .bin must hold uint16 token ids (an even, non-zero number of "
                "bytes)"
            )
        _, top = token_cache.scan(path, size // 2, TOKEN_DTYPE, digest=False)
        if top >= model_vocab:
            raise UsageError(
                f"--data {data}: token id {top} does not fit the model's vocabulary of "
                f"{model_vocab}"
            )
        return Corpus(
            str(path), str(path), size // 2, _train_len(size // 2), top + 1, "pre-tokenised"
        )
    files, name = _text_files(data)
    text = read_text(files, name)
    digest = hashlib.sha256(text).hexdigest()
    key = digest[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        if model_vocab <= 256:  # byte-level BPE starts from all 256 bytes; merges come on top
            raise UsageError(
                f"--tokenizer bpe needs a vocabulary above 256 (its byte alphabet plus merges); "
                f"the model has {model_vocab}"
            )
        tok = _bpe(text, model_vocab, cache_dir / f"bpe-{key}-{model_vocab}.json")
        vocab = tok.get_vocab_size()
        if vocab > model_vocab:
            raise UsageError(
                f"the BPE trained for a vocabulary of {model_vocab} has {vocab} ids; give a model "
                f"with a larger vocabulary"
            )
        name_id, encode = (
            token_cache.tokenizer_id(tok),
            lambda: tok.encode(text.decode("utf-8")).ids,
        )
    else:
        if model_vocab < 256:
            raise UsageError(
                f"byte-level tokens need a vocabulary of at least 256; the model has {model_vocab}"
            )
        vocab, name_id, encode = 256, BYTES_VERSION, lambda: np.frombuffer(text, dtype=np.uint8)
    out = cache_dir / (
        f"tokens-bpe-{key}-{vocab}.bin" if tokenizer == "bpe" else f"tokens-bytes-{key}.bin"
    )
    expect = {"corpus_sha256": digest, "tokenizer": name_id, "vocab": vocab}
    n = token_cache.reuse(out, expect, TOKEN_DTYPE)
    if n is None:
        ids = np.asarray(encode(), dtype=TOKEN_DTYPE)
        # the tokenizer's own ids: a foreign BPE file could exceed it
        if len(ids) and int(ids.max()) >= vocab:
            raise UsageError(
                f"the tokenizer produced id {int(ids.max())}, outside its vocabulary of {vocab}"
            )
        token_cache.store(out, expect, ids)
        n = len(ids)
    return Corpus(str(out), name, n, _train_len(n), vocab, tokenizer)


def _train_len(n: int) -> int:
    return n - max(1, int(n * VAL_FRACTION))


def check_fits(corpus: Corpus, batch: int, seq: int) -> None:
    """Enough tokens for one training batch of distinct windows and one validation sequence."""
    need = batch * (seq + 1)
    val = corpus.n_tokens - corpus.n_train
    if corpus.n_train < need or val < seq + 1:
        raise UsageError(
            f"--data {corpus.name}: {corpus.n_tokens} tokens are too few for --batch {batch} × "
            "--seq "
            f"{seq} (training needs {need} tokens and validation {seq + 1}, after a "
            f"{VAL_FRACTION:.0%} validation split); give more text or a smaller batch/sequence"
        )


def unigram_entropy(corpus: Corpus) -> float:
    """The validation split's unigram entropy in nats: the loss of a model that ignores context."""
    val = np.asarray(corpus.tokens()[corpus.n_train :], dtype=np.int64)
    p = np.bincount(val) / len(val)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def batch_starts(step: int, seed: int, batch: int, n_train: int, seq: int) -> np.ndarray:
    """Window starts of step `step`'s global batch (independent of tp and dp)."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_train - seq, size=batch)


def train_batch(
    corpus: Corpus,
    tokens: np.ndarray,
    step: int,
    seed: int,
    batch: int,
    seq: int,
    dp: int,
    dp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch/dp, seq), of this dp rank's slice of the global batch."""
    starts = batch_starts(step, seed, batch, corpus.n_train, seq)
    per = batch // dp
    mine = starts[dp_rank * per : (dp_rank + 1) * per]
    rows = torch.from_numpy(np.stack([tokens[s : s + seq + 1].astype(np.int64) for s in mine]))
    return rows[:, :-1], rows[:, 1:]


def val_batches(
    corpus: Corpus,
    tokens: np.ndarray,
    batch: int,
    seq: int,
    dp: int,
    dp_rank: int,
    max_batches: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive, non-overlapping validation windows, this dp rank's rows of each global batch."""
    windows = (corpus.n_tokens - corpus.n_train - 1) // seq
    n = max(1, min(max_batches, windows // batch))
    per = batch // dp
    out = []
    for b in range(n):
        rows = []
        for i in range(dp_rank * per, (dp_rank + 1) * per):
            w = (b * batch + i) % windows  # a short split wraps round rather than running out
            start = corpus.n_train + w * seq
            rows.append(tokens[start : start + seq + 1].astype(np.int64))
        t = torch.from_numpy(np.stack(rows))
        out.append((t[:, :-1], t[:, 1:]))
    return out
