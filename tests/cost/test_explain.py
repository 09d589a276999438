"""`dtp explain`: per-parameter placements and per-rank byte counts, checked against hand-computed
numbers."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
import torch

from dtp import cli, models
from dtp.checks.checker import check
from dtp.cost.explain import explain
from dtp.lang.parse import load

ROOT = Path(__file__).resolve().parents[2]
F32 = 4  # bytes per float32

# gpt2-tiny: n_layer=2, n_head=4, n_embd=64, vocab 256, block 64, biases, lm_head tied to wte.
L, C, V, T = 2, 64, 256, 64


def tiny_counts() -> tuple[int, int]:
    """(sharded, replicated) parameter counts of gpt2-tiny under plans/gpt2.tp, written out by hand."""
    # vocab_parallel: sharded; lm_head.weight is the same tensor and is not counted again
    wte = V * C
    wpe = T * C  # untouched: replicated
    ln = 2 * C  # weight + bias of a LayerNorm, replicated
    c_attn = C * 3 * C + 3 * C  # colwise(packed=3): weight and bias sharded
    attn_proj_w, attn_proj_b = C * C, C  # rowwise: weight sharded, bias replicated
    c_fc = C * 4 * C + 4 * C  # colwise: weight and bias sharded
    mlp_proj_w, mlp_proj_b = 4 * C * C, C  # rowwise
    sharded = wte + L * (c_attn + attn_proj_w + c_fc + mlp_proj_w)
    replicated = wpe + L * (ln + attn_proj_b + ln + mlp_proj_b) + ln  # ... + ln_f
    return sharded, replicated


def test_hand_counts_are_what_they_claim():
    sharded, replicated = tiny_counts()
    # per block: ln_1 128 + c_attn 12480 + c_proj 4160 + ln_2 128 + c_fc 16640 + mlp.c_proj 16448 =
    # 49984
    assert sharded + replicated == 16384 + 4096 + 2 * 49984 + 128 == 120576
    model = models.build("gpt2-tiny")
    assert sum(p.numel() for p in model.parameters()) == 120576


@pytest.mark.parametrize("tp, per_rank", [(1, 482304), (2, 251136), (4, 135552)])
def test_gpt2_tiny_totals(tp, per_rank):
    plan, model = load(ROOT / "plans" / "gpt2.tp"), models.build("gpt2-tiny")
    ex = explain(check(plan, model, tp), model, "gpt2-tiny", tp)
    sharded, replicated = tiny_counts()
    assert ex.bytes_unsharded == F32 * (sharded + replicated) == 482304
    assert ex.bytes_per_rank == F32 * (replicated + sharded // tp) == per_rank
    assert ex.ideal_bytes_per_rank == ex.bytes_per_rank  # everything divides evenly
    assert (ex.model, ex.tp, ex.dtype, ex.plan_name, ex.plan_version) == (
        "gpt2-tiny",
        tp,
        "float32",
        "gpt2-megatron",
        1,
    )
    assert len(ex.rows) == 2 + L * 12 + 2  # wte, wpe; 12 tensors per block; ln_f weight and bias
    assert sum(r.bytes_per_rank for r in ex.rows) == ex.bytes_per_rank
    assert ex.untouched == (
        "transformer.wpe",
        "transformer.h.*.ln_1 (×2)",
        "transformer.h.*.ln_2 (×2)",
        "transformer.ln_f",
    )


def test_gpt2_tiny_rows_at_tp2(monkeypatch):
    monkeypatch.chdir(ROOT)
    plan, model = load("plans/gpt2.tp"), models.build("gpt2-tiny")
    ex = explain(check(plan, model, 2), model, "gpt2-tiny", 2)
    rows = {r.name: r for r in ex.rows}
    assert "lm_head.weight" not in rows  # listed once, under its first name

    def row(name):
        r = rows[name]
        return (r.rule, r.style, r.placement, r.shape, r.local_shape, r.bytes_per_rank, r.tied_with)

    assert row("transformer.wte.weight") == (
        "plans/gpt2.tp:8",
        "vocab_parallel",
        "Shard(0)",
        (V, C),
        (V // 2, C),
        V // 2 * C * F32,
        ("lm_head.weight",),
    )
    assert row("transformer.h.0.attn.c_attn.weight") == (
        "plans/gpt2.tp:11",
        "colwise",
        "Shard(0) packed×3",
        (192, 64),
        (96, 64),
        96 * 64 * F32,
        (),
    )
    assert row("transformer.h.1.attn.c_attn.bias") == (
        "plans/gpt2.tp:11",
        "colwise",
        "Shard(0) packed×3",
        (192,),
        (96,),
        96 * F32,
        (),
    )
    assert row("transformer.h.0.attn.c_proj.weight") == (
        "plans/gpt2.tp:12",
        "rowwise",
        "Shard(1)",
        (64, 64),
        (64, 32),
        64 * 32 * F32,
        (),
    )
    assert row("transformer.h.0.mlp.c_proj.bias") == (
        "plans/gpt2.tp:14",
        "rowwise",
        "Replicate()",
        (64,),
        (64,),
        64 * F32,
        (),
    )
    assert row("transformer.h.0.mlp.c_fc.weight") == (
        "plans/gpt2.tp:13",
        "colwise",
        "Shard(0)",
        (256, 64),
        (128, 64),
        128 * 64 * F32,
        (),
    )
    assert row("transformer.wpe.weight") == (
        "-",
        "-",
        "Replicate()",
        (T, C),
        (T, C),
        T * C * F32,
        (),
    )
    assert row("transformer.ln_f.bias") == ("-", "-", "Replicate()", (C,), (C,), C * F32, ())
    assert rows["transformer.h.0.ln_1.weight"].module_type == "LayerNorm"
    assert rows["transformer.h.0.attn.c_attn.weight"].module == "transformer.h.0.attn.c_attn"


def test_bfloat16_halves_the_bytes():
    plan, model = load(ROOT / "plans" / "gpt2.tp"), models.build("gpt2-tiny")
    ex = explain(check(plan, model, 2), model, "gpt2-tiny", 2, dtype=torch.bfloat16)
    assert (ex.dtype, ex.bytes_unsharded, ex.bytes_per_rank) == (
        "bfloat16",
        482304 // 2,
        251136 // 2,
    )


def test_uneven_vocabulary_on_gpt2_small():
    # GPT-2's 50257-row vocabulary does not divide by 2: torch.chunk gives rank 0 ceil(50257 / 2) =
    # 25129 rows.
    Lg, Cg, Vg, Tg = 12, 768, 50257, 1024
    # c_attn, c_proj.w, c_fc, c_proj.w
    even = Lg * ((3 * Cg * Cg + 3 * Cg) + Cg * Cg + (4 * Cg * Cg + 4 * Cg) + 4 * Cg * Cg)
    # wpe; ln_1, c_proj.b, ln_2, c_proj.b; ln_f
    replicated = Tg * Cg + Lg * (2 * Cg + Cg + 2 * Cg + Cg) + 2 * Cg
    model = models.build("gpt2")
    ex = explain(check(load(ROOT / "plans" / "gpt2.tp"), model, 2), model, "gpt2", 2)
    assert ex.bytes_unsharded == F32 * (Vg * Cg + even + replicated) == F32 * 124_439_808
    assert ex.bytes_per_rank == F32 * (replicated + even // 2 + 25129 * Cg)
    assert ex.ideal_bytes_per_rank == F32 * replicated + F32 * (Vg * Cg + even) // 2
    assert ex.bytes_per_rank - ex.ideal_bytes_per_rank == F32 * Cg // 2  # rank 0 holds the odd row
    rows = {r.name: r for r in ex.rows}
    wte = rows["transformer.wte.weight"]
    assert (wte.shape, wte.local_shape, wte.uneven, wte.bytes_per_rank) == (
        (Vg, Cg),
        (25129, Cg),
        True,
        F32 * 25129 * Cg,
    )
    assert [r.name for r in ex.rows if r.uneven] == ["transformer.wte.weight"]


def test_megatron_8_3b_on_meta():
    cfg = dict(n_layer=72, n_head=32, n_embd=3072, vocab_size=51200, block_size=1024)
    Lb, Cb, Vb, Tb = cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"], cfg["block_size"]
    per_block = (
        (2 * Cb)
        + (3 * Cb * Cb + 3 * Cb)
        + (Cb * Cb + Cb)
        + (2 * Cb)
        + (4 * Cb * Cb + 4 * Cb)
        + (4 * Cb * Cb + Cb)
    )
    assert per_block == 12 * Cb * Cb + 13 * Cb
    params = Vb * Cb + Tb * Cb + Lb * per_block + 2 * Cb  # wte (= lm_head), wpe, blocks, ln_f
    assert params == 8_317_040_640  # "8.3B"
    sharded = Vb * Cb + Lb * (3 * Cb * Cb + 3 * Cb + Cb * Cb + 4 * Cb * Cb + 4 * Cb + 4 * Cb * Cb)
    replicated = params - sharded

    source = models.resolve("megatron-8.3b")
    assert {k: getattr(source.config, k) for k in cfg} == cfg
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.monotonic()
    model = models.build(source, device="meta")
    ex = explain(check(load(ROOT / "plans" / "gpt2.tp"), model, 8), model, "megatron-8.3b", 8)
    elapsed = time.monotonic() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert all(p.is_meta for p in model.parameters())
    assert grown_mib < 512, f"explaining on meta grew the process by {grown_mib:.0f} MiB"
    assert elapsed < 20
    assert ex.bytes_unsharded == F32 * params == 33_268_162_560
    assert ex.bytes_per_rank == ex.ideal_bytes_per_rank == F32 * (replicated + sharded // 8)
    assert len(ex.rows) == 2 + 72 * 12 + 2


def test_cli_explain_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out_json = tmp_path / "ex.json"
    assert (
        cli.main(["explain", "plans/gpt2.tp", "gpt2-tiny", "--tp", "2", "--json", str(out_json)])
        == 0
    )
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == "plan gpt2-megatron version 1 (plans/gpt2.tp) on gpt2-tiny, tp=2, float32"
    assert "parameters, unsharded:         471.0 KiB  (482304 B)" in lines
    assert "parameters on rank 0:          245.2 KiB  (251136 B)" in lines
    assert (
        "untouched by any sharding rule (replicated): transformer.wpe, transformer.h.*.ln_1 (×2), "
        "transformer.h.*.ln_2 (×2), transformer.ln_f"
    ) in lines

    data = json.loads(out_json.read_text(encoding="utf-8"))
    assert (data["bytes_unsharded"], data["bytes_per_rank"], data["ideal_bytes_per_rank"]) == (
        482304,
        251136,
        251136,
    )
    assert (data["model"], data["tp"], data["dtype"], data["plan_file"]) == (
        "gpt2-tiny",
        2,
        "float32",
        "plans/gpt2.tp",
    )
    assert (data["plan_name"], data["plan_version"]) == ("gpt2-megatron", 1)
    rows = {r["name"]: r for r in data["rows"]}
    assert len(rows) == 28
    c_attn = rows["transformer.h.0.attn.c_attn.weight"]
    assert (
        c_attn["placement"],
        c_attn["shape"],
        c_attn["local_shape"],
        c_attn["bytes_per_rank"],
    ) == ("Shard(0) packed×3", [192, 64], [96, 64], 24576)
    assert rows["transformer.wte.weight"]["tied_with"] == ["lm_head.weight"]


def test_cli_explain_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["explain", "plans/gpt2.tp", "gpt2-tiny", "--tp", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n6 errors\n")
    missing_dir = tmp_path / "no" / "such" / "dir" / "x.json"
    assert (
        cli.main(["explain", "plans/gpt2.tp", "gpt2-tiny", "--tp", "2", "--json", str(missing_dir)])
        == 2
    )
    assert (
        capsys.readouterr().err == f"error: cannot write {missing_dir}: No such file or directory\n"
    )
