"""`dtp generate` on model code written as gpt-fast writes it (tests/fixtures/field_models.py:
`setup_caches` gives every attention a KVCache module, `forward(idx, input_pos)` writes it at
`input_pos`): at tp 2 each rank's caches hold its own key/value heads, the tokens are a plain greedy
loop's over the unsharded model, prompts of different lengths decode as their own batches, and a model
wrong only in its cache path fails at the step it goes wrong."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import field_models

from dtp.cli import main
from dtp.models.calling import Forward
from dtp.models.decoding import Decoder, cache_reason, cache_tensors

MODEL = "tests.fixtures.field_models"
# gpt-fast's tp.py as a plan (tests/fixtures/field/gptfast.tp), and the rewrite tp.py makes before
# setup_caches: the config's key/value head count, which setup_caches sizes the caches by
PLAN = """dtp 1
plan gptfast-decode version 1

set config.n_local_heads = n_local_heads / tp

layers.* {
    attention.wqkv: colwise(packed=[q, kv, kv])
    attention.wo: rowwise
    set attention.n_head = config.n_head / tp
    set attention.n_local_heads = config.n_local_heads / tp
    set attention.dim = config.dim / tp
    feed_forward.w1: colwise
    feed_forward.w3: colwise
    feed_forward.w2: rowwise
}
"""
RAGGED = "5 6 7;8 9 10 11 12 13"  # two lengths: two batches of one
EVEN = "5 6 7;8 9 10"  # one length: one batch of two


def _prompts(text: str) -> list[list[int]]:
    return [[int(i) for i in p.split()] for p in text.split(";")]


def _plain_greedy(prompt: list[int], new: int, factory=field_models.gptfast) -> list[int]:
    """Greedy tokens of the unsharded float64 model (as dtp builds it: seed 0, then cast), written
    the way gpt-fast's generate.py decodes: setup_caches, prefill at 0 … T-1, one token per step."""
    torch.manual_seed(0)
    model = factory().to(torch.float64).eval()
    model.setup_caches(1, len(prompt) + new)
    out: list[int] = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), input_pos=torch.arange(len(prompt)))
        for t in range(len(prompt), len(prompt) + new):
            out.append(int(logits[0, -1].argmax()))
            if len(out) < new:
                logits = model(torch.tensor([[out[-1]]]), input_pos=torch.tensor([t]))
    return out


def _generate(tmp_path, factory: str, prompts: str, new: int, *extra: str) -> tuple[int, dict]:
    plan = tmp_path / "gptfast.tp"
    plan.write_text(PLAN)
    report = tmp_path / "report.json"
    argv = ["generate", str(plan), f"{MODEL}:{factory}", "--tp", "2", "--prompt-ids", prompts]
    code = main([*argv, "--max-new-tokens", str(new), "--json", str(report), *extra])
    return code, json.loads(report.read_text()) if report.exists() else {}


def test_the_protocol_is_recognised_and_ragged_prompts_decode_as_their_own_batches():
    """In process, unsharded: groups of one length, each with its own caches, give each prompt the
    tokens it gets alone; the cache's bytes are every group's buffers."""
    torch.manual_seed(0)
    model = field_models.gptfast().to(torch.float64).eval()
    decoder = Decoder.of(model, Forward(positions="input_pos"), new_tokens=5)
    assert (decoder.slots, decoder.with_cache, decoder.cached) == (
        "input_pos",
        "setup_caches",
        None,
    )
    assert cache_reason(model) is None
    prompts = _prompts(RAGGED)
    ids = torch.tensor([[0] * 3 + prompts[0], prompts[1]])  # left-padded, as dtp generate pads
    mask = torch.tensor([[0] * 3 + [1] * 3, [1] * 6])
    rows: list[list[int]] = [[], []]
    with torch.no_grad():
        logits, state = decoder.prefill(model, ids, mask)
        for step in range(5):
            token = logits.argmax(-1)
            for r in (0, 1):
                rows[r].append(int(token[r]))
            if step < 4:
                logits = decoder.step(model, state, token)
    assert rows == [_plain_greedy(p, 5) for p in prompts]
    # 2 groups × 2 layers × (keys, values) × (1 row, 2 heads, 16 positions (6 + 5 → 16), 16) × 8 B
    assert sum(t.numel() * t.element_size() for t in cache_tensors(state.cache)) == 32768


