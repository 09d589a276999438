"""`dtp bench`'s machinery: interval statistics, interleaving, parity enforcement, the
Megatron-style baseline's own collective counts, results folders (timings are never asserted: they
belong to the benchmark)."""

from __future__ import annotations

import datetime
import itertools
import json
import statistics
from collections import Counter

import pytest

from dtp.bench.stats import Ratio, interleaved_orders, median_ratio, median_ratio_runs, verdict


def test_median_ratio_interval_on_synthetic_samples():
    a = [2.0 + 0.01 * (i % 7) for i in range(40)]  # median 2.03
    b = [1.0 + 0.01 * (i % 5) for i in range(40)]  # median 1.02
    r = median_ratio(a, b)
    assert r.value == pytest.approx(2.03 / 1.02)
    assert r.low <= r.value <= r.high
    assert r.low > 1.9 and r.high < 2.1 and r.samples == 40
    same = median_ratio([5.0] * 20, [5.0] * 20)
    assert (same.value, same.low, same.high) == (1.0, 1.0, 1.0)
    # seeded: the same samples give the same interval
    assert median_ratio(a, b) == median_ratio(a, b)


def test_interval_widens_with_noise_and_shrinks_with_samples():
    import numpy as np

    rng = np.random.default_rng(3)
    noisy = median_ratio(list(1.0 + rng.exponential(0.5, 20)), list(1.0 + rng.exponential(0.5, 20)))
    calm = median_ratio(
        list(1.0 + rng.exponential(0.01, 20)), list(1.0 + rng.exponential(0.01, 20))
    )
    many = median_ratio(
        list(1.0 + rng.exponential(0.5, 2000)), list(1.0 + rng.exponential(0.5, 2000))
    )
    width = lambda r: r.high - r.low
    assert width(noisy) > 5 * width(calm)
    assert width(many) < width(noisy) / 3


def test_runs_interval_carries_the_spread_between_runs():
    import numpy as np

    rng = np.random.default_rng(0)
    # four runs, each with its own ratio, and little noise within a run
    levels = (1.00, 1.02, 1.04, 1.06)
    a = [list(level + rng.normal(0, 0.005, 200)) for level in levels]
    b = [list(1.0 + rng.normal(0, 0.005, 200)) for _ in levels]
    as_one_run = median_ratio([t for run in a for t in run], [t for run in b for t in run])
    runs = median_ratio_runs(a, b)
    per_run = [statistics.median(x) / statistics.median(y) for x, y in zip(a, b)]
    assert runs.value == pytest.approx(statistics.geometric_mean(per_run), rel=1e-12)
    assert (runs.samples, runs.runs) == (800, 4)
    # resampling rounds alone: as if the runs could not differ
    assert as_one_run.high - as_one_run.low < 0.015
    # resampling runs too: the mean of 4 runs 0.026 apart (sd)
    assert runs.low < 1.015 and runs.high > 1.045
    alike = median_ratio_runs([a[0]] * 3, [b[0]] * 3)
    assert alike.high - alike.low < 0.004  # runs that agree: as narrow as one run's rounds allow
    assert median_ratio_runs(a, b) == runs  # seeded
    slower = median_ratio_runs([a[0], [1.3 * t for t in a[0]]], [b[0], [1.3 * t for t in b[0]]])
    # a run on a slower machine: same ratio
    assert slower.value == pytest.approx(per_run[0], rel=1e-12)
    with pytest.raises(ValueError, match="per run"):
        median_ratio_runs(a[:2], [b[0], b[1][:-1]])


def test_median_ratio_rejects_unpaired_samples():
    with pytest.raises(ValueError, match="equally long"):
        median_ratio([1.0, 2.0], [1.0])


def test_verdicts():
    assert verdict(Ratio(1.0, 0.99, 1.01, 20), high=1.05) == "met"
    assert verdict(Ratio(1.04, 1.00, 1.06, 20), high=1.05) == "not significant"
    assert verdict(Ratio(1.10, 1.06, 1.15, 20), high=1.05) == "not met"
    assert verdict(Ratio(1.00, 0.985, 1.015, 20), 0.98, 1.02) == "met"
    assert verdict(Ratio(1.00, 0.97, 1.01, 20), 0.98, 1.02) == "not significant"
    assert verdict(Ratio(0.95, 0.94, 0.97, 20), 0.98, 1.02) == "not met"


def test_interleaved_orders_balance_position_and_predecessor():
    arms = ("dtp", "hand", "megatron")
    order = interleaved_orders(arms, 2 + 12, warmup=2)
    timed = order[2:]
    assert timed[:6] == list(itertools.permutations(arms)) and timed[6:] == timed[:6]
    assert order[:2] == timed[-2:]  # the warm-up rounds end the cycle the timed rounds start
    positions = Counter((a, i) for o in timed for i, a in enumerate(o))
    after = Counter((o[i], o[i + 1]) for o in timed for i in range(len(o) - 1))
    # each arm 4 times in each of 3 positions
    assert set(positions.values()) == {4} and len(positions) == 9
    # each arm right after each other arm 4 times
    assert set(after.values()) == {4} and len(after) == 6


