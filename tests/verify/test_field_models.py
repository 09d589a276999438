"""Model code as the field writes it: torchtitan-, gpt-fast-, nanoGPT- and minGPT-style
models (tests/fixtures/field_models.py) with each codebase's own layout (tests/fixtures/field/*.tp)
pass `dtp check`, reach parity in `dtp apply` with Megatron's collective count, and `dtp plan
--auto` splits what the hand plans do.
"""

from __future__ import annotations

import json

import pytest
from conftest import dtp_cli
from fixtures import field_models

import dtp
from dtp.auto.planner import auto_plan
from dtp.cost.schedule import schedule, summarize

PLANS = "tests/fixtures/field"
MODELS = "tests.fixtures.field_models"
HAND = [
    ("titan", "titan"),
    ("titan-sp", "titan"),
    ("gptfast", "gptfast"),
    ("nanogpt", "nanogpt"),
    ("mingpt", "mingpt"),
    ("partial-bound", "partial_bound"),
]


@pytest.mark.parametrize(("plan", "factory"), HAND)
def test_each_codebase_layout_passes_check(repo, plan, factory):
    model = getattr(field_models, factory)()
    checked = dtp.check(dtp.load(f"{PLANS}/{plan}.tp"), model, 2)
    assert checked.tp == 2 and not checked.warnings


def test_torchtitan_layout_costs_megatron_collectives(repo):
    """torchtitan's own plan for its Llama 3 at 2 layers: 13 all-reduces per training step (2 per
    layer each way, the embedding's forward one, the vocabulary-parallel loss's), the count
    torchtitan's own apply_tp measures."""
    model = field_models.titan()
    steps = schedule(
        dtp.check(dtp.load(f"{PLANS}/titan.tp"), model, 2), 2, batch=2, seq=16, model=model
    )
    assert summarize(steps, 2)["by_op"] == {"all_reduce": 13}


@pytest.mark.parametrize(
    ("plan", "factory", "by_op"),
    [
        # torchtitan with SP: 28
        ("titan-sp", "titan", {"all_gather": 10, "all_reduce": 8, "reduce_scatter": 10}),
        # fused wqkv packed=[q, kv, kv] + sets; forward(idx, input_pos)
        ("gptfast", "gptfast", {"all_reduce": 8}),
        # (logits, loss) with targets; tied vocabulary-parallel head
        ("nanogpt", "nanogpt", {"all_reduce": 9}),
        ("mingpt", "mingpt", {"all_reduce": 9}),  # the MLP behind a lambda over a ModuleDict
    ],
)
def test_each_codebase_layout_reaches_parity(repo, tmp_path, plan, factory, by_op):
    out = tmp_path / "r.json"
    proc = dtp_cli(
        "apply",
        f"{PLANS}/{plan}.tp",
        f"{MODELS}:{factory}",
        "--tp",
        "2",
        "--steps",
        "2",
        "--json",
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["parity"]["ok"]
    assert report["collectives"]["by_op"] == report["analytic_collectives"]["by_op"] == by_op


def test_nanogpt_attention_split_by_heads_is_refused_before_launch(repo):
    """nanoGPT views heads with `C` from `x.size()`: no `set` can make it a rank's width. Check runs
    the forward on one rank's shapes and refuses at the rule, quoting the model's line, before any
    rank starts."""
    proc = dtp_cli("apply", f"{PLANS}/nanogpt-heads.tp", f"{MODELS}:nanogpt", "--tp", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith(
        f"{PLANS}/nanogpt-heads.tp:7:18: error: transformer.h.0.attn.c_attn: at tp=2 a rank's "
        "share cannot run through transformer.h.*.attn: `k = k.view(B, T, self.n_head, C // "
        "self.n_head).transpose(1, 2)` (field_models.py:"
    ), first
    assert (
        "a width read from a tensor (`x.size()`) cannot" in first and "Traceback" not in proc.stderr
    )


def _claims(text: str, model) -> dict[str, str]:
    res = dtp.check(dtp.parse(text, "<plan>"), model, 2).resolution
    return {path: rule.style.name for path, rule in res.claims.items()}


@pytest.mark.parametrize(
    ("plan", "factory", "summary"),
    [
        ("titan", "titan", "blocks split 2/2, attention whole in 0, MLP whole in 0"),
        ("gptfast", "gptfast", "blocks split 2/2, attention whole in 0, MLP whole in 0"),
        ("nanogpt", "nanogpt", "blocks split 2/2, attention whole in 2, MLP whole in 0"),
        ("mingpt", "mingpt", "blocks split 2/2, attention whole in 2, MLP whole in 0"),
        (
            "partial-bound",
            "partial_bound",
            "blocks split 2/2, attention whole in 0, MLP whole in 0",
        ),
    ],
)
def test_auto_splits_what_each_hand_plan_splits(repo, plan, factory, summary):
    model = getattr(field_models, factory)()
    found = auto_plan(model, factory, 2, scan=False)
    assert found.summary.startswith(summary + "; "), found.summary
    hand = _claims((repo / PLANS / f"{plan}.tp").read_text(), model)
    auto = _claims(found.text, model)
    # every module the hand plan splits, the same way
    assert {p: s for p, s in auto.items() if p in hand} == hand
    if "attention whole in 2" in summary:  # said in the plan, at the block, with the reason
        assert "# attn stays replicated: its forward sizes the heads' output with `C`" in found.text
