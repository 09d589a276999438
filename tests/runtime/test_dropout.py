"""Dropout under tensor parallelism: identical masks where activations are replicated, different
masks where they are sharded, on features or on the sequence (Megatron's RNG tracker, regions that
follow the layouts); and dtp never changes the caller's generators. Parity runs keep dropout at 0:
masks are random."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dtp.lang.parse import load, parse
from dtp.models.gpt import GPT, GPTConfig
from dtp.runtime.ranks import on_ranks
from dtp.runtime.shard import apply

# gpt2.tp with the MLP's hidden activations gathered back to full width: replicated, so one shared
# mask
GATHERED_MLP = """dtp 1
transformer.h.* {
    attn.c_attn: colwise(packed=3)
    attn.c_proj: rowwise
    mlp.c_fc: colwise(output=replicate)
}
"""


def _masks(rank: int, world: int, plan: str, late: bool = False) -> dict:
    """Dropout masks seen by probes; `late`: the model is applied with every rate at 0, raised to
    0.5 after."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=1, n_head=4, n_embd=64, vocab_size=256, block_size=64, dropout=0.0 if late else 0.5
    )
    model = GPT(cfg)
    # a probe on c_fc's output, before GELU: column-sharded under gpt2.tp, gathered under
    # GATHERED_MLP
    mlp = model.transformer.h[0].mlp
    mlp.gelu = nn.Sequential(nn.Dropout(cfg.dropout), mlp.gelu)
    seen: dict[str, torch.Tensor] = {}
    for name, module in [
        ("c_fc", mlp.gelu[0]),
        ("mlp", mlp.dropout),
        ("embedding", model.transformer.drop),
        ("attn", model.transformer.h[0].attn.resid_dropout),
    ]:
        module.register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, (o == 0).clone()))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    before = torch.get_rng_state()
    apply(load(plan) if plan.endswith(".tp") else parse(plan), model, mesh, seed=0)
    untouched = torch.equal(before, torch.get_rng_state())
    hooks = _hook_count(model)
    if late:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.5
    model.train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids)
    model(ids)  # the second step too: both generators advance
    masks = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in seen.items()}
    return {"masks": masks, "untouched": untouched, "hooks": hooks}


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _fraction(mask: torch.Tensor) -> float:
    return mask.float().mean().item()


def test_replicated_masks_agree_sharded_masks_differ(repo):
    r0, r1 = (r["masks"] for r in on_ranks(_masks, 2, "plans/gpt2.tp"))
    for name in ("mlp", "attn", "embedding"):  # replicated activations
        assert torch.equal(r0[name], r1[name]), name
    # each rank's half of the 256 features
    assert r0["c_fc"].shape == r1["c_fc"].shape == (2, 16, 128)
    assert not torch.equal(r0["c_fc"], r1["c_fc"])
    for masks in (r0, r1):  # and they are real dropout masks at p=0.5
        assert 0.4 < _fraction(masks["c_fc"]) < 0.6


def test_colwise_with_replicated_output_uses_the_shared_stream(repo):
    # the region follows the layout, not the style name: a gathered colwise output is replicated
    results = on_ranks(_masks, 2, GATHERED_MLP)
    r0, r1 = (r["masks"] for r in results)
    assert r0["c_fc"].shape == (2, 16, 256)
    assert torch.equal(r0["c_fc"], r1["c_fc"])
    assert torch.equal(r0["mlp"], r1["mlp"])
    assert 0.4 < _fraction(r0["c_fc"]) < 0.6
    assert all(r["untouched"] for r in results)  # apply left every rank's generator as it was


def test_sequence_parallel_shards_draw_different_masks(repo):
    # under Megatron-SP the dropouts after the embedding and after each rowwise layer see sequence
    # shards: every rank must drop its own pattern (the same pattern on every shard would repeat
    # along the sequence)
    results = on_ranks(_masks, 2, "plans/gpt2-sp.tp")
    r0, r1 = (r["masks"] for r in results)
    for name in ("embedding", "attn", "mlp"):
        assert r0[name].shape == r1[name].shape == (2, 8, 64), name  # half of the 16 positions each
        assert not torch.equal(r0[name], r1[name]), name
        assert 0.4 < _fraction(r0[name]) < 0.6 and 0.4 < _fraction(r1[name]) < 0.6, name
    assert all(r["untouched"] for r in results)


def test_without_dropout_no_region_hooks_until_a_rate_is_raised(repo):
    # a model applied with every rate at 0 runs without the region hooks (each a generator swap and
    # a module off nn.Module's fast path): one pre-hook on the model waits for a positive rate, then
    # installs them
    late = on_ranks(_masks, 2, "plans/gpt2.tp", True)
    early = on_ranks(_masks, 2, "plans/gpt2.tp")
    r0, r1 = (r["masks"] for r in late)
    assert torch.equal(r0["mlp"], r1["mlp"]) and torch.equal(r0["embedding"], r1["embedding"])
    # raised after apply: still a mask of each rank's own
    assert not torch.equal(r0["c_fc"], r1["c_fc"])
    assert 0.4 < _fraction(r0["c_fc"]) < 0.6
    probes = 4  # the test's own forward hooks
    assert [r["hooks"] - probes for r in late] == [1, 1]
    # the model's two, one per claimed module (6)
    assert [r["hooks"] - probes for r in early] == [2 + 6, 2 + 6]


def test_no_dropout_module_no_hooks(repo):
    def count(rank: int, world: int) -> int:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        apply(parse("dtp 1\n0: colwise\n2: rowwise\n"), model, mesh, seed=0)
        return _hook_count(model)

    assert on_ranks(count, 2) == [0, 0]
