"""`dtp simulate`: FLOP and parameter formulas by hand, collective bytes against a real `dtp apply`,
activation memory against apply's measurement, profile validation, and the paper reproduction's
bands."""

from __future__ import annotations

import pytest

from dtp import models
from dtp.checks.checker import check
from dtp.cost.schedule import summarize
from dtp.lang.parse import load as load_plan
from dtp.simulate import flops as fl
from dtp.simulate import sweep
from dtp.simulate.memory import activation_bytes
from dtp.simulate.model import Run, simulate, tp_collectives
from dtp.simulate.prepare import Prepared
from dtp.simulate.profile import load, parse
from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig


def test_flops_of_gpt2_tiny_by_hand(repo):
    # gpt2-tiny: l=2, h=64, V=256; one sequence of s=16 tokens
    model = models.build(models.resolve("gpt2-tiny"), device="meta")
    checked = check(load_plan("plans/gpt2.tp"), model, 2)
    f = fl.count(model, 16, checked.resolution)
    l, h, V, s = 2, 64, 256, 16
    # c_attn, c_proj, c_fc, mlp.c_proj
    per_layer_gemm = 2 * s * (h * 3 * h + h * h + h * 4 * h + 4 * h * h)
    attention = 2 * 2 * s * s * h  # QKᵀ and attention × V, all heads, no causal saving
    head = 2 * s * h * V
    assert f.forward() == l * (per_layer_gemm + attention) + head
    assert f.forward(tp=2) == f.forward() / 2  # gpt2.tp shards every matmul
    assert f.recomputed("full") == l * (per_layer_gemm + attention)  # the head is not checkpointed
    assert f.recomputed("selective") == l * attention
    # 4 forwards for the blocks, 3 for the head: Narayanan et al. eq. 3 exactly
    assert f.iteration(3, "full") == pytest.approx(fl.narayanan_flops(3, s, l, h, V), rel=1e-12)
    # parameters: blocks 12h² + 13h, embeddings (V + block_size) h, final LayerNorm 2h (tied head)
    numel = sum(p.numel() for p in model.parameters())
    assert numel == l * (12 * h * h + 13 * h) + (V + 64) * h + 2 * h
    assert fl.narayanan_params(l, h, V, 64) == pytest.approx(numel - 2 * h, rel=1e-12)


@pytest.fixture(scope="module")
def applied():
    """One real `dtp apply` (gpt2-tiny, tp 2, batch 2 × 16 tokens, float32) and its simulation."""
    report = launch_apply(
        RunConfig(plan="plans/gpt2.tp", model="gpt2-tiny", tp=2, batch=2, seq=16, steps=1)
    )
    work = Prepared("plans/gpt2.tp", "gpt2-tiny", 16).workload(2, 2, "fp32")
    return report, work


def test_simulated_collectives_are_the_ones_apply_measures(repo, applied):
    report, work = applied
    run = Run(2, 1, 2, 2, 16, "fp32", "none", "sgd")
    assert summarize(tp_collectives(work, run), 2) == report.collectives
    # full recompute re-runs the 2 forward all-reduces (g) of each of the 2 blocks, in backward
    full = summarize(tp_collectives(work, Run(2, 1, 2, 2, 16, "fp32", "full", "sgd")), 2)
    measured = report.collectives
    assert full["forward"] == measured["forward"]
    assert full["backward"]["all_reduce"] == measured["backward"]["all_reduce"] + 2 * 2
    assert full["sent_bytes"]["all_reduce"] == measured["sent_bytes"]["all_reduce"] + 4 * (
        2 * 16 * 64 * 4
    )  # 2 ranks: each sends the buffer once
    sim = simulate(work, run, load("dgx2h-v100"))
    assert sim.tp_sent_bytes == measured["sent_bytes"]["all_reduce"]
    assert sim.tp_collectives == measured["total"]


