"""The checkpoint fingerprint does not depend on sharding, and moved or changed elements change it."""

from __future__ import annotations

import torch

from dtp.checkpoint.canonical import chunk_range
from dtp.checkpoint.fingerprint import chunk_sums, fingerprint, finish


def _sharded(t: torch.Tensor, parts: int, dim: int) -> str:
    """The fingerprint summed over torch.chunk's chunks of `t` on `dim`, as ranks compute it."""
    sums = [0, 0]
    for r in range(parts):
        start, length = chunk_range(t.shape[dim], parts, r)
        offsets = tuple(start if d == dim else 0 for d in range(t.dim()))
        for i, s in enumerate(chunk_sums(t.narrow(dim, start, length), offsets, tuple(t.shape))):
            sums[i] += s
    return finish(sums)


def test_fingerprint_is_independent_of_sharding_and_sees_moves_and_flips():
    g = torch.Generator().manual_seed(0)
    for t in (
        torch.randn(257, 12, generator=g),
        torch.randn(3, 8, 5, generator=g, dtype=torch.float64),
        torch.randn(10, generator=g).to(torch.bfloat16),
    ):
        whole = fingerprint(t)
        for dim in range(t.dim()):
            for parts in (1, 2, 3, 4, 7):  # uneven chunks, and more chunks than rows of a small dim
                assert _sharded(t, parts, dim) == whole
        swapped = t.clone()
        swapped[[0, 1]] = t[[1, 0]]
        assert fingerprint(swapped) != whole
        flipped = t.clone()
        flipped.view(-1)[3] = -flipped.view(-1)[3]
        assert fingerprint(flipped) != whole
    # The packed view (K, out/K, in) and the model's (out, in) hold the same elements in the same
    # order.
    w = torch.randn(6, 4, generator=g)
    assert fingerprint(w.view(3, 2, 4)) == fingerprint(w)
