"""The fuzzer: a seeded CI budget, saved regressions, and planted defects it must find."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, autograd_like_thread, dtp_cli
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import RowwiseParallel

import dtp.compiler.compiler
import dtp.compiler.placed
from dtp.fuzz.cases import Case, mutated_texts, user_cases, zoo_cases
from dtp.fuzz.pool import Pools
from dtp.fuzz.replay import load_checked_case
from dtp.fuzz.runner import evaluate, fuzz, fuzz_parser, save
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles import Style

REGRESSIONS = sorted((REPO / "tests" / "regressions").glob("*.json"))


@pytest.fixture
def pools(repo):
    p = Pools()
    yield p
    p.close()


def test_ci_budget_of_random_plans_holds(pools):
    summary = fuzz(zoo_cases(max_world=4), examples=40, seed=20261202, pools=pools, shrink=False)
    assert summary.failure is None, summary.failure
    assert summary.examples == 40
    assert summary.counts["passed"] >= 15  # most draws are valid plans, not rejections


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_saved_regression_case_passes(pools, path):
    # as `dtp fuzz --replay` reads it: every field checked
    case, error = load_checked_case(str(path))
    assert error  # each was saved with the failure it once showed
    outcome = evaluate(case, pools)
    assert outcome.kind == "passed", outcome.message


def test_save_and_replay_round_trip(tmp_path, repo):
    case = Case("dtp 1\nlm_head: vocab_parallel\n", "gpt2-tiny", tp=2, seq=4, meta={"x": 1})
    path = save(case, "an error", tmp_path)
    assert load_checked_case(str(path)) == (case, "an error")
    assert json.loads(path.read_text())["plan"] == case.plan
    proc = dtp_cli("fuzz", "--replay", str(path))
    # lm_head alone breaks its tie with wte: check rejects it before launch, which is what must
    # happen
    assert proc.returncode == 0
    assert "now: rejected" in proc.stdout


def test_replay_of_a_passing_case_exits_0(repo):
    proc = dtp_cli("fuzz", "--replay", str(REGRESSIONS[0]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "now: passed" in proc.stdout


def test_parser_fuzz_budget():
    seeds = [p.read_text() for p in sorted((REPO / "plans").glob("*.tp"))]
    assert fuzz_parser(mutated_texts(seeds), examples=300, seed=1) == []


def _finds(pools, strategy, examples: int) -> str:
    summary = fuzz(strategy, examples=examples, seed=7, pools=pools, shrink=False)
    assert summary.failure is not None, (
        f"no failure in {summary.examples} examples: {dict(summary.counts)}"
    )
    return summary.failure[1]


def test_finds_model_that_depends_on_its_local_width(pools):
    plan = (REPO / "plans" / "gpt2.tp").read_text()
    message = _finds(
        pools, user_cases(plan, "tests.fixtures.broken_models:width_dependent", max_world=2), 20
    )
    assert message.startswith("parity failed")


def test_finds_compiler_that_drops_a_reduction(pools, monkeypatch):
    def no_all_reduce(m, module, leaves):  # hands on partial sums as if they were the result
        return RowwiseParallel(
            input_layouts=m.input, output_layouts=Partial(), use_local_output=True
        )

    monkeypatch.setitem(dtp.compiler.compiler.PARALLEL_STYLES, Style.ROWWISE, no_all_reduce)
    assert _finds(pools, zoo_cases(max_world=2), 30).startswith(
        ("parity failed", "collectives differ")
    )


def test_finds_compiler_that_mispacks_qkv(pools, monkeypatch):
    # contiguous rows instead of one slice of each of q, k and v: consistent gathering, wrong
    # attention
    monkeypatch.setattr(dtp.compiler.placed, "pack_parts", lambda t, parts, tp, dim=0: t)
    monkeypatch.setattr(dtp.compiler.placed, "unpack_parts", lambda t, parts, tp, dim=0: t)
    assert _finds(pools, zoo_cases(max_world=2), 30).startswith("parity failed")


def test_finds_off_by_one_in_uneven_vocabulary_shards(pools, monkeypatch):
    def floor_chunks(self, shape, tp, rank=0):
        if self.shard_dim is None:
            return shape
        out = list(shape)
        out[self.shard_dim] = shape[self.shard_dim] // tp + (
            1 if rank < shape[self.shard_dim] % tp - 1 else 0
        )
        return tuple(out)

    monkeypatch.setattr(ParamPlacement, "local_shape", floor_chunks)
    found = _finds(pools, zoo_cases(max_world=2), 30)
    # torch 2.13 runs the mis-sized shards and the byte table differs; torch 2.11's DTensor fails on
    # them first
    assert "parameter bytes per rank" in found or ("the run failed" in found and "size" in found), (
        found
    )


def test_a_pool_rank_killed_by_a_signal_is_named_with_where_it_died(pools):
    fixture = REPO / "tests" / "fixtures" / "broken_models.py"
    line = next(
        i for i, text in enumerate(fixture.read_text().splitlines(), 1) if "string_at(0)" in text
    )
    case = Case(
        (REPO / "plans" / "gpt2.tp").read_text(),
        "tests.fixtures.broken_models:segfault_on_rank1",
        tp=2,
    )
    outcome = evaluate(case, pools)
    assert outcome.kind == "failed"
    assert outcome.message.startswith(
        "accepted by check, but the run failed: rank 1 was killed by SIGSEGV at __init__.py:"
    ), outcome.message
    assert f" string_at <- broken_models.py:{line} forward <- " in outcome.message
    assert evaluate(Case(case.plan, "gpt2-tiny", tp=2), pools).kind == "passed"  # a fresh pool


def test_a_pool_is_spawned_where_autograd_threads_forbid_a_fork(pools):
    """Its queues come from the context its ranks start in (a fork's cannot reach a spawned rank)."""
    with autograd_like_thread():
        outcome = evaluate(Case((REPO / "plans" / "gpt2.tp").read_text(), "gpt2-tiny", tp=2), pools)
    assert outcome.kind == "passed", outcome.message
    assert {type(p).__name__ for p in pools.pools[(2, 1)].procs} == {"SpawnProcess"}


def test_cli_summary(repo):
    proc = dtp_cli("fuzz", "--examples", "4", "--seed", "3", "--max-world", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fuzz: 4 examples" in proc.stdout and "failed" in proc.stdout


def test_replay_of_something_that_is_not_a_case_exits_2(repo, tmp_path):
    bad = tmp_path / "case.json"
    bad.write_text('{"plan": "dtp 1\\n"}')
    for path in (bad, tmp_path / "missing.json"):
        proc = dtp_cli("fuzz", "--replay", str(path))
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"error: cannot replay {path}: not a saved dtp fuzz case")
        assert "Traceback" not in proc.stderr


def test_a_user_model_too_large_for_memory_is_refused_before_any_rank(repo):
    proc = dtp_cli("fuzz", "plans/gpt2.tp", "megatron-8.3b", "--examples", "1", timeout=60)
    assert proc.returncode == 2
    assert (
        proc.stderr.startswith("error: this run needs about ") and "GiB is available" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and proc.stdout == ""
