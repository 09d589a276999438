"""The token cache is trusted by its content: a planted file of ids outside the
vocabulary, tokens that are not the ones recorded, a cache with no record, a truncated or foreign
BPE file — each is rebuilt from the corpus with one warning, never trained on, never a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtp.train import data

TEXT = "the quick brown fox jumps over the lazy dog\n" * 400


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def _prepare(corpus: str, tmp_path, **kwargs) -> data.Corpus:
    return data.prepare(
        corpus, tmp_path / "cache", model_vocab=kwargs.pop("model_vocab", 256), **kwargs
    )


def test_the_cache_records_what_it_was_made_from(corpus, tmp_path, capsys):
    first = _prepare(corpus, tmp_path)
    record = json.loads(data.Path(first.path).with_suffix(".json").read_text())
    assert record["corpus_sha256"] == __import__("hashlib").sha256(TEXT.encode()).hexdigest()
    assert (record["tokenizer"], record["vocab"], record["n_tokens"]) == ("bytes-1", 256, len(TEXT))
    again = _prepare(corpus, tmp_path)  # reused silently
    assert again == first and capsys.readouterr().err == ""


def _poison(path: str, ids: np.ndarray) -> None:
    ids.astype(data.TOKEN_DTYPE).tofile(path)


@pytest.mark.parametrize(
    "poison,why",
    [
        (
            lambda p, n: _poison(p, np.full(n, 40000)),
            "holds token id 40000, outside the vocabulary of 256",
        ),
        (lambda p, n: _poison(p, np.zeros(n)), "does not hold the tokens its record names"),
        (lambda p, n: _poison(p, np.zeros(7)), "holds 14 bytes where its record says"),
        (lambda p, n: data.Path(p).with_suffix(".json").unlink(), "has no readable record"),
        (
            lambda p, n: data.Path(p).with_suffix(".json").write_text('{"corpus_sha256": [1]'),
            "has no readable record",
        ),
    ],
)
def test_a_poisoned_token_cache_is_rebuilt_with_a_warning(corpus, tmp_path, capsys, poison, why):
    first = _prepare(corpus, tmp_path)
    good = np.fromfile(first.path, dtype=data.TOKEN_DTYPE)
    poison(first.path, first.n_tokens)
    capsys.readouterr()
    again = _prepare(corpus, tmp_path)
    err = capsys.readouterr().err
    assert why in err and "rebuilt from the corpus" in err and err.count("\n") == 1, err
    assert again == first
    assert np.array_equal(np.fromfile(again.path, dtype=data.TOKEN_DTYPE), good)
    # trusted again once rebuilt
    assert _prepare(corpus, tmp_path) == first and capsys.readouterr().err == ""


def test_a_planted_link_in_the_cache_is_replaced_not_written_through(corpus, tmp_path, capsys):
    first = _prepare(corpus, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    data.Path(first.path).unlink()
    data.Path(first.path).symlink_to(victim)
    assert _prepare(corpus, tmp_path) == first
    assert victim.read_text() == "mine" and not data.Path(first.path).is_symlink()


@pytest.mark.parametrize(
    "content",
    ['{"version": "1.0", "model": {"type": "BPE", "voc', '{"model": 5}', "[]", "\x00\xff" * 10],
)
def test_a_malformed_bpe_cache_is_trained_again(corpus, tmp_path, capsys, content):
    pytest.importorskip("tokenizers")
    first = _prepare(corpus, tmp_path, tokenizer="bpe", model_vocab=300)
    (bpe,) = (tmp_path / "cache").glob("bpe-*.json")
    bpe.write_bytes(content.encode("utf-8", "surrogateescape"))
    capsys.readouterr()
    again = _prepare(corpus, tmp_path, tokenizer="bpe", model_vocab=300)
    err = capsys.readouterr().err
    assert (
        "the BPE cache" in err and "trained again from the corpus" in err and "Traceback" not in err
    ), err
    assert again == first
    assert (
        again.vocab <= 300
        and int(np.fromfile(again.path, dtype=data.TOKEN_DTYPE).max()) < again.vocab
    )