def test_interleaved_timing_runs_one_step_per_arm_per_round():
    """time_interleaved on a world of one: the calls happen in interleaved_orders' order, warm-up
    untimed."""
    from dtp.bench.scaling import time_interleaved
    from dtp.runtime.ranks import on_ranks

    def run(rank, world):
        calls = []
        times = time_interleaved(
            {n: (lambda n=n: calls.append(n)) for n in ("a", "b", "c")}, warmup=1, samples=2
        )
        return calls, {k: len(v) for k, v in times.items()}

    calls, counts = on_ranks(run, 1)[0]
    # the warm-up round ends the cycle
    assert calls == ["c", "b", "a", "a", "b", "c", "a", "c", "b"]
    assert counts == {"a": 2, "b": 2, "c": 2}


def _broken_hand(given):
    """A classic mistake: plain ColwiseParallel on the fused QKV without reordering its rows, so
    rank 0 gets all of q and half of k — wrong whenever tp > 1 (and nothing crashes)."""
    import copy
    from unittest import mock

    from dtp.bench.arms import _dtensor_arm, handwritten

    model = copy.deepcopy(given.base)
    # the hand-written plan, rows left as they are
    with mock.patch("dtp.bench.arms.pack_parts", lambda p, parts, tp: p):
        handwritten(model, given.mesh)
    return _dtensor_arm("hand", model, given.x, given.y)


def test_arms_reach_parity_and_megatron_counts_match_dtp(repo):
    from dtp.bench.arms import ARMS
    from dtp.bench.scaling import Config, measure
    from dtp.runtime.ranks import on_ranks

    cfg = Config(
        n_layer=1, n_head=4, n_embd=32, vocab_size=64, seq=8, batch=2, tp=2, warmup=0, samples=1
    )
    good = on_ranks(measure, 2, cfg)[0]
    assert good["ok"], good.get("error")
    assert all(err <= 1e-5 for arm in good["parity"].values() for err in arm.values())
    # Megatron's own dist calls: 2 per block per pass + embedding + head's f + 3 loss = 9 at one
    # layer
    assert (
        good["collectives"]["megatron"]
        == good["collectives"]["dtp"]
        == {"all_reduce": 4 + 1 + 1 + 3}
    )
    assert good["comm_bytes"]["dtp"] == good["comm_bytes"]["megatron"]
    assert good["param_bytes_per_rank"]["dtp"] == good["param_bytes_per_rank"]["megatron"]
    assert good["analytic_collectives"] == {"all_reduce": 9}
    assert {len(v) for v in good["times_ms"].values()} == {1}

    bad = on_ranks(measure, 2, cfg, dict(ARMS, hand=_broken_hand))[0]
    assert not bad["ok"] and "times_ms" not in bad
    assert bad["error"].startswith(
        "arm 'hand' differs from the unsharded model: logits relative error"
    )


def test_tp1_dtp_arm_is_plain_pytorch_without_collectives(repo):
    """At tp 1 the benchmark's dtp arms run what `dtp apply` and `dtp train` run (plain PyTorch): no
    collective, as Megatron; the hand-written plan keeps DTensor, whose loss_parallel still reduces
    over its one rank."""
    from dtp.bench.scaling import Config, measure
    from dtp.runtime.ranks import on_ranks

    cfg = Config(
        n_layer=1,
        n_head=4,
        n_embd=32,
        vocab_size=64,
        seq=8,
        batch=2,
        tp=1,
        warmup=0,
        samples=1,
        arms=("dtp", "hand", "megatron"),
    )
    out = on_ranks(measure, 1, cfg)[0]
    assert out["ok"], out.get("error")
    assert out["collectives"] == {"dtp": {}, "megatron": {}, "hand": {"all_reduce": 3}}
    assert out["analytic_collectives"] == {}
    assert all(err <= 1e-6 for arm in out["parity"].values() for err in arm.values())