def test_activation_formula_against_apply_measurement(repo, applied):
    report, work = applied
    predicted = activation_bytes(
        work.shape, 2, 16, 2, elem=4, recompute="none", dropout=False, flash=True
    )
    measured = report.activation_bytes_per_rank[0]
    # 0.3 % off on larger models
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\ncolour: red\n", "unknown key 'colour'"),
        (
            "name: x\ngpu: {name: g, peak_tflops: {fp16: -1}}\n",
            "'gpu.peak_tflops.fp16' = -1 is out of range",
        ),
        (
            "name: x\ngpu: {name: g, peak_tflops: {fp16: .nan}}\n",
            "'gpu.peak_tflops.fp16' = nan is out of range",
        ),
        (
            "name: x\ngpu: {name: g, achieved_fraction: lots}\n",
            "'gpu.achieved_fraction' must be a number, got 'lots'",
        ),
        ("name: x\ndp_overlap: 1\n", "'dp_overlap' must be true or false"),
        ("name: x\n", "missing keys gpu, gpu.achieved_fraction"),
        ("- a list\n", "a profile is a mapping"),
        ("name: [unclosed\n", "profile p.yaml is not valid YAML: while parsing a flow sequence"),
        (
            "!!python/object/apply:os.system ['true']\n",
            "not valid YAML",
        ),  # safe_load: data, never code
    ],
)
def test_profile_validation(text, message):
    with pytest.raises(Exception) as err:
        parse(text, "p.yaml")
    assert type(err.value).__name__ == "UsageError" and message in str(err.value), str(err.value)


def test_usage_errors_exit_2(repo, tmp_path, capsys):
    from dtp.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnode: {gpus: 0}\n")
    for profile, message in (
        (str(tmp_path / "missing.yaml"), "neither a file nor a shipped profile"),
        (str(bad), "'node.gpus' = 0 is out of range [1, 4096]"),
    ):
        assert main(["simulate", "plans/gpt2.tp", "gpt2-tiny", "--profile", profile]) == 2
        assert message in capsys.readouterr().err
    assert (
        main(["simulate", "plans/gpt2.tp", "gpt2-tiny", "--profile", "dgx2h-v100", "--seq", "65"])
        == 2
    )
    assert "--seq 65 exceeds gpt2-tiny's block size 64" in capsys.readouterr().err


def test_shipped_profiles_load():
    for name in ("dgx2h-v100", "dgx-a100", "h100-sxm", "h200-sxm"):
        assert load(name).name == name


@pytest.fixture(scope="module")
def paper():
    """The paper's weak-scaling configurations on dgx2h-v100 (deterministic model outputs)."""
    prof = load("dgx2h-v100")
    out, prepared = {}, {}
    for name, tp in sweep.TABLE1:
        prepared[name] = Prepared("plans/gpt2.tp", name, 1024)
        work = prepared[name].workload(tp, 8, "fp16")
        for dp, overlap in ((1, False), (64, False), (64, True)):
            # the 2019 code
            run = Run(tp, dp, 8, 8 * dp, 1024, "fp16", "full", "adam", overlap, attention="unfused")
            out[name, dp, overlap] = simulate(work, run, prof)
    return out, prepared


def test_table_1_flops_equal_narayanan_and_params_equal_table_1(paper):
    _, prepared = paper
    for (name, _), billions in zip(sweep.TABLE1, (1.2, 2.5, 4.2, 8.3)):
        p = prepared[name]
        s = p.shape
        assert p.flops.iteration(8, "full") == pytest.approx(
            fl.narayanan_flops(8, 1024, s.layers, s.hidden, s.vocab), rel=1e-12
        )
        assert sum(x.numel() for x in p.model.parameters()) / 1e9 == pytest.approx(
            billions, abs=0.05
        )


