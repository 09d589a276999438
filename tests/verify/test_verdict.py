"""The verdict never passes a broken run: non-finite values on either side, dropout left on; and
dtp's own instrumentation does not break correct plans (an in-place add on a rowwise output, Hugging
Face Phi)."""

from __future__ import annotations

import math

import pytest
from conftest import dtp_cli

from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig
from dtp.verify.report import render

ALL_SIDES = "sharded run and the reference and the unsharded reference"


def _run(model: str, plan: str = "plans/gpt2.tp", **kw):
    return launch_apply(
        RunConfig(plan=plan, model=model, tp=2, batch=2, seq=8, steps=kw.pop("steps", 1), **kw)
    )


def test_nan_logits_exit_1_naming_the_first_tensor(repo):
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "tests.fixtures.verdict_models:nan_logits",
        "--tp",
        "2",
        "--steps",
        "1",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "parity vs unsharded reference: FAILED" in proc.stdout
    assert (
        "non-finite values: logits (step 1) was the first tensor with NaN or inf, in the "
        f"{ALL_SIDES}" in proc.stdout
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "factory, side",
    [
        ("nan_when_sharded", "sharded run"),
        # a reference that proves nothing fails
        ("nan_unless_sharded", "reference and the unsharded reference"),
    ],
)
def test_nan_on_one_side_names_that_side(repo, factory, side):
    parity = _run(f"tests.fixtures.verdict_models:{factory}").parity
    assert not parity["ok"]
    assert parity["nonfinite"] == {"tensor": "logits (step 1)", "quantity": "logits", "side": side}


@pytest.mark.parametrize("lr", [math.nan, math.inf])
def test_non_finite_learning_rate_fails_at_the_first_parameter(repo, lr):
    # RunConfig takes the value as given (the CLI refuses it earlier): the first update poisons
    # every weight
    parity = _run("gpt2-tiny", lr=lr).parity
    assert not parity["ok"] and not parity["params"]["ok"]
    assert parity["logits"]["ok"] and parity["grads"]["ok"]  # all was well before the step
    assert parity["nonfinite"] == {
        "tensor": "transformer.wte.weight (after step 1)",
        "quantity": "params",
        "side": ALL_SIDES,
    }


def test_dropout_failure_says_dropout_is_on_and_how_to_turn_it_off(repo):
    report = _run("tests/fixtures/gpt-dropout.yaml")
    parity = report.parity
    assert not parity["ok"]
    assert parity["dropout"][0] == "transformer.drop (p=0.1)"
    assert "transformer.h.0.attn.resid_dropout (p=0.1)" in parity["dropout"]
    # modules that apply it, not config fields
    assert not any(d.startswith("config.") for d in parity["dropout"])
    text = render(report)
    assert "dropout is on (transformer.drop (p=0.1), transformer.h.0.attn" in text
    assert "turn it off for a parity run (dropout 0 in the model's config" in text


def test_in_place_add_on_a_rowwise_output(repo):
    # Falcon-40B's `mlp_output += attention_output` on the rowwise output (a DTensor under sequence
    # parallelism): torch's CommDebugMode wrapped module outputs in backward-hook views and this
    # failed; a dispatch-level counter changes nothing.
    report = _run("tests.fixtures.verdict_models:inplace_rowwise", plan="plans/gpt2-sp.tp", steps=2)
    assert report.parity["ok"], report.parity
    # gpt2-sp's 14 all-reduces less the 4 of ln_2's weight and bias gradients: a parallel block
    # leaves ln_2 unused
    assert report.collectives["by_op"] == {"all_gather": 10, "reduce_scatter": 9, "all_reduce": 10}


def test_hugging_face_phi(repo):
    pytest.importorskip("transformers")
    report = _run(
        "tests.fixtures.verdict_models:tiny_phi", plan="tests/fixtures/hf-phi.tp", steps=2
    )
    assert report.parity["ok"], report.parity
    # per layer: attention and MLP each 1 forward all-reduce; one shared backward all-reduce of the
    # layer input would be Megatron's, but q/k/v and fc1 are separate modules here: 2 backward ones
    assert report.collectives["total"] > 0


def test_dropout_note_names_only_modules_that_apply_it():
    # GPT-2's config carries summary_first_dropout = 0.1 (for a head this causal LM does not have):
    # no module reads it, so with every Dropout at p = 0 there is nothing to blame
    transformers = pytest.importorskip("transformers")
    from dtp.verify.parity import dropout_sources

    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=8,
        vocab_size=16,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    assert config.summary_first_dropout == 0.1
    assert dropout_sources(transformers.GPT2LMHeadModel(config)) == []
    config.attn_pdrop = 0.2
    assert dropout_sources(transformers.GPT2LMHeadModel(config)) == [
        "transformer.h.0.attn.attn_dropout (p=0.2)"
    ]