def test_megatron_sequence_parallel_counts(repo):
    """Megatron-SP on a 2-layer GPT-2 at tp=2, counted from the baseline's own dist calls: per block
    2 all-gathers and 2 reduce-scatters each way; the embedding all-reduces (learned positions are
    added to the full sum, then split: all-gather backward); the head gathers its input; 3 for the
    loss; the gradients of the 5 norms (weight and bias) and 4 row-parallel biases see a sequence
    shard and are all-reduced."""
    from dtp.runtime.ranks import on_ranks

    def run(rank, world):
        import torch

        from dtp.bench.megatron import MegatronGPT, relative_error
        from dtp.models.gpt import GPT, GPTConfig

        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)
        torch.manual_seed(0)
        base = GPT(cfg)
        meg = MegatronGPT(cfg, rank, world, sequence_parallel=True)
        meg.load_from(base)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        local = meg(x)
        fwd = dict(meg.calls.counts)
        meg.loss(local, x).backward()
        meg.finish_grads()
        ref = base(x)
        mine = ref.chunk(world, dim=-1)[rank]
        return fwd, dict(meg.calls.counts), relative_error(local.detach(), mine.detach())

    fwd, total, err = on_ranks(run, 2)[0]
    assert fwd == {"all_reduce": 1, "reduce_scatter": 4, "all_gather": 5}
    assert total == {
        "all_reduce": 1 + 3 + 10 + 4,
        "reduce_scatter": 4 + 4 + 1,
        "all_gather": 5 + 4 + 1,
    }
    assert sum(total.values()) == 37
    assert err < 1e-5


def test_shipped_plan_text_is_plans_gpt2(repo):
    from dtp.bench.arms import PLAN

    assert PLAN == (repo / "plans" / "gpt2.tp").read_text()


def test_results_folders_never_overwrite(tmp_path):
    from dtp.bench.report import results_folder

    now = datetime.datetime(2026, 12, 2, 21, 5, 9, tzinfo=datetime.timezone.utc)
    a, b = results_folder(tmp_path, "quick", now), results_folder(tmp_path, "full", now)
    c = results_folder(tmp_path, "quick", now)
    assert a.name.startswith("20261202-210509-quick-") and b.name.startswith(
        "20261202-210509-full-"
    )
    assert c != a and c.name == a.name + ".1"