@pytest.mark.parametrize(("prompts", "reduces"), [(RAGGED, 8), (EVEN, 4)])
def test_tp2_decodes_token_exact_with_each_rank_holding_its_heads(repo, tmp_path, prompts, reduces):
    code, report = _generate(tmp_path, "gptfast", prompts, 8, "--dtype", "float64")
    assert code == 0 and report["ok"] and report["decoded_with_cache"] == "setup_caches"
    assert report["tokens"] == [_plain_greedy(p, 8) for p in _prompts(prompts)]
    per_rank, whole = report["kv_cache_bytes_per_rank"], report["kv_cache_bytes_unsharded"]
    assert len(per_rank) == 2 and max(per_rank) <= 0.55 * whole and max(per_rank) == whole // 2
    # Megatron's 2 all-reduces per layer, once per batch of one length
    assert report["collectives_per_token"] == {"all_reduce": reduces}


def test_a_model_wrong_only_in_its_cache_path_fails_at_its_first_decode_step(
    repo, tmp_path, capsys
):
    wrong = field_models.gptfast_cache_wrong
    assert _plain_greedy([5, 6, 7], 4, wrong) == _plain_greedy([5, 6, 7], 4)  # right unsharded
    code, report = _generate(tmp_path, "gptfast_cache_wrong", RAGGED, 4)
    assert code == 1 and not report["ok"]
    assert report["first_failing_step"] == 2  # the prefill is step 1 and right
    out = capsys.readouterr().out
    assert "token-exact: FAILED — at step 3 prompt 0 the sharded model chose 8 where" in out


def test_caches_sized_for_every_head_stop_the_run_in_one_line(repo, tmp_path, capsys):
    """The field plan rewrites the attention's counts but not the config setup_caches reads."""
    argv = ["generate", "tests/fixtures/field/gptfast.tp", f"{MODEL}:gptfast", "--tp", "2"]
    assert main([*argv, "--prompt-ids", "5 6 7", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert (
        "CacheHeads: setup_caches made layers.0.attention.kv_cache.k_cache for 2 key/value heads "
        "where its attention computes 1 (`n_local_heads`)"
    ) in err and "`set config.n_local_heads = n_local_heads / tp`" in err


def _apply(tmp_path, plan: str, factory: str) -> tuple[int, dict]:
    report = tmp_path / "apply.json"
    argv = ["apply", plan, f"{MODEL}:{factory}", "--tp", "2", "--steps", "1", "--seq", "8"]
    code = main([*argv, "--json", str(report)])
    return code, json.loads(report.read_text())


def test_apply_decodes_through_the_caches_and_fails_a_model_wrong_only_there(repo, tmp_path):
    """dtp apply's proof decodes gpt-fast models too (prefill, then 4 tokens through setup_caches'
    caches) and leaves the model as it trains: the planted model fails at a decode step."""
    plan = tmp_path / "gptfast.tp"
    plan.write_text(PLAN)
    code, right = _apply(tmp_path, str(plan), "gptfast")
    decoded = "eval, 2×8, left-padded, then 4 tokens from the KV cache: logits"
    assert code == 0 and right["parity"]["ok"] and decoded in right["parity"]["shapes"]
    code, wrong = _apply(tmp_path, str(plan), "gptfast_cache_wrong")
    assert code == 1 and not wrong["parity"]["ok"]
    worst = wrong["parity"]["worst_tensor"]
    assert worst.startswith(
        "logits (eval, 2×8, left-padded, then 4 tokens from the KV cache: decode step"
    )


def test_apply_says_when_a_plan_leaves_the_caches_unsharded(repo, tmp_path):
    """The field plan trains right but does not rewrite the count setup_caches reads: its decoding is
    not proven, and the report says why (generate refuses it: above)."""
    code, report = _apply(tmp_path, "tests/fixtures/field/gptfast.tp", "gptfast")
    assert code == 0 and report["parity"]["ok"]
    line = next(s for s in report["parity"]["shapes"] if "KV cache" in s)
    assert line.startswith(
        "eval, 2×8, left-padded, then 4 tokens from the KV cache: not decoded: setup_caches made "
        "layers.0.attention.kv_cache.k_cache for 2 key/value heads where its attention computes 1"
    )
