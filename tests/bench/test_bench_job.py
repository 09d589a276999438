"""A benchmark configuration is a job like `dtp apply`'s: its settings refused once, one message per
condition, before any rank starts; its plan text checked once, in the parent, by the one
pre-flight; the ranks parse that text and never check it again."""

from __future__ import annotations

import os
import sys

import pytest

from dtp.bench import scaling
from dtp.bench.run import Bench
from dtp.checks import checker
from dtp.errors import PlanError, UsageError

TINY = dict(n_layer=1, n_head=4, n_embd=32, vocab_size=64, seq=8, batch=2, tp=2, samples=3)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_embd": 0}, "n_embd must be a positive integer, got 0"),
        ({"n_head": True}, "n_head must be a positive integer, got True"),
        ({"samples": -3}, "--samples must be a positive integer, got -3"),
        ({"warmup": -1}, "warmup must be an integer ≥ 0, got -1"),
        ({"arms": ("dtp", "fast")}, "arms must name some of dtp, hand, megatron, dtp-compile"),
        ({"arms": ()}, "got none"),
        ({"tp": 0}, "--tp must be a positive integer, got 0"),
        ({"batch": 3, "dp": 2}, "--batch 3 (the global batch) must divide by --dp 2"),
        ({"device": "tpu"}, "--device must be one of auto, cpu, cuda, got 'tpu'"),
        ({"dtype": "bfloat16"}, "--dtype must be one of float32, got 'bfloat16'"),
    ],
)
def test_a_configuration_refuses_each_bad_setting_in_one_message(change, message):
    with pytest.raises(UsageError) as err:
        scaling.Config(**TINY | change)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kind": "huge"}, "the size must be one of full, quick, smoke, got 'huge'"),
        ({"tps": (2, 3)}, "--tp must be one of 1, 2, 4, got 3"),
        ({"samples": 2}, "--samples must be an integer from 3 to 1000, got 2"),
        ({"repeats": 0}, "--repeats must be an integer from 1 to 10, got 0"),
        ({"device": "tpu"}, "--device must be cpu or cuda, got 'tpu'"),
    ],
)
def test_a_bench_run_refuses_each_bad_setting_in_one_message(change, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        Bench(**change)


def test_the_pre_flight_checks_the_plan_against_the_gpt_at_its_tp():
    """6 heads do not split over 4 ranks: the plan's colwise(packed=3) line is refused at its
    position, before any rank starts."""
    with pytest.raises(PlanError) as err:
        scaling.preflight(scaling.Config(**TINY | {"n_head": 6, "n_embd": 48, "tp": 4}))
    first = err.value.render().splitlines()[0]
    assert first.startswith("plans/gpt2.tp:11:18: error: transformer.h.0.attn.c_attn: 6 attention")
    assert "do not divide by tp=4" in first


def test_a_plan_text_naming_no_module_is_refused_at_its_line():
    text = scaling.PLAN.replace("mlp.c_fc: colwise", "mlp.c_fcc: colwise")
    with pytest.raises(PlanError) as err:
        scaling.preflight(scaling.Config(**TINY | {"plan_text": text}))
    assert err.value.render().startswith(
        "plans/gpt2.tp:13:5: error: pattern 'transformer.h.*.mlp.c_fcc' matches no module"
    )


def test_ranks_run_the_checked_text_without_checking_it_again(monkeypatch):
    """`check` runs once per configuration, in the parent; a rank that called it would fail the
    run (the ranks are forked, so they inherit the planted `check`)."""
    real, parent, calls = checker.check, os.getpid(), []

    def check(*args, **kwargs):
        if os.getpid() != parent:
            raise AssertionError("a rank checked the plan again")
        calls.append(args[2])
        return real(*args, **kwargs)

    for module in list(sys.modules.values()):  # every module that took `check` by name
        if (
            getattr(module, "__name__", "").startswith("dtp")
            and getattr(module, "check", None) is real
        ):
            monkeypatch.setattr(module, "check", check)
    result = scaling.run(scaling.preflight(scaling.Config(**TINY | {"warmup": 0})))
    assert result["ok"], result.get("error")
    assert calls == [2]  # once, at the configuration's tp
    assert result["collectives"]["dtp"] == result["collectives"]["megatron"] == {"all_reduce": 9}
    assert result["config"]["plan"] == "plans/gpt2.tp" and "plan_text" not in result["config"]