def test_smoke_run_writes_results(repo, tmp_path):
    from dtp.cli import main

    out = tmp_path / "r.json"
    argv = ["bench", "--smoke", "--no-fuzz", "--out", str(tmp_path / "results"), "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["config"]["tp"] for r in result["strong"]] == [1, 2]
    assert all(r["ok"] for r in result["strong"] + result["weak"])
    at2 = result["ratios"]["strong"]["2"]
    assert at2["collectives_equal_megatron"] and at2["param_bytes_vs_megatron"] == 1.0
    assert at2["dtp_vs_megatron"]["verdict"] in {"met", "not met", "not significant"}
    assert all(len(v) == 3 for v in result["strong"][1]["times_ms"].values())
    (folder,) = (tmp_path / "results").iterdir()
    assert "-smoke-" in folder.name
    assert {"result.json", "results.md"} <= {p.name for p in folder.iterdir()}


def test_repeats_pool_fresh_runs_in_turn(repo, tmp_path, monkeypatch):
    """--repeats 2: each configuration runs twice, every configuration in turn between its runs,
    samples pooled, intervals over runs. The ranks are real once per configuration; the second run
    is that result, slower."""
    from dtp.bench import scaling
    from dtp.cli import main

    real, seen, first = scaling.run, [], {}

    def run(prepared):
        cfg = prepared.job
        seen.append((cfg.tp, cfg.n_embd))
        if (cfg.tp, cfg.n_embd) not in first:
            first[cfg.tp, cfg.n_embd] = real(prepared)
            return first[cfg.tp, cfg.n_embd]
        r = first[cfg.tp, cfg.n_embd]
        return r | {"times_ms": {arm: [2 * t for t in ts] for arm, ts in r["times_ms"].items()}}

    monkeypatch.setattr(scaling, "run", run)
    out = tmp_path / "r.json"
    argv = ["--smoke", "--tp", "2", "--repeats", "2", "--no-fuzz", "--out", str(tmp_path)]
    assert main(["bench", *argv, "--json", str(out)]) == 0
    assert seen == [(2, 32), (2, 48), (2, 32), (2, 48)]  # strong, weak, then again
    result = json.loads(out.read_text())
    strong = result["strong"][0]
    once = first[2, 32]["times_ms"]
    assert strong["runs"] == 2 and strong["times_ms"]["dtp"] == once["dtp"] + [
        2 * t for t in once["dtp"]
    ]
    assert strong["times_ms_by_run"]["megatron"] == [
        once["megatron"],
        [2 * t for t in once["megatron"]],
    ]
    ratio = result["ratios"]["strong"]["2"]["dtp_vs_megatron"]
    assert (ratio["runs"], ratio["samples"]) == (2, 6)
    assert ratio["value"] == pytest.approx(
        statistics.median(once["dtp"]) / statistics.median(once["megatron"])
    )
    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    assert "| 2 | 32 | 2 × 3 |" in (folder / "results.md").read_text()


@pytest.mark.parametrize(
    "bad, message",
    [
        ("11", "--repeats must be an integer from 1 to 10, got 11"),
        ("0", "--repeats: expected a positive integer, got 0"),
        ("two", "--repeats: expected a positive integer, got 'two'"),
    ],
)
def test_repeats_out_of_range_is_a_usage_error(bad, message, tmp_path, capsys):
    from dtp.cli import main

    assert _exit_status(main, ["bench", "--repeats", bad, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _exit_status(main, argv: list[str]) -> int:
    """main's exit status, whether argparse (SystemExit) or dtp (a return value) refused."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_a_run_whose_collectives_differ_fails_the_configuration():
    from dtp.bench.run import pool_runs

    run = {
        "ok": True,
        "collectives": {"dtp": {"all_reduce": 3}},
        "comm_bytes": {"dtp": {"all_reduce": 12}},
        "parity": {"dtp": {"loss": 1e-7}},
        "times_ms": {"dtp": [1.0]},
    }
    other = run | {"collectives": {"dtp": {"all_reduce": 4}}, "parity": {"dtp": {"loss": 3e-7}}}
    assert pool_runs([run, run | {"parity": {"dtp": {"loss": 3e-7}}}])["parity"] == {
        "dtp": {"loss": 3e-7}
    }
    failed = pool_runs([run, other])
    assert not failed["ok"] and "differ" in failed["error"]
    assert pool_runs([run, {"ok": False, "error": "parity"}]) == {"ok": False, "error": "parity"}


def test_gpu_check_dry_run_on_cpu(repo, tmp_path):
    """`dtp bench --device cuda`'s logic with tiny sizes on gloo: apply parity through the command
    line, a bf16 training step with its FLOP count, the interleaved dtp/Megatron ratio with parity
    enforced, and `dtp generate` on a Llama directory."""
    from dtp.cli import main

    assert main(["bench", "--dry-run", "--out", str(tmp_path)]) == 0
    (folder,) = tmp_path.iterdir()
    assert "-gpu-dry-run-" in folder.name
    result = json.loads((folder / "result.json").read_text())
    assert (
        result["apply"]["ok"]
        and result["apply"]["tp"] == 2
        and result["apply"]["backend"] == "gloo"
    )
    assert result["apply"]["parity"]["ok"] is True
    assert result["train"]["finite"] and result["train"]["mfu"] is None  # no known peak for a CPU
    assert result["ratio"]["ok"] and result["ratio"]["collectives_equal_megatron"]
    assert "dtp/Megatron-style at tp=2" in (folder / "results.md").read_text()
    # the compiled arm too
    assert set(result["ratio"]["parity"]) == {"dtp", "hand", "megatron", "dtp-compile"}
    assert "dtp under torch.compile/Megatron-style at tp=2" in (folder / "results.md").read_text()
    # decoding through the command line: token-exact, with its speed and bandwidth
    g = result["generate"]
    assert g["ok"] and g["exit"] == 0 and g["tp"] == 2
    assert (
        g["tokens_per_s"] > 0 and g["memory_gb_per_s"] > 0 and len(g["weight_bytes_per_rank"]) == 2
    )
    assert "generate (Llama, tp=2): token-exact OK" in (folder / "results.md").read_text()


def test_gpu_check_without_gpu_is_a_usage_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from dtp.cli import main

    assert main(["bench", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_gpu_check_reports_a_failed_rank_and_keeps_the_other_results(repo, tmp_path, monkeypatch):
    """A rank of the ratio that fails (as the CUDA path's first run did) is a FAILED line and exit
    1, with the apply, training and decoding results still written. The apply and generate commands
    are the dry run's above; here they answer as they did there, without their interpreters."""
    from dtp.bench import gpu, scaling

    def broken(rank, world, cfg):
        raise RuntimeError("planted failure")

    applied = {"command": "dtp apply", "exit": 0, "ok": True, "tp": 2, "backend": "gloo"}
    generated = {"exit": 0, "ok": True, "tp": 2, "tokens_per_s": 9.0, "memory_gb_per_s": 0.5}
    monkeypatch.setattr(scaling, "measure", broken)
    monkeypatch.setattr(gpu, "_apply_parity", lambda out, tp, device: applied)
    monkeypatch.setattr(gpu, "_generate", lambda out, tp, device, dry_run: generated)
    assert gpu.main(tmp_path, dry_run=True) == 1
    (folder,) = tmp_path.iterdir()
    result = json.loads((folder / "result.json").read_text())
    assert result["apply"] == applied and result["generate"] == generated
    assert result["train"]["finite"]
    assert not result["ratio"]["ok"] and "planted failure" in result["ratio"]["error"]
    # whichever rank first
    assert "ratio: FAILED: the run failed on rank" in (folder / "results.md").read_text()