def test_paper_reproduction_within_stated_bands(paper):
    paper, _ = paper
    base = paper["megatron-1.2b", 1, False].tflops_per_gpu
    assert base == pytest.approx(39, abs=1.0)  # 1.2B on one GPU: 39 TFLOP/s
    for (name, _), mp, mpdp in zip(sweep.TABLE1, sweep.PAPER_MP, sweep.PAPER_MPDP):
        # model parallel ±3
        assert 100 * paper[name, 1, False].tflops_per_gpu / base == pytest.approx(mp, abs=3)
        mpdp_eff = 100 * paper[name, 64, False].tflops_per_gpu / base
        if name != "megatron-8.3b":
            assert mpdp_eff == pytest.approx(mpdp, abs=8)  # + data ±8
        # a known miss by 0.4 point (docs/simulate.md): DP comm is 0.33 s after backward, 65.6 % vs
        # 74
        else:
            assert mpdp_eff - mpdp == pytest.approx(-8.39, abs=0.3)
    # 512 GPUs: within ±10 % of 15.1 PFLOP/s only with the gradient all-reduce overlapped; the 2019
    # code's all-reduce after backward costs 0.33 s here and lands 13 % low (a known miss, see
    # README)
    assert paper["megatron-8.3b", 64, True].aggregate_pflops == pytest.approx(15.1, rel=0.10)
    assert paper["megatron-8.3b", 64, False].aggregate_pflops == pytest.approx(13.1, rel=0.02)
    assert all(r.memory.fits for r in paper.values())


@pytest.mark.parametrize(
    "recompute, sp, per_layer",
    [
        ("none", False, lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
        ("none", True, lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t))),
        ("selective", False, lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
        ("selective", True, lambda s, b, h, a, t: s * b * h * 34 / t),
        ("full", False, lambda s, b, h, a, t: 2 * s * b * h),
    ],
)
def test_activation_formula_is_korthikanti_table_2(recompute, sp, per_layer):
    from dtp.simulate.memory import Shape

    s, b, h, a, t = 1024, 4, 3072, 32, 8
    one, two = (
        activation_bytes(
            Shape(layers, h, a, 51200), b, s, t, elem=2, recompute=recompute, sequence_parallel=sp
        )
        for layers in (1, 2)
    )
    assert two - one == pytest.approx(per_layer(s, b, h, a, t), rel=1e-12)  # bytes per added layer


def test_ops_split_where_the_tensor_is_sharded():
    from dtp.simulate.ops import Op, summarize

    # LayerNorm, residual
    raw = [
        ("h.0.ln_1", "memory", 0, 10, "", 0, False),
        ("h.0", "memory", 0, 20, "", 0, False),
        ("h.0.attn", "memory", 0, 30, "", 0, False),
        ("h.0.mlp.gelu", "memory", 0, 40, "", 0, False),
        ("h.0.mlp.c_fc", "gemm", 50, 0, "", 0, False),
        ("h.0.mlp.c_fc", "gemm", 50, 0, "", 0, False),
        ("ln_f", "memory", 0, 10, "", 0, False),
    ]
    styles = {
        "h.0.attn.c_attn": "colwise",
        "h.0.attn.c_proj": "rowwise",
        "h.0.mlp.c_fc": "colwise",
        "h.0.mlp.c_proj": "rowwise",
        "wte": "vocab_parallel",
    }
    assert summarize(raw, styles, ["h.0"]) == (
        Op("gemm", 50, 0, True, True, 2),
        Op("memory", 0, 10, False, False, 1),
        Op("memory", 0, 10, False, True, 1),
        Op("memory", 0, 20, False, True, 1),
        Op("memory", 0, 30, True, True, 1),
        Op("memory", 0, 40, True, True, 1),
    )


def test_recorded_ops_carry_every_flop(repo):
    model = models.build(models.resolve("gpt2-tiny"), device="meta")
    f = fl.count(model, 16, check(load_plan("plans/gpt2.tp"), model, 2).resolution)
    for tp in (1, 2):
        assert sum(o.flops * o.count / (tp if o.split else 1) for o in f.ops) == f.forward(tp)
    assert {o.split for o in f.ops if o.kind == "memory" and o.in_block} == {True, False}


