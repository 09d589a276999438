"""A calibrated CPU profile's mechanisms (this machine's step time), checked on the
model's arithmetic with a fixed synthetic profile (no timing here), and the FSDP × TP rows of
torchtitan's async-TP benchmark."""

from __future__ import annotations

import pytest

from dtp import models
from dtp.checks.checker import check
from dtp.lang.parse import load as load_plan
from dtp.simulate import flops as fl
from dtp.simulate import reproduce
from dtp.simulate.flops import Flops
from dtp.simulate.kernels import compute_parts
from dtp.simulate.model import Run
from dtp.simulate.ops import Op, Recorder
from dtp.simulate.profile import Link, parse

CPU = """name: cpu
gpu:
  name: c
  peak_tflops: {fp32: 0.001}          # 1 GFLOP/s: a GFLOP costs a second
  achieved_fraction: 1.0
  memory_GiB: 1
  hbm_GBps: 1
  gemm_efficiency: {1: 0.5}
  gemm_backward_efficiency: {1: 0.25}
  attention_efficiency: 0.5
  attention_backward: 3.0
  op_GBps: {gelu.tanh: 2, _log_softmax: 4}
  op_backward: {gelu.tanh: 1.5}
  op_overhead_us: 1000
  backward_overhead_us: 3000
  async_ops: false
node:
  gpus: 8
  compute_slots: 2
  rank_share: {2: 0.8, 4: 0.4}
  intra: {busbw_GBps: 1, latency_us: 100}
  inter: {busbw_GBps: 1, latency_us: 100}
  worlds: {4: {busbw_GBps: 0.5, latency_us: 700}}
"""


def test_each_calibrated_mechanism_prices_its_own_ops():
    prof = parse(CPU, "cpu")
    run = Run(1, 1, 1, 1, 1, "fp32", "none", "sgd")
    # kind, flops, elements, name → (forward s, backward s) by hand; overheads 1 ms forward, 3 ms
    # backward
    one = {
        ("gemm", 10**9, 0, ""): (1 / 0.5, 2 / 0.25),  # 1 GFLOP at half rate; dx and dW at a quarter
        # SDPA at half the GEMM rate, backward 3×
        ("attention", 10**9, 0, ""): (1 / 0.5, 3 * 1 / 0.5),
        # 4 GB over its own 2 GB/s, backward 1.5×
        ("memory", 0, 10**9, "gelu.tanh"): (4 / 2, 1.5 * 4 / 2),
        ("memory", 0, 10**9, "mul"): (4 / 1, 2 * 4 / 1),  # no figure: hbm_GBps, backward 2×
    }
    for (kind, flops, elements, name), (fwd, bwd) in one.items():
        ops = Flops(1, (), (Op(kind, flops, elements, False, True, 1, name),))
        parts = compute_parts(ops, run, prof)
        assert parts.block_forward == pytest.approx(fwd + 1e-3), name or kind
        assert parts.block_backward == pytest.approx(bwd + 3e-3), name or kind
    # four ranks on this node: each gets 0.4 of its rate (measured rank_share), dispatch included
    ops = Flops(1, (), (Op("memory", 0, 10**9, False, True, 1, "mul"),))
    shared = compute_parts(ops, Run(4, 1, 1, 1, 1, "fp32", "none", "sgd"), prof, prof.share(4))
    assert shared.block_forward == pytest.approx((4 + 1e-3) / 0.4)
    # 8: beyond the table, 2 / 8
    assert [prof.share(n) for n in (1, 2, 3, 4, 8)] == [0.8, 0.8, 0.4, 0.4, 0.25]
    assert (
        prof.link_for(4, prof.intra) == Link(0.5, 700)
        and prof.link_for(2, prof.intra) == prof.intra
    )


