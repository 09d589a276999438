"""`dtp train`: scale-ready init, per-rank memory, data order, clipping, convergence parity, clean
errors."""

from __future__ import annotations

import ctypes
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from dtp import models
from dtp.checks.checker import check
from dtp.cli import main
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.lang.parse import load
from dtp.layout.placement import ParamPlacement
from dtp.models.calling import PLAIN
from dtp.runtime.build import build_sharded
from dtp.runtime.keyed_init import normal_at
from dtp.runtime.launcher import launch_local
from dtp.runtime.rows import row_order, shared_rows
from dtp.train import data
from dtp.train.optim import Schedule, clip_, grad_norm


def _mesh(world: int, dp: int = 1):
    if dp > 1:
        return init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _build(plan: str, spec: str, world: int, dp: int = 1, seed: int = 3):
    source = models.resolve(spec)
    meta = models.build(source, device="meta")
    checked = check(load(plan), meta, world // dp)
    applied = build_sharded(
        checked, source, _mesh(world, dp), seed=seed, device=torch.device("cpu"), dp=dp
    )
    return applied, checked, meta


def _full_init(rank, world, plan, spec):
    applied, checked, meta = _build(plan, spec, world)
    full = {n: applied.full(n, p.detach()) for n, p in applied.model.named_parameters()}
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
        for p in applied.model.parameters()
    )
    return full, local, param_bytes_per_rank(checked, meta, world)[rank]


@pytest.mark.parametrize(
    "plan,spec,tps",
    [
        ("plans/gpt2.tp", "gpt2-tiny", (1, 2, 4)),
        ("plans/llama-packed.tp", "llama-tiny-packed", (1, 2)),
    ],
)
def test_full_init_is_identical_at_every_tp_and_ranks_hold_the_table(repo, plan, spec, tps):
    reference = None
    for tp in tps:
        results = launch_local(_full_init, tp, plan, spec, timeout=120)
        full = results[0][0]
        for _, local, table in results:  # each rank materialised exactly its placement-table bytes
            assert local == table
        if reference is None:
            reference = full
            continue
        assert full.keys() == reference.keys()
        for name in reference:
            assert torch.equal(full[name], reference[name]), (tp, name)
    # the draws are the model's initialisation: normal(0, 0.02) weights, unit norms, zero biases
    weight = reference["transformer.wte.weight" if "gpt" in spec else "model.embed_tokens.weight"]
    assert abs(float(weight.std()) - 0.02) < 1e-3 and abs(float(weight.mean())) < 1e-3
    norm = next(v for k, v in reference.items() if k.endswith(("ln_f.weight", "norm.weight")))
    assert torch.equal(norm, torch.ones_like(norm))


def test_packed_indices_and_keyed_draws():
    # Megatron's packed QKV: rank 0 of tp 2 holds rows 0-1 of each of 3 parts of 4 rows each
    size, order = row_order(ParamPlacement(0, packed=3), 12, tp=2)
    assert size == 12 and order.chunk(2)[0].tolist() == [0, 1, 4, 5, 8, 9]
    # multi-query [q, k, v] with k and v whole on every rank: the global dim holds them twice
    size, order = row_order(ParamPlacement(0, parts=((4, True), (2, False), (2, False))), 12, tp=2)
    assert (
        size == 8
        and order.chunk(2)[0].tolist() == [0, 1, 4, 5, 6, 7]
        and order.chunk(2)[1].tolist() == [2, 3, 4, 5, 6, 7]
    )
    full = normal_at(7, "w", np.arange(100), 1.0)
    assert np.array_equal(normal_at(7, "w", np.arange(40, 60), 1.0), full[40:60])
    assert not np.array_equal(normal_at(7, "v", np.arange(100), 1.0), full)


MID = "tests/fixtures/gpt-train-mid.yaml"  # 4 layers, n_embd 512, vocab 16384: 21 M parameters


def _rss_of_materialise(rank, world):
    def rss() -> int:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed transients go back to the system first
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    # the first build loads code and caches; not counted
    _build("plans/gpt2.tp", "gpt2-tiny", world)
    before = rss()
    applied, checked, meta = _build("plans/gpt2.tp", MID, world)
    return rss() - before, param_bytes_per_rank(checked, meta, world)[rank]


