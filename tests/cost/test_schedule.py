"""The analytic communication schedule equals what CommDebugMode measures, for every shipped plan."""

from __future__ import annotations

import pytest
from conftest import REPO

from dtp import models
from dtp.checks.checker import check
from dtp.cost.schedule import schedule, summarize
from dtp.lang.parse import load
from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig

# Every plan in plans/ with the model it is written for (a new plan must be added here).
PLAN_MODELS = {
    "gpt2.tp": "gpt2-tiny",
    "gpt2-sp.tp": "gpt2-tiny",
    "tinylm.tp": "dtp.models.examples:tiny_lm",
    "hf-llama.tp": "dtp.models.examples:tiny_llama",
    "llama.tp": "llama-tiny",
    "llama-packed.tp": "llama-tiny-packed",
    "llama-repeat.tp": "llama-tiny",
    "llama-sp.tp": "llama-tiny",
}
SHIPPED = sorted(p.name for p in (REPO / "plans").glob("*.tp"))


def test_every_shipped_plan_is_covered():
    assert SHIPPED == sorted(PLAN_MODELS)


@pytest.mark.parametrize("plan", SHIPPED)
def test_measured_collectives_equal_analytic(repo, plan):
    report = launch_apply(
        RunConfig(plan=f"plans/{plan}", model=PLAN_MODELS[plan], tp=2, batch=2, seq=8, steps=1)
    )
    assert report.parity["ok"], report.parity
    measured, analytic = report.collectives, report.analytic_collectives
    for key in ("total", "by_op", "forward", "backward", "bytes", "sent_bytes"):
        assert measured[key] == analytic[key], key


def _analytic(plan: str, model: str, tp: int, batch: int = 1, seq: int = 1024) -> dict:
    m = models.build(model)
    checked = check(load(REPO / "plans" / plan), m, tp)
    return summarize(schedule(checked, tp, batch, seq), tp)


@pytest.mark.parametrize("model, layers", [("megatron-1.2b", 40), ("megatron-8.3b", 72)])
def test_gpt_without_sequence_parallelism_is_megatrons_count(model, layers):
    # 4 all-reduces per block (2 forward, 2 backward) + embedding + head input gradient + 3 in the
    # loss
    s = _analytic("gpt2.tp", model, 8)
    assert s["by_op"] == {"all_reduce": 4 * layers + 1 + 1 + 3}
    assert s["forward"] == {"all_reduce": 2 * layers + 1 + 3}
    assert s["backward"] == {"all_reduce": 2 * layers + 1}


def test_sequence_parallel_sends_the_same_activation_bytes():
    # Megatron-SP: an all-reduce is a reduce-scatter plus an all-gather, so the activations cost the
    # same. On top, SP all-reduces the replicated LayerNorm gradients, and GPT-2 (whose learned
    # positions are added to the replicated embedding output) all-gathers the gradient of that sum's
    # sequence split.
    tp, batch, seq, C, L = 4, 2, 64, 64, 2
    plain = _analytic("gpt2.tp", "gpt2-tiny", tp, batch, seq)
    sp = _analytic("gpt2-sp.tp", "gpt2-tiny", tp, batch, seq)
    norm_grads = (2 * L + 1) * 2 * C * 4  # ln_1, ln_2 per block and ln_f; weight and bias
    embedding_split = batch * seq * C * 4
    ring = lambda op, b: (2 if op == "all_reduce" else 1) * b * (tp - 1) // tp
    assert sum(sp["sent_bytes"].values()) == (
        sum(plain["sent_bytes"].values())
        + ring("all_reduce", norm_grads)
        + ring("all_gather", embedding_split)
    )


def test_sequence_parallel_saves_activation_memory(repo):
    kw = dict(model="gpt2-tiny", tp=2, batch=2, seq=32, steps=1)
    plain = launch_apply(RunConfig(plan="plans/gpt2.tp", **kw))
    sp = launch_apply(RunConfig(plan="plans/gpt2-sp.tp", **kw))
    assert plain.parity["ok"] and sp.parity["ok"]
    # the LayerNorm inputs (5 of B×T×C floats) are halved; everything else is the same
    saved = 5 * 2 * 32 * 64 * 4 // 2
    for a, b in zip(plain.activation_bytes_per_rank, sp.activation_bytes_per_rank):
        assert a - b >= saved * 0.9, (a, b)


def test_model_and_data_parallel_2x2(repo):
    # FSDP2 over dp on top of the tp plan: per block unit one parameter all-gather forward, one
    # again in backward and one gradient reduce-scatter; the root unit (wte = lm_head, wpe, ln_f) is
    # not re-gathered.
    report = launch_apply(
        RunConfig(plan="plans/gpt2.tp", model="gpt2-tiny", tp=2, dp=2, batch=4, seq=16, steps=2)
    )
    assert report.parity["ok"], report.parity
    measured, analytic = report.collectives, report.analytic_collectives
    for key in ("total", "by_op", "forward", "backward", "bytes", "sent_bytes"):
        assert measured[key] == analytic[key], key
    assert measured["by_op"] == {"all_reduce": 13, "all_gather": 2 * 2 + 1, "reduce_scatter": 2 + 1}
    C = 64
    block = 4 * (
        (3 * C * C + 3 * C) // 2
        + C * C // 2
        + C
        + (4 * C * C + 4 * C) // 2
        + 4 * C * C // 2
        + C
        + 4 * C
    )
    root = 4 * (256 * C // 2 + 64 * C + 2 * C)
    assert measured["bytes"]["reduce_scatter"] == 2 * block + root
    assert measured["bytes"]["all_gather"] == 2 * (2 * block) + root
    # every rank holds a quarter of the tp-local parameters
    assert report.param_bytes_per_rank == [(2 * block + root) // 2] * 4
    assert report.ideal_param_bytes_per_rank == (2 * block + root) // 2


def test_sequence_parallel_at_tp_4(repo):
    report = launch_apply(
        RunConfig(plan="plans/gpt2-sp.tp", model="gpt2-tiny", tp=4, batch=2, seq=8, steps=2)
    )
    assert report.parity["ok"], report.parity
    for key in ("by_op", "forward", "backward", "bytes", "sent_bytes"):
        assert report.collectives[key] == report.analytic_collectives[key], key


def test_bfloat16_run_matches_its_schedule(repo):
    # in bfloat16 the cross-entropy's max, sum of exponentials and target logit travel as float32
    # (dtp reads bf16 logits in float32; torch's loss_parallel sends the target logit in bf16)
    report = launch_apply(
        RunConfig(
            plan="plans/gpt2.tp", model="gpt2-tiny", tp=2, batch=2, seq=8, steps=1, dtype="bfloat16"
        )
    )
    assert report.parity["ok"], report.parity
    activation = 2 * 8 * 64 * 2
    assert report.collectives["bytes"] == {"all_reduce": 10 * activation + 3 * (16 * 4)}
    assert report.collectives["bytes"] == report.analytic_collectives["bytes"]


def test_tp_1_is_plain_pytorch_unless_a_one_rank_dtensor_model_is_asked_for():
    model = models.build(models.resolve("gpt2-tiny"), device="meta")
    checked = check(load(str(REPO / "plans/gpt2.tp")), model, 1)
    # apply and train at tp 1, dp 1: no DTensor, no collective
    assert schedule(checked, 1, 2, 16) == []
    one_rank = summarize(schedule(checked, 1, 2, 16, plain=False), 1)
    # the vocab-parallel loss on one rank
    assert (one_rank["forward"], one_rank["backward"]) == ({"all_reduce": 3}, {})
