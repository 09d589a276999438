"""`dtp bench --quick` end to end (timings are not asserted: they belong to the benchmark, not a test)."""
from __future__ import annotations

import json

from bench.megatron import MegatronGPT
from bench.run import main
from bench.scaling import Config, measure
from dtp.ranks import on_ranks

FIELDS = {"dtp_ms", "megatron_ms", "handwritten_ms", "comm_ms", "collectives", "analytic_collectives",
          "param_bytes_per_rank", "ideal_param_bytes_per_rank", "tokens_per_s", "utilization",
          "parity_vs_unsharded", "megatron_vs_dtp_logits", "megatron_vs_dtp_loss", "peak_rss_bytes"}


def test_megatron_baseline_equals_dtp_and_fields_are_there(repo):
    cfg = Config(n_layer=1, n_head=4, n_embd=32, vocab_size=64, seq=8, batch=2, tp=2, warmup=0, steps=1)
    result = on_ranks(measure, 2, cfg)[0]
    assert FIELDS <= set(result)
    assert result["megatron_vs_dtp_logits"] < 1e-6
    assert result["megatron_vs_dtp_loss"] < 1e-6
    assert result["parity_vs_unsharded"] < 1e-5
    assert result["collectives"]["by_op"] == result["analytic_collectives"]["by_op"] == {"all_reduce": 4 + 1 + 1 + 3}
    assert result["param_bytes_per_rank"] == result["ideal_param_bytes_per_rank"]


def test_megatron_baseline_rejects_indivisible_heads():
    import pytest

    from dtp.models.gpt import GPTConfig

    with pytest.raises(ValueError, match="divisible by tp"):
        MegatronGPT(GPTConfig(n_layer=1, n_head=3, n_embd=12, vocab_size=16, block_size=8), 0, 2)


def test_quick_run_writes_results(repo, tmp_path):
    out = tmp_path / "r.json"
    assert main(["--quick", "--no-fuzz", "--out", str(tmp_path / "results"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["config"]["tp"] for r in result["strong"]] == [1, 2, 4]
    assert [r["config"]["n_embd"] for r in result["weak"]] == [128, 192, 256]
    ratios = result["ratios"]
    assert set(ratios) >= {"vs_megatron_step_time", "vs_handwritten_step_time", "collectives_vs_analytic",
                           "param_memory_vs_ideal", "strong_scaling_efficiency", "weak_scaling_efficiency"}
    assert all(v == 1.0 for v in ratios["collectives_vs_analytic"].values())
    assert all(v == 1.0 for v in ratios["param_memory_vs_ideal"].values())
    for r in result["strong"] + result["weak"]:
        assert r["megatron_vs_dtp_logits"] < 1e-6
    (folder,) = (tmp_path / "results").iterdir()
    assert {p.name for p in folder.iterdir()} == {"result.json", "results.md", "scaling.png", "comm_memory.png"}
