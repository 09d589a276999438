"""The prompts of `dtp generate`: token ids, from text or given, bounded, and the padded batch.

Text is tokenised by the model directory's own `tokenizer.json` (the `tokenizers` library reads the
file as data; nothing in the directory runs), else as bytes when the vocabulary holds them (ids
0–255, as `dtp train` tokenises). Ids are given as `"1 2 3;4 5"`: prompts split by `;`, ids by
spaces or commas.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dtp.errors import UsageError, clip, shorten
from dtp.files import read_bounded

MAX_PROMPTS = 64
MAX_PROMPT_TOKENS = 4096
MAX_IDS_TEXT = 1 << 20  # characters of --prompt-ids
# a tokenizer.json: Gemma 3's is 33 MiB, Llama 3's 8.7 MiB; far beyond them is not a tokenizer
MAX_TOKENIZER_BYTES = 128 << 20


def parse_ids(text: str, vocab: int) -> list[list[int]]:
    """`"1 2 3;4 5"` → [[1, 2, 3], [4, 5]], every id in [0, vocab)."""
    if len(text) > MAX_IDS_TEXT:
        raise UsageError(f"--prompt-ids is {len(text)} characters, above {MAX_IDS_TEXT}")
    prompts = []
    for i, part in enumerate(text.split(";"), start=1):
        words = [w for w in re.split(r"[\s,]+", part.strip()) if w]
        if not words:
            raise UsageError(f"--prompt-ids: prompt {i} is empty")
        ids = []
        for w in words:
            if not re.fullmatch(r"\d{1,9}", w) or int(w) >= vocab:
                raise UsageError(
                    f"--prompt-ids: prompt {i} has {shorten(w)}; ids are integers from 0 to "
                    f"{vocab - 1} (the model's vocabulary)"
                )
            ids.append(int(w))
        prompts.append(ids)
    return bounded(prompts)


def bounded(prompts: list[list[int]]) -> list[list[int]]:
    """`prompts`, refused when too many or too long."""
    if len(prompts) > MAX_PROMPTS:
        raise UsageError(f"{len(prompts)} prompts: at most {MAX_PROMPTS} in one batch")
    for i, p in enumerate(prompts, start=1):
        if len(p) > MAX_PROMPT_TOKENS:
            raise UsageError(f"prompt {i} has {len(p)} tokens, above {MAX_PROMPT_TOKENS}")
    return prompts


class Tokens:
    """Text ↔ ids for one model: its directory's tokenizer.json, else bytes."""

    def __init__(self, directory: str | Path | None, vocab: int):
        self.vocab = vocab
        self.tokenizer = None
        file = Path(directory, "tokenizer.json") if directory is not None else None
        if file is not None and (file.is_symlink() or file.exists()):
            if file.is_symlink():  # never read through a link placed in a model directory
                raise UsageError(
                    f"{file} is a symbolic link; dtp reads a model's files only as files"
                )
            text = read_bounded(file, "tokenizer", MAX_TOKENIZER_BYTES)  # a regular file, bounded
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_str(text)
            except Exception as err:  # noqa: BLE001 - a malformed file is the user's: one line
                raise UsageError(
                    f"{file}: not a tokenizer this version can read ({clip(str(err), 200)})"
                ) from None
        elif vocab < 256:
            self.tokenizer = False

    @property
    def name(self) -> str:
        """How text is tokenised, in words."""
        return "tokenizer.json" if self.tokenizer else "bytes"

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids."""
        if self.tokenizer is False:
            raise UsageError(
                f"--prompt needs a tokenizer: the model has no tokenizer.json and its vocabulary "
                f"({self.vocab}) cannot hold bytes; give ids with --prompt-ids"
            )
        out = []
        for i, text in enumerate(texts, start=1):
            ids = self.tokenizer.encode(text).ids if self.tokenizer else list(text.encode())
            if not ids:
                raise UsageError(f"--prompt {i} is empty")
            out.append(ids)
        return bounded(out)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (bytes that are not UTF-8 shown as replacement characters)."""
        if self.tokenizer:
            return self.tokenizer.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) with every prompt right-aligned, as `generate` batches prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    return ids, mask