def test_the_loss_is_recorded_and_priced_only_where_measured(repo):
    model = models.build(models.resolve("gpt2-tiny"), device="meta")
    f = fl.count(model, 16, check(load_plan("plans/gpt2.tp"), model, 2).resolution)
    loss = {o.name: o for o in f.ops if o.loss}
    assert set(loss) == {"_log_softmax", "nll_loss_forward"}
    # gpt2.tp's head is vocabulary-parallel
    assert all(o.split and not o.in_block for o in loss.values())
    assert loss["_log_softmax"].elements == 2 * 16 * 256  # logits in and out: seq × vocab each
    cpu = parse(CPU, "cpu")
    run = Run(2, 1, 1, 1, 16, "fp32", "none", "sgd")
    only = Flops(16, (), tuple(loss.values()))
    # _log_softmax has a figure: 4 bytes × 8192 elements ÷ 2 ranks over 4 GB/s; NLL has none: not
    # priced
    assert compute_parts(only, run, cpu).other_forward == pytest.approx(4 * 8192 / 2 / 4e9 + 1e-3)
    gpu = parse(
        CPU.replace("op_GBps: {gelu.tanh: 2, _log_softmax: 4}", "op_GBps: {gelu.tanh: 2}"), "gpu"
    )
    assert compute_parts(only, run, gpu).total == 0.0
    # the vocabulary-parallel loss measured as a whole at tp 2: priced on the log-softmax's traffic,
    # NLL folded in
    whole = parse(
        CPU.replace(
            "_log_softmax: 4}",
            "_log_softmax: 4, loss.parallel2: 1}\n  op_backward: {loss.parallel2: 0.5}",
        ).replace("  op_backward: {gelu.tanh: 1.5}\n", ""),
        "whole",
    )
    parts = compute_parts(only, run, whole)
    assert parts.other_forward == pytest.approx(4 * 8192 / 2 / 1e9 + 1e-3)
    assert parts.other_backward == pytest.approx(0.5 * 4 * 8192 / 2 / 1e9 + 3e-3)


def test_op_names_carry_the_kernel_variant():
    import torch
    import torch.nn.functional as F

    recorder = Recorder()
    with recorder:
        F.gelu(torch.ones(4), approximate="tanh")
        F.gelu(torch.ones(4))
    assert [r[4] for r in recorder.raw if r[4].startswith("gelu")] == ["gelu.tanh", "gelu"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("gpu: {op_GBps: {gelu: 0}}", "'gpu.op_GBps[gelu]' = 0 is out of range"),
        ("gpu: {op_GBps: [1]}", "must be a mapping of 1–64 entries"),
        (
            "node: {worlds: {1: {busbw_GBps: 1, latency_us: 1}}}",
            "'node.worlds key' = 1 is out of range",
        ),
        ("node: {worlds: {2: {busbw_GBps: 1}}}", "needs busbw_GBps and latency_us"),
        ("node: {rank_share: {2: 1.5}}", "'node.rank_share[2]' = 1.5 is out of range"),
    ],
)
def test_calibrated_keys_are_validated(text, message):
    with pytest.raises(Exception) as err:
        parse("name: x\n" + text + "\n", "p.yaml")
    assert type(err.value).__name__ == "UsageError" and message in str(err.value), str(err.value)


def test_gemm_table_merges_shapes_of_equal_size():
    from dtp.simulate.calibrate_ops import _table

    rates = {1.0: [50.0], 1.04: [70.0], 2.0: [100.0]}  # 1.0 and 1.04 GFLOP within 5 %: one point
    assert _table(rates, 100.0) == {1.0: pytest.approx(0.6), 2.0: 1.0}


def test_torchtitan_fsdp_tp_rows_on_h100(repo):
    """torchtitan's bf16 FSDP × TP rows (benchmarks/asyncTP_llama3_h100_2025-06): TP 8 in a host,
    FSDP across hosts, full and per-op recomputation, within ±15 % with only the FSDP-8 row's GEMM
    fraction fitted."""
    rows = [
        o
        for o in reproduce.predict(reproduce.SOURCES["torchtitan"])
        if o.row.run.tp == 8 and o.row.published_s is not None
    ]
    assert {(o.row.model, o.row.run.recompute, o.row.run.dp) for o in rows} == {
        ("llama3-70b", "full", 32),
        ("llama3-8b", "op", 8),
    }
    assert all(o.row.run.precision == "bf16" and o.row.run.fsdp for o in rows)
    published = sorted(round(o.row.published_s, 3) for o in rows)
    assert published == [2.555, 2.807, 25.113, 27.43]  # local batch × 8192 ÷ (TPS per GPU × 8)
    for o in rows:
        assert abs(o.error) <= 0.15 and o.result.fits, (o.row.label, o.error)


def test_every_gpu_profile_has_a_cited_gemm_size_table():
    from dtp.simulate.profile import load, profile_names

    for name in profile_names():
        prof = load(name)
        table = dict(prof.gemm_efficiency)
        assert table and max(table.values()) == 1.0, name  # fractions of the large-GEMM rate
        assert list(table.values()) == sorted(table.values()), name  # larger GEMMs never slower
    h100 = dict(load("h100-sxm").gemm_efficiency)
    # OpenXLA sm_90: 1024³ ~230 TF, 2048³ ~633 TF of ~800
    assert h100[2.15] == 0.29 and h100[17.2] == 0.79
    # Calculon, ÷ 0.95
    assert dict(load("a100-80gb").gemm_efficiency) == {1.0: 0.632, 16.0: 0.947, 128.0: 1.0}