def test_meta_init_allocates_only_the_local_shards(repo):
    for grown, table in launch_local(_rss_of_materialise, 2, timeout=120):
        # wte (= lm_head); c_attn, c_fc, both c_proj
        sharded = 16384 * 512 + 4 * (12 * 512 * 512 + 7 * 512)
        # wpe; per layer 2 norms and 2 c_proj biases; ln_f
        replicated = 128 * 512 + 4 * 6 * 512 + 2 * 512
        assert table == 4 * (replicated + sharded // 2)
        assert abs(grown - table) <= 0.1 * table, (grown, table)


def _batches(rank, world, dp):
    mesh = _mesh(world, dp)
    corpus = data.Corpus(*_CORPUS)
    seen = []
    for step in range(3):
        x, y = data.train_batch(
            corpus, corpus.tokens(), step, 5, 8, 16, dp, mesh["dp"].get_local_rank()
        )
        seen.append((x, y))
    return mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(), seen


_CORPUS: tuple = ()


def test_every_tp_rank_of_a_group_sees_its_dp_slice_of_the_same_global_batch(repo, tmp_path):
    global _CORPUS
    corpus = data.prepare(None, tmp_path, model_vocab=256)
    _CORPUS = (
        corpus.path,
        corpus.name,
        corpus.n_tokens,
        corpus.n_train,
        corpus.vocab,
        corpus.tokenizer,
    )
    results = launch_local(_batches, 4, 2, timeout=60)
    by_dp = {}
    for dp_rank, _, seen in results:
        if dp_rank in by_dp:  # the other tp rank of the group: identical batches
            assert all(
                torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                for a, b in zip(seen, by_dp[dp_rank])
            )
        by_dp[dp_rank] = seen
    for step in range(3):
        a, b = by_dp[0][step][0], by_dp[1][step][0]
        assert not torch.equal(a, b)  # different sequences across dp …
        x1, y1 = data.train_batch(corpus, corpus.tokens(), step, 5, 8, 16, 1, 0)
        assert torch.equal(torch.cat([a, b]), x1)  # … that together are the one global batch
        assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one token
    assert data.train_batch(corpus, corpus.tokens(), 0, 5, 8, 16, 1, 0)[0].max() < 256


def _clip(rank, world, dp, plan="plans/gpt2.tp", spec="gpt2-tiny"):
    applied, _, _ = _build(plan, spec, world, dp)
    reference = models.build(spec, device="cpu")
    reference.load_state_dict(
        {n: applied.full(n, p.detach()) for n, p in applied.model.named_parameters()}, strict=False
    )
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 17), generator=gen)
    per = 4 // dp
    mine = slice(rank // (world // dp) * per, (rank // (world // dp) + 1) * per)
    with loss_parallel():
        logits = PLAIN.logits(applied.model(ids[mine, :-1]))
        F.cross_entropy(logits.flatten(0, 1), ids[mine, 1:].flatten()).backward()
    ref_logits = PLAIN.logits(reference(ids[:, :-1]))
    F.cross_entropy(ref_logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    rows = shared_rows(applied)
    shared = {id(p): rows[n] for n, p in applied.model.named_parameters() if n in rows}
    before = clip_(applied.model.parameters(), 0.05, shared)
    after = grad_norm(applied.model.parameters(), shared)
    return float(before), float(expected), float(after), sorted(rows)


@pytest.mark.parametrize(
    "world,dp,plan,spec,shared",
    [
        (2, 1, "plans/gpt2.tp", "gpt2-tiny", []),
        (4, 2, "plans/gpt2.tp", "gpt2-tiny", []),
        # multi-query c_attn: k and v rows on every rank; one kv head at tp 2 (repeat(kv)): k, v on
        # both ranks
        (
            2,
            1,
            "plans/hf/gpt_bigcode.tp",
            "dtp.models.hf:gpt_bigcode",
            [f"transformer.h.{i}.attn.c_attn.{p}" for i in (0, 1) for p in ("bias", "weight")],
        ),
        (
            4,
            2,
            "plans/hf/gemma.tp",
            "dtp.models.hf:gemma",
            [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in (0, 1) for m in ("k", "v")],
        ),
    ],
)
def test_clip_norm_equals_the_unsharded_norm(repo, world, dp, plan, spec, shared):
    for before, expected, after, rows in launch_local(_clip, world, dp, plan, spec, timeout=120):
        assert rows == shared
        assert before > 0.05
        assert abs(before - expected) <= 1e-5 * expected, (before, expected)
        assert abs(after - 0.05) <= 1e-5, after


def test_schedule_warms_up_then_decays_to_min_lr():
    s = Schedule(lr=1.0, min_lr=0.1, warmup=10, steps=110)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.55) and s(110) == pytest.approx(0.1)


def test_curves_agree_across_tp_and_the_model_learns(repo, tmp_path):
    out = tmp_path / "cmp"
    code = main(
        [
            "train",
            "plans/gpt2.tp",
            "gpt2-tiny",
            "--compare-tp",
            "1,2",
            "--steps",
            "25",
            "--batch",
            "4",
            "--seq",
            "32",
            "--warmup",
            "5",
            "--eval-every",
            "25",
            "--checkpoint-activations",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "compare.json").read_text())
    assert result["ok"] and result["worst_rel_dloss"] <= 1e-3
    rows = result["rows"]
    assert [r["tp"] for r in rows] == [1, 2] and all(r["steps"] == 25 for r in rows)
    assert f"{rows[0]['val_loss']:.3g}" == f"{rows[1]['val_loss']:.3g}"
    assert rows[0]["val_loss"] < math.log(256) - 1.5  # from ln 256 = 5.55 at init: it learns
    metrics = [
        json.loads(line) for line in (out / "tp2" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == list(range(1, 26))
    assert {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_ms",
        "comm_share",
        "peak_memory_bytes",
    } <= set(metrics[1])
    assert "val_loss" in metrics[-1]
    summary = json.loads((out / "tp2" / "summary.json").read_text())
    # Megatron's 13 all-reduces, plus the 2 forward all-reduces of each of the 2 recomputed blocks
    assert (
        summary["collectives"]["by_op"]
        == summary["analytic_collectives"]["by_op"]
        == {"all_reduce": 17}
    )
    assert summary["collectives"]["backward"] == {"all_reduce": 5 + 4}
    # `dtp explain --checkpoint-activations` prints the same schedule train measured (one model:
    # dtp.cost.schedule)
    assert (
        main(
            [
                "explain",
                "plans/gpt2.tp",
                "gpt2-tiny",
                "--tp",
                "2",
                "--batch",
                "4",
                "--seq",
                "32",
                "--checkpoint-activations",
                "--json",
                str(tmp_path / "ex.json"),
            ]
        )
        == 0
    )
    explained = json.loads((tmp_path / "ex.json").read_text())["schedule_summary"]
    for key in ("by_op", "forward", "backward", "bytes"):
        assert explained[key] == summary["collectives"][key], key
    assert (
        sum(
            c["reason"].startswith("recomputed forward")
            for c in json.loads((tmp_path / "ex.json").read_text())["schedule"]
        )
        == 4
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--data", "missing.txt"], "--data missing.txt: no such file or directory"),
        (["--data", "{empty}"], "the corpus is empty"),
        (["--data", "{binary}"], "looks binary"),
        (["--data", "{short}"], "are too few for --batch 8 × --seq 64"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
        (["--warmup", "500"], "--warmup 500 is longer than --steps 300"),
        (["--min-lr", "1"], "--min-lr 1.0 is above --lr 0.003"),
        (["--clip", "inf"], "--clip must be"),
        (["--batch", "3", "--dp", "2"], "--batch 3 (the global batch) must divide by --dp 2"),
        (["--seq", "65"], "--seq 65 exceeds the model's block_size 64"),
    ],
)
def test_bad_data_and_hyper_parameters_exit_2(repo, tmp_path, capsys, args, message):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "binary.txt").write_bytes(b"abc\x00\x01\x02" * 100)
    (tmp_path / "short.txt").write_text("def f():\n    return 1\n" * 10)
    args = [
        a.format(
            empty=tmp_path / "empty.txt",
            binary=tmp_path / "binary.txt",
            short=tmp_path / "short.txt",
        )
        for a in args
    ]
    code = main(["train", "plans/gpt2.tp", "gpt2-tiny", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--timeout", "nan"], "argument --timeout: expected a finite number > 0, got nan"),
        (["--timeout", "-5"], "argument --timeout: expected a finite number > 0, got -5"),
        (["--seed", "-3"], "argument --seed: seed must be between 0 and"),
    ],
)
def test_bad_timeout_and_seed_exit_2_as_for_apply(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "plans/gpt2.tp", "gpt2-tiny", *args])
    assert exit_.value.code == 2
    assert f"dtp train: error: {message}" in capsys.readouterr().err


def test_bpe_on_a_vocabulary_of_256_or_less_exits_2(repo, tmp_path, capsys):
    pytest.importorskip("transformers")
    code = main(
        [
            "train",
            "plans/hf/gpt_bigcode.tp",
            "dtp.models.hf:gpt_bigcode",
            "--tokenizer",
            "bpe",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "error: --tokenizer bpe needs a vocabulary above 256 (its byte alphabet plus "
        "merges); the model has 128\n"
    )
