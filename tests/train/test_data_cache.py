"""The token cache of `dtp train` under processes that prepare it at the same moment (under torchrun
every rank runs the preflight): none fails, none reads half a file, all see the same tokens."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from dtp.train import data

RANKS, ROUNDS = 6, 4


def _prepare(corpus: str, cache: str, tokenizer: str, vocab: int, start, out) -> None:
    start.wait()
    try:
        prepared = data.prepare(corpus, data.Path(cache), tokenizer=tokenizer, model_vocab=vocab)
        out.put(np.fromfile(prepared.path, dtype=data.TOKEN_DTYPE).tolist())
    except Exception as err:  # noqa: BLE001 - the test reports it
        out.put(f"{type(err).__name__}: {err}")


@pytest.mark.parametrize("tokenizer,vocab", [("bytes", 256), ("bpe", 300)])
def test_ranks_preparing_one_cache_at_once_all_succeed_with_the_same_tokens(
    tmp_path, tokenizer, vocab
):
    pytest.importorskip("tokenizers") if tokenizer == "bpe" else None
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    ctx = mp.get_context("fork")
    for round_ in range(ROUNDS):
        start, out = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(
                target=_prepare,
                args=(str(corpus), str(tmp_path / f"cache{round_}"), tokenizer, vocab, start, out),
            )
            for _ in range(RANKS)
        ]
        for p in procs:
            p.start()
        start.set()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        errors = [r for r in results if isinstance(r, str)]
        assert errors == [], errors
        assert all(r == results[0] for r in results) and len(results[0]) > 1000
        # no temporary file left behind
        assert not list((tmp_path / f"cache{round_}").glob("*tmp*"))
