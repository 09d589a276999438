"""dtp.verify.dropout's rule on recorded sites, without ranks: replicated tensors need equal masks,
sharded ones different masks unless equal ones are likely by chance."""

from __future__ import annotations

import math

import pytest
import torch

from dtp.verify.dropout import CHANCE, DropoutProbe, Site, chance_equal, fingerprint, judge


def _site(masked: float, mask: float, chance: float = 0.0, gen: str | None = None) -> Site:
    return Site("blocks.0.attn (mul)", ((4,), masked), ((4,), mask), chance, gen)


def test_chance_that_two_draws_agree():
    mask = torch.tensor([0.0, 2.0, 2.0, 2.0])  # a quarter dropped, survivors scaled
    assert chance_equal(mask) == pytest.approx((0.25**2 + 0.75**2) ** 4)
    assert chance_equal(torch.ones(1000)) == 1.0  # nothing dropped: every draw agrees
    assert chance_equal(torch.rand(8)) == 0.0  # continuous noise never repeats


def test_fingerprints_tell_tensors_apart():
    x = torch.randn(3, 5)
    assert fingerprint(x) == fingerprint(x.clone())
    assert fingerprint(x) != fingerprint(x.flip(0)) and fingerprint(x) != fingerprint(x.flatten())


def test_the_rule():
    assert judge([[_site(1.0, 5.0)], [_site(1.0, 5.0)]]) == []  # replicated, alike
    assert judge([[_site(1.0, 5.0)], [_site(2.0, 6.0)]]) == []  # sharded, per rank
    (diverge,) = judge([[_site(1.0, 5.0)], [_site(1.0, 6.0)]])
    assert "every tp rank holds whole (replicated) with a different mask on each rank" in diverge
    (same,) = judge([[_site(1.0, 5.0, gen="attn.gen")], [_site(2.0, 5.0, gen="attn.gen")]])
    assert "with the same mask (drawn from attn.gen) on every rank" in same
    # equal masks on a small shard are likely by chance: not a fault
    assert (
        judge([[_site(1.0, 5.0, chance=10 * CHANCE)], [_site(2.0, 5.0, chance=10 * CHANCE)]]) == []
    )
    # the ranks took different paths: nothing to align
    assert judge([[_site(1.0, 5.0)], []]) == []


def test_a_model_without_dropout_or_generators_is_not_probed():
    assert DropoutProbe.over(torch.nn.Linear(2, 2)) is None
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    probe = DropoutProbe.over(model)
    x = torch.randn(8, 4)  # drawn outside: a draw inside would be a mask too
    with probe.recording():
        model(x)
    (site,) = probe.sites
    assert site.where == "1 (mul)" and 0 < site.chance < math.exp(-32 * math.log(2) * 0.5)
