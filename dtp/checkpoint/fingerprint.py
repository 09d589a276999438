"""A content hash of a tensor that does not depend on how it is sharded.

Each element's bit pattern is weighted by a pseudo-random function of its position in the full
tensor and the products are summed modulo the prime 2^31 - 1. Integer addition is associative, so
every rank hashes its own chunk (knowing the chunk's offset), the partial sums add up in any order,
and the result equals the hash of the gathered tensor bit for bit — at tp 4, at tp 2 and offline
alike. Two weightings give 62 bits. A moved, flipped or missing element changes the hash (barring a
2^-62 fluke).
"""

from __future__ import annotations

import torch

P = 2**31 - 1  # a prime: products of two residues fit in int64
# (a, b) of the two position weightings
_MIX = ((1_103_515_245, 12_345), (1_664_525, 1_013_904_223))
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _positions(
    shape: tuple[int, ...], offsets: tuple[int, ...], global_shape: tuple[int, ...]
) -> torch.Tensor:
    """Flat indices in the full tensor of the chunk of `shape` at `offsets`, without materialising
    the full tensor."""
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    index = torch.zeros((), dtype=torch.int64)
    for d, (size, off, stride) in enumerate(zip(shape, offsets, strides)):
        view = [1] * len(shape)
        view[d] = size
        index = index + ((torch.arange(size, dtype=torch.int64) + off) * stride).view(view)
    return index.expand(shape)


def chunk_sums(
    local: torch.Tensor, offsets: tuple[int, ...], global_shape: tuple[int, ...]
) -> list[int]:
    """The two partial sums (each < P) of one chunk; add them over all chunks, modulo P, to get
    `finish`'s input."""
    local = local.detach().contiguous().cpu()
    if local.numel() == 0:
        return [0, 0]
    bits = local.view(_INT[local.element_size()]).to(torch.int64).remainder(P).flatten()
    pos = _positions(tuple(local.shape), offsets, global_shape).flatten().remainder(P)
    sums = []
    for a, b in _MIX:
        weight = (pos * a + b).remainder(P)
        # non-linear in the position: no structured permutation cancels
        weight = (weight * weight).remainder(P)
        sums.append(int((bits * weight).remainder(P).sum().remainder(P)))
    return sums


def finish(sums: list[int]) -> str:
    """The hash as 16 hex digits, from the two sums added over all chunks."""
    hi, lo = (s % P for s in sums)
    return f"{hi:08x}{lo:08x}"


def fingerprint(full: torch.Tensor) -> str:
    """The hash of a whole (unsharded) tensor."""
    return finish(chunk_sums(full, (0,) * full.dim(), tuple(full.shape)))
