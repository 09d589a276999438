"""Checks that need more than one golden file: the mesh header against --dp, the replication
warning, no false positives on every shipped plan and on the fuzzer's Megatron-correct plans, and
the mutated-plan fuzz strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPO
from hypothesis import HealthCheck, Phase, given, seed, settings

import dtp.checks.flow
from dtp import cli, models
from dtp.checks.advice import replicated_share
from dtp.checks.checker import check
from dtp.errors import PlanError
from dtp.fuzz.cases import MUTATIONS, mutated_cases, zoo_cases
from dtp.fuzz.pool import Pools
from dtp.fuzz.runner import fuzz
from dtp.lang.parse import load, parse

SHIPPED = {
    "gpt2.tp": "gpt2-tiny",
    "gpt2-sp.tp": "gpt2-tiny",
    "llama.tp": "llama-tiny",
    "llama-sp.tp": "llama-tiny",
    "llama-packed.tp": "llama-tiny-packed",
    "llama-repeat.tp": "llama-tiny",
    "hf-llama.tp": "dtp.models.examples:tiny_llama",
    "tinylm.tp": "dtp.models.examples:tiny_lm",
}


def test_every_shipped_plan_is_listed():
    assert sorted(p.name for p in (REPO / "plans").glob("*.tp")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_plan_passes_every_check_at_every_working_tp(name, repo):
    model = models.build(SHIPPED[name], device="meta")
    working = check(load(f"plans/{name}"), model).admissible_tp
    assert 2 in working
    for tp in working:
        checked = check(load(f"plans/{name}"), model, tp)
        assert checked.warnings == ()  # Megatron plans shard almost every byte


HF_PLANS = sorted(p.stem for p in (REPO / "plans" / "hf").glob("*.tp"))


@pytest.mark.parametrize("model_type", HF_PLANS)
def test_shipped_hf_plan_passes_the_layout_flow_on_its_family(model_type, repo):
    """The layout flow knows every layout the HF plans use (OPT's Linears sit directly on the
    layer)."""
    model = models.build(models.resolve(f"dtp.models.hf:{model_type}"), device="meta")
    working = check(load(f"plans/hf/{model_type}.tp"), model).admissible_tp
    # gemma's tiny config has one kv head
    assert working[0] == 1 and (model_type == "gemma" or 2 in working)
    for tp in working[:3]:
        assert check(load(f"plans/hf/{model_type}.tp"), model, tp).warnings == ()


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_mesh_header_must_agree_with_dp(capsys, repo, tmp_path):
    plan = "tests/golden/good/globstar.tp"  # `mesh dp, tp`
    rc, out, err = _cli(capsys, "check", plan, "gpt2-tiny", "--tp", "2", "--dp", "1")
    assert (rc, out) == (2, "")
    assert err.startswith(
        f"{plan}:3:1: error: the plan declares `mesh dp, tp` (data × tensor parallel) but --dp is "
        "1; run it with --dp N (N ≥ 2), or write `mesh tp`\n    mesh dp, tp\n    ^~~~\n"
    )
    assert _cli(capsys, "check", plan, "gpt2-tiny", "--tp", "2", "--dp", "2")[0] == 0
    # no --dp: nothing to disagree with
    assert _cli(capsys, "check", plan, "gpt2-tiny", "--tp", "2")[0] == 0
    headless = tmp_path / "headless.tp"
    headless.write_text(
        "\n".join(
            line
            for line in Path("plans/gpt2.tp").read_text().splitlines()
            if not line.startswith("mesh")
        )
    )
    assert _cli(capsys, "check", str(headless), "gpt2-tiny", "--tp", "2", "--dp", "2")[0] == 0


def test_a_tensor_parallel_plan_admits_data_parallelism(capsys, repo):
    # `mesh tp` names the dimension the rules shard over; every shipped zoo plan says it and runs
    # under --dp
    zoo = [p for p in sorted(Path("plans").glob("*.tp")) if "mesh tp" in p.read_text().splitlines()]
    assert [p.name for p in zoo] == [
        "gpt2-sp.tp",
        "gpt2.tp",
        "llama-packed.tp",
        "llama-sp.tp",
        "llama.tp",
    ]
    for plan in zoo:
        model = (
            "gpt2-tiny"
            if plan.name.startswith("gpt2")
            else "llama-tiny-packed"
            if "packed" in plan.name
            else "llama-tiny"
        )
        assert _cli(capsys, "check", str(plan), model, "--tp", "2", "--dp", "2")[0] == 0, plan
    rc, out, err = _cli(
        capsys,
        "apply",
        "plans/gpt2.tp",
        "gpt2-tiny",
        "--tp",
        "2",
        "--dp",
        "2",
        "--batch",
        "2",
        "--steps",
        "2",
    )
    assert rc == 0, err
    assert "mesh tp=2 dp=2" in out and "parity vs unsharded reference: OK" in out


def test_mostly_replicated_plan_warns_with_the_fraction(capsys, tmp_path):
    path = tmp_path / "head.tp"
    path.write_text("dtp 1\nlm_head: vocab_parallel\n")
    rc, out, err = _cli(capsys, "check", str(path), "llama-tiny", "--tp", "2")
    assert rc == 0 and out.startswith(f"{path}: ok on llama-tiny")
    # llama-tiny: embedding and head 256×64 each, 2 layers of q 64², k and v 64×32, o 64²,
    # gate/up/down 64×128, two norms of 64, a final norm of 64; only the head is sharded
    total = 2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    share, _ = replicated_share(check(load(path), models.build("llama-tiny"), 2).resolution)
    assert share == (total - 256 * 64) / total
    assert err == (
        f"{path}:1:1: warning: this plan leaves 85% of the parameter bytes replicated on every rank "
        ""
        "(largest unsharded: model.embed_tokens 15%, model.layers.*.mlp.gate_proj 15%, "
        "model.layers.*.mlp.up_proj 15%); shard those with colwise/rowwise pairs to save memory\n"
        "    dtp 1\n    ^~~~~\n"
    )


def test_megatron_correct_fuzz_plans_are_never_rejected_by_the_layout_flow(tmp_path, monkeypatch):
    # Whatever check rejects among correct plans (heads or vocabularies that do not divide tp) it
    # rejects with the layout flow switched off too.
    seen = []

    @settings(
        max_examples=150,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed(11)
    @given(zoo_cases())
    def prop(case):
        spec = tmp_path / "model.yaml"
        spec.write_text(yaml.safe_dump(case.model))
        model, plan = models.build(str(spec), device="meta"), parse(case.plan, "fuzz.tp")
        try:
            check(plan, model, case.tp)
            seen.append("ok")
            return
        except PlanError:
            seen.append("rejected")
        with monkeypatch.context() as m:
            m.setattr(dtp.checks.flow, "analyse", lambda *a, **k: None)
            with pytest.raises(PlanError):
                check(plan, model, case.tp)

    prop()
    assert seen.count("ok") >= 50


def test_mutated_strategy_draws_every_mutation():
    kinds = set()

    @settings(
        max_examples=120,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed(3)
    @given(mutated_cases())
    def prop(case):
        assert case.plan.startswith("dtp 1\n")
        kinds.add(case.meta["mutation"])

    prop()
    assert kinds == set(MUTATIONS)


def test_mutated_plans_end_rejected_failed_cleanly_or_passed(repo):
    pools = Pools()
    try:
        summary = fuzz(
            mutated_cases(max_world=2), examples=10, seed=20261202, pools=pools, shrink=False
        )
    finally:
        pools.close()
    assert summary.failure is None, summary.failure
    assert summary.examples == 10 and summary.counts["rejected"] >= 1