def test_kernel_time_overhead_and_gemm_table():
    import dataclasses

    from dtp.simulate.flops import Flops
    from dtp.simulate.model import kernel_time
    from dtp.simulate.ops import Op

    prof = parse(
        "name: t\ngpu: {name: g, peak_tflops: {fp32: 1.0}, achieved_fraction: 1.0, memory_GiB: 1,"
        " hbm_GBps: 1, gemm_efficiency: {1: 0.5, 100: 1.0}, op_overhead_us: 1000}\n"
        "node: {gpus: 1, intra: {busbw_GBps: 1, latency_us: 1}, inter: {busbw_GBps: 1, latency_us: "
        "1}}\n",
        "t",
    )
    assert [prof.gemm_fraction(g * 1e9) for g in (0.1, 10, 1000)] == pytest.approx([0.5, 0.75, 1.0])
    ops = Flops(
        1, (), (Op("gemm", 2 * 10**10, 0, True, True, 1), Op("memory", 0, 10**6, False, True, 2))
    )
    run = Run(2, 1, 1, 1, 1, "fp32", "none", "sgd")
    # half the GEMM per rank: 10 GFLOP, halfway (in log) from 1 to 100: 0.75
    gemm = 1e10 / (1e12 * 0.75)
    memory = 4e6 / 1e9  # 10⁶ fp32 elements over 1 GB/s
    # async (a GPU): each op costs max(1 ms, work); 3 passes (forward + backward) each
    assert kernel_time(ops, run, prof) == pytest.approx(
        3 * (max(1e-3, gemm) + 2 * max(1e-3, memory))
    )
    sync = dataclasses.replace(prof, async_ops=False)  # a CPU rank: overhead and work add
    assert kernel_time(ops, run, sync) == pytest.approx(3 * (1e-3 + gemm + 2 * (1e-3 + memory)))
    full = dataclasses.replace(run, recompute="full")  # both ops are in a block: run once more
    assert kernel_time(ops, full, sync) == pytest.approx(4 / 3 * kernel_time(ops, run, sync))
    with pytest.raises(Exception, match="gemm_efficiency\\[1\\]' = 2 is out of range"):
        parse("name: t\ngpu: {gemm_efficiency: {1: 2}}\n", "t")


def test_what_table_8_and_the_512_gpu_bar_would_need(paper):
    # the two 2019 results outside their bands, each traced to the one term that would have to
    # change
    from dtp.simulate import consistency

    _, prepared = paper
    prof = load("dgx2h-v100")
    fit = consistency.strong_fit("plans/gpt2.tp", prof, prepared)
    # one slower link reproduces all three of Table 8's speedups, not only the 8-GPU one it was
    # solved on ...
    assert fit.speedups[-1] == pytest.approx(sweep.PAPER_STRONG[-1], abs=0.01)
    assert fit.speedups == pytest.approx(sweep.PAPER_STRONG[1:], abs=0.05)
    assert 0.15 < fit.needed < 0.3 < fit.fitted  # ... less than half as fast as Fig. 5's fit ...
    assert fit.tp_comm_s[1] > 2 * fit.tp_comm_s[0]
    # ... which Fig. 5 rules out
    assert all(bar < paper_bar - 7 for bar, paper_bar in zip(fit.mp_bars[1:], sweep.PAPER_MP[1:]))
    dp = consistency.data_parallel("plans/gpt2.tp", prof, prepared)
    assert dp.dp_comm_s == pytest.approx(0.33, abs=0.02)
    # overlap meets the 512-GPU bar
    assert dp.overlapped[-1] == pytest.approx(sweep.PAPER_MPDP[-1], abs=1.0)
    assert dp.overlapped[1] - sweep.PAPER_MPDP[1] > 8  # and misses the 128-GPU one
    text = consistency.markdown(fit, dp)
    assert "1.62/2.34/2.98×" in text and "2.3× apart" in text
