"""dtp/layout/trace.py: a forward runs on meta tensors first and on fakes only where it must, and
the residual stream of a deep model is one junction, not every module before it.

The runs are counted and the traces compared, never timed (timings belong in bench/)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dtp.layout.trace as trace_module
from dtp.layout.trace import trace


class Tiny(nn.Module):
    """embedding → a → b, with a bias the forward makes: on a named device, or on none."""

    def __init__(self, named_device: bool):
        super().__init__()
        self.named_device = named_device
        self.emb = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # the case under test: a tensor made on "cpu" whatever the model's device
        bias = torch.zeros(8, device="cpu") if self.named_device else torch.zeros(8)
        return self.b(self.a(self.emb(ids)) + bias)


@pytest.mark.parametrize(("named_device", "runs"), [(False, [True]), (True, [True, False])])
def test_a_forward_runs_on_meta_tensors_and_on_fakes_where_it_must(monkeypatch, named_device, runs):
    """A tensor made on a named device cannot meet a meta tensor: that forward runs again on fakes,
    and both ways give the same trace."""
    seen = []
    run = trace_module._run

    def counted(*args, meta, **kwargs):
        seen.append(meta)
        return run(*args, meta=meta, **kwargs)

    monkeypatch.setattr(trace_module, "_run", counted)
    tr = trace(Tiny(named_device))
    assert seen == runs
    assert tr.ok, tr.error
    assert tr.order == ["", "emb", "a", "b"]
    assert tr.edges == {"emb": {""}, "a": {"emb"}, "b": {"a"}}


class Residual(nn.Module):
    def __init__(self, n_blocks: int):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n_blocks))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_a_deep_residual_stream_is_a_junction_that_nearest_walks_through():
    """Block i's input sums the embedding and i blocks' outputs: the tags the trace holds grow with
    the blocks (×4 blocks, under ×5 tags; one tag set per block would be ×16), and `nearest` still
    finds every block behind the head and behind any block."""
    held = {}
    for n in (100, 400):
        tr = trace(Residual(n))
        assert tr.ok, tr.error
        assert any(trace_module.JUNCTION in node for node in tr.edges)
        held[n] = sum(len(e) for e in tr.edges.values())
        blocks = {f"blocks.{i}" for i in range(n)}
        hits, outside = tr.nearest(tr.edges["head"], blocks, "")
        assert hits == blocks and outside  # the embedding's input, the token ids, is outside
        hits, outside = tr.nearest(tr.edges["blocks.80"], blocks | {"emb"}, "")
        assert hits == {f"blocks.{i}" for i in range(80)} | {"emb"} and not outside
    assert held[400] < 5 * held[100]
