"""`dtp simulate --decode`: one decoded token, memory time over tp plus the plan's collectives'
latency, held to gpt-fast's published A100 rows (an independent measurement: one number, the HBM
fraction, is fitted on its TP 1 row; the other six rows are predictions)."""

from __future__ import annotations

import pytest

from dtp import load, models
from dtp.checks.checker import check
from dtp.cli import main
from dtp.simulate.decode import HBM_FRACTION, decode_step, kv_bytes
from dtp.simulate.profile import load as load_profile

# gpt-fast's tp.py: attention and feed-forward split, embedding and output replicated
GPT_FAST = """dtp 1
model.layers.* {
    self_attn.q_proj: colwise
    self_attn.k_proj: colwise
    self_attn.v_proj: colwise
    self_attn.o_proj: rowwise
    mlp.gate_proj: colwise
    mlp.up_proj: colwise
    mlp.down_proj: rowwise
}
"""
# gpt-fast README, 8 × A100-80GB, batch 1, bf16: tokens/s by tp
PUBLISHED = {
    ("llama2-7b", 1): 104.9,
    ("llama2-7b", 2): 168.8,
    ("llama2-7b", 4): 254.0,
    ("llama2-7b", 8): 328.4,
    ("llama2-70b", 2): 21.3,
    ("llama2-70b", 4): 38.0,
    ("llama2-70b", 8): 62.5,
}


@pytest.mark.parametrize(("model", "tp"), list(PUBLISHED))
def test_gpt_fast_rows_within_15_percent(tmp_path, model, tp):
    plan = tmp_path / "gpt-fast.tp"
    plan.write_text(GPT_FAST)
    meta = models.build(model, device="meta")
    step = decode_step(
        check(load(str(plan)), meta, tp),
        meta,
        tp,
        load_profile("a100-80gb"),
        batch=1,
        context=105,  # gpt-fast: a 5-token prompt and 200 new tokens, 105 on average
        precision="bf16",
    )
    assert step.tokens_per_s(1) == pytest.approx(PUBLISHED[model, tp], rel=0.15)
    assert step.collectives == (0 if tp == 1 else 2 * len(meta.model.layers))


def test_the_fitted_fraction_is_gpt_fasts_tp1_bandwidth():
    assert HBM_FRACTION == pytest.approx(1397 / 2039)


def test_kv_cache_per_rank_is_its_own_heads(tmp_path):
    meta = models.build("llama3-8b", device="meta")  # 8 key/value heads of 128
    whole = kv_bytes(meta, 1, 2, 100, 2)
    assert whole == 2 * 32 * 8 * 128 * 100 * 2 * 2
    assert kv_bytes(meta, 8, 2, 100, 2) == whole // 8
    assert kv_bytes(meta, 16, 2, 100, 2) == whole // 8  # one head per rank at least


def test_the_command_prints_the_table_and_says_where_tp_stops_paying(repo, capsys):
    # the zoo's 7B under the shipped plan on one H100 node, 4 rows, 2k tokens of cache
    argv = ["simulate", "plans/llama.tp", "llama2-7b", "--profile", "h100-sxm", "--decode"]
    assert main([*argv, "--micro-batch", "4", "--seq", "2048"]) == 0
    out = capsys.readouterr().out
    assert "| tp | ms/token | tokens/s | GB/s per GPU | collectives |" in out
    cells = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert [c for c in cells if c.isdigit()] == ["1", "2", "4", "8"]
    assert "fastest at tp " in out
