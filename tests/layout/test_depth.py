"""dtp/layout/depth.py: a container of many alike blocks is traced on its first blocks, and the
copies answer every question asked inside a block as the whole model's trace does; blocks that are
not alike are traced whole.

DEEP is lowered to 16 here (40 blocks stand for 20,000: the rule is the same at any depth)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtp.layout.depth as depth
from dtp.layout.trace import Traces, branch_flow

N_BLOCKS = 40


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head = 2
        self.wqkv = nn.Linear(8, 24, bias=False)
        self.wo = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            y.view(b, t, self.n_head, 4).transpose(1, 2) for y in self.wqkv(x).split(8, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, 8))


class Block(nn.Module):
    calls = 0  # forwards run, over every copy of the class

    def __init__(self, gated: bool = True):
        super().__init__()
        self.gated = gated
        self.norm = nn.LayerNorm(8)
        self.attn = Attention()
        self.up = nn.Linear(8, 16, bias=False)
        self.gate = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        x = x + self.attn(self.norm(x))
        h = F.silu(self.gate(x)) * self.up(x) if self.gated else self.up(x)
        return x + self.down(h)


class Deep(nn.Module):
    def __init__(self, ungated: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(Block(gated=i != ungated) for i in range(N_BLOCKS))
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture
def deep_at_16(monkeypatch):
    monkeypatch.setattr(depth, "DEEP", 16)


def _inside(tr, block: str) -> dict:
    """What the trace says inside `block`, its names relative to it: each entry's names from
    inside the block, and whether anything from outside reaches it."""

    def rel(name: str) -> str | None:
        return name[len(block) :] if name == block or name.startswith(block + ".") else None

    out = {}
    for kind, store in (("edges", tr.edges), ("inputs", tr.inputs), ("outputs", tr.outputs)):
        for key, values in store.items():
            if rel(key) is not None and "\0" not in key:
                names = _through_junctions(tr, values)
                inner = {rel(v) for v in names} - {None}
                out[kind, rel(key)] = (inner, len(inner) < len(names))
    for key, views in tr.views.items():
        if rel(key) is not None:
            out["views", rel(key)] = views
    out["order"] = [rel(p) for p in tr.order if rel(p) is not None]
    return out


def _through_junctions(tr, names: set[str]) -> set[str]:
    """`names` with each junction replaced by the modules it stands for (the whole model's trace
    makes junctions where the residual stream has summed many blocks; three blocks make none)."""
    out, stack, seen = set(), list(names), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if "\0" in name:
            stack += tr.edges[name]
        else:
            out.add(name)
    return out


def test_alike_blocks_are_traced_on_three_and_every_block_answers_as_traced_whole(deep_at_16):
    model = Deep()
    cut = depth.short(model)
    assert cut.dropped == {"layers": tuple(f"layers.{i}" for i in range(3, N_BLOCKS))}
    Block.calls = 0
    short = Traces().of(model)
    assert short.ok and Block.calls == depth.KEEP  # one run on meta tensors, three blocks
    depth.DEEP = 10**9
    whole = Traces().of(model)
    assert whole.ok and Block.calls == depth.KEEP + N_BLOCKS
    for i in range(N_BLOCKS):
        block = f"layers.{i}"
        assert _inside(short, block) == _inside(whole, block), block
        leaves = [f"{block}.{n}" for n in ("norm", "attn", "up", "gate", "down")]
        assert branch_flow(short, leaves) == branch_flow(whole, leaves)
        got = short.nearest(short.edges[f"{block}.down"], set(leaves), block)
        assert got == (frozenset({f"{block}.up", f"{block}.gate"}), False)


def test_one_block_unlike_the_others_has_the_model_traced_whole(deep_at_16):
    """Block 30 computes without its gate: the blocks are not alike, so none is left out."""
    model = Deep(ungated=30)
    assert depth.short(model) == depth.NONE
    Block.calls = 0
    tr = Traces().of(model)
    assert tr.ok and Block.calls == N_BLOCKS
    # the whole trace sees block 30's own flow
    assert tr.nearest(tr.edges["layers.30.down"], {"layers.30.up", "layers.30.gate"}, "layers.30")[
        0
    ] == frozenset({"layers.30.up"})


def test_a_forward_that_needs_every_block_is_traced_whole(deep_at_16):
    """A forward that indexes its blocks by a count of its own cannot run on three: the whole model
    is traced instead."""

    class Indexed(Deep):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for i in range(N_BLOCKS):
                x = self.layers[i](x)
            return self.head(x)

    Block.calls = 0
    tr = Traces().of(Indexed())
    # the short run raised after three blocks (on meta tensors, then on fakes)
    assert tr.ok and Block.calls == 2 * depth.KEEP + N_BLOCKS


class Titan(Block):
    """torchtitan's block: a layer id and an init scale per block, read only by weight init."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.down.weight, std=self.weight_init_std)


class Alternating(Block):
    """A block whose forward reads its index: every other one skips its gate."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        h = self.up(x) if self.layer_idx % 2 else F.silu(self.gate(x)) * self.up(x)
        return x + self.down(h)


class Delegating(Alternating):
    """The same, through super(): what the parent's forward reads is not read here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gated = self.layer_idx % 2 == 0
        return Block.forward(self, x) if self.gated else super().forward(x)


class Skipping(Deep):
    """The model reads each block's flag to decide whether to run it."""

    def __init__(self):
        super().__init__()
        for i, layer in enumerate(self.layers):
            layer.skip = i % 7 == 3

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x if layer.skip else layer(x)
        return self.head(x)


def _deep_of(make) -> Deep:
    model = Deep()
    model.layers = nn.ModuleList(make(i) for i in range(N_BLOCKS))
    return model


def test_what_no_forward_reads_is_no_difference_and_what_one_reads_is(deep_at_16):
    """torchtitan's per-block layer id and init scale are read by weight init only: the blocks are
    alike. An index the block's forward reads, or a flag the model's forward reads of each block,
    makes them differ; a forward that calls super() counts as reading anything."""
    assert depth.short(_deep_of(Titan)).dropped == {
        "layers": tuple(f"layers.{i}" for i in range(3, N_BLOCKS))
    }
    assert depth.short(_deep_of(Alternating)) == depth.NONE
    assert depth.short(_deep_of(Delegating)) == depth.NONE
    assert depth.short(Skipping()) == depth.NONE


def _gate_of(block: Block, x: torch.Tensor) -> torch.Tensor:
    return F.silu(block.gate(x)) * block.up(x) if block.layer_idx % 2 else block.up(x)


class Handing(Alternating):
    """The index is read by a function the forward hands `self` to (transformers' style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.down(_gate_of(self, x))


def test_a_forward_that_hands_itself_to_a_function_counts_as_reading_anything(deep_at_16):
    assert depth.short(_deep_of(Handing)) == depth.NONE
