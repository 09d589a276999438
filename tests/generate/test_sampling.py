"""`dtp generate --sample`: seeded sampling, token-exact against the unsharded model because every
rank and every reference draws the same Gumbel noise; transformers' logits processors, in its order;
a sampled token that differs is a tie only when rounding of the step's bound can explain it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dtp.cli import main
from dtp.generate.rank import Comparison, Sampling
from dtp.models import hf
from tests.fixtures.decode_paths import PLAN as DECODE_PLAN

PADDED = "5 6 7;8 9 10 11 12 13"  # two prompts of different lengths: the first is left-padded
DECODE = "tests.fixtures.decode_paths"
SAMPLE = ["--sample", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95"]


def _saved_gpt2(tmp_path) -> str:
    """A tiny float64 GPT-2 written by save_pretrained."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf.config("gpt2")).to(torch.float64)
    model.save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2")


def _generate(tmp_path, argv: list[str], name: str = "r") -> dict:
    """`dtp generate ARGV --json`, which must exit 0; its report."""
    out = tmp_path / f"{name}.json"
    assert main(["generate", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("plan", "model", "dtype"),
    [("plans/gpt2.tp", "gpt2-tiny", "float32"), ("plans/hf/gpt2.tp", None, "float64")],
)
def test_sampled_tokens_are_the_unsharded_models_at_tp_2(
    repo, tmp_path, capsys, plan, model, dtype
):
    model = model or _saved_gpt2(tmp_path)
    argv = [plan, model, "--tp", "2", "--dtype", dtype, "--prompt-ids", PADDED]
    report = _generate(tmp_path, [*argv, "--max-new-tokens", "6", *SAMPLE, "--sample-seed", "7"])
    assert report["sampling"] == {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}
    assert report["ok"] and report["matches_unsharded"] and report["ranks_agree"]
    assert report["first_difference"] is None and report["ties"] == []
    assert [len(row) for row in report["tokens"]] == [6, 6]
    # logits compared at all 6 steps, well inside the rule
    assert report["parity"]["logits"]["compared"] == 6 and report["parity"]["logits"]["margin"] < 1
    # sampling adds no collective: the same as greedy's (5 all-reduces, the logits' all-gather)
    assert report["collectives_per_token"] == {"all_reduce": 5, "all_gather": 1}
    out = capsys.readouterr().out
    assert "sampling: temperature 0.9, top-k 40, top-p 0.95, sample seed 7" in out
    assert "token-exact: OK" in out


def test_the_sample_seed_decides_the_tokens(repo, tmp_path):
    argv = ["plans/gpt2.tp", "gpt2-tiny", "--prompt-ids", PADDED, "--max-new-tokens", "6"]
    first = _generate(tmp_path, [*argv, "--sample", "--sample-seed", "1"], "a")["tokens"]
    again = _generate(tmp_path, [*argv, "--sample", "--sample-seed", "1"], "b")["tokens"]
    other = _generate(tmp_path, [*argv, "--sample", "--sample-seed", "2"], "c")["tokens"]
    assert first == again
    assert sum(x != y for a, b in zip(first, other) for x, y in zip(a, b)) >= 6  # of 12 tokens


def test_top_k_1_is_greedy_and_sampling_is_not(repo, tmp_path):
    argv = ["plans/gpt2.tp", "gpt2-tiny", "--prompt-ids", PADDED, "--max-new-tokens", "6"]
    greedy = _generate(tmp_path, argv, "greedy")
    top1 = _generate(tmp_path, [*argv, "--do-sample", "--top-k", "1", "--temperature", "0.3"], "1")
    sampled = _generate(tmp_path, [*argv, "--sample"], "sampled")
    assert greedy["sampling"] is None and top1["tokens"] == greedy["tokens"]
    assert (
        sum(x != y for a, b in zip(sampled["tokens"], greedy["tokens"]) for x, y in zip(a, b)) >= 6
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sample", "--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
        (["--sample", "--temperature", "nan"], "--temperature must be a finite number > 0"),
        (["--sample", "--top-p", "1.5"], "--top-p must be a number in (0, 1], got 1.5"),
        (["--sample", "--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
        (["--sample", "--top-k", "0"], "--top-k must be a positive integer, got 0"),
        (["--sample", "--sample-seed", "-1"], "--sample-seed must be between 0 and"),
        (["--top-k", "5"], "--top-k needs --sample (decoding is greedy without it)"),
        (["--temperature", "0.5"], "--temperature needs --sample"),
    ],
)
def test_bad_sampling_flags_are_one_line_exit_2(repo, tmp_path, capsys, argv, message):
    plan = tmp_path / "plan.tp"
    plan.write_text(DECODE_PLAN)
    assert main(["generate", str(plan), f"{DECODE}:decodes", "--prompt-ids", "1 2", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_model_wrong_only_in_its_cache_path_still_fails_when_sampling(repo, tmp_path, capsys):
    plan = tmp_path / "plan.tp"
    plan.write_text(DECODE_PLAN)
    argv = [str(plan), f"{DECODE}:cache_wrong", "--prompt-ids", PADDED, "--max-new-tokens", "4"]
    assert main(["generate", *argv, *SAMPLE, "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "token-exact: FAILED — from step 2 (decode step 1) the logits leave the unsharded" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_failing_step"] == 2 and report["parity"]["logits"]["margin"] > 100


def test_the_processors_are_transformers_own_in_its_order():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen, dtype=torch.float64) * 3
    logits[0, :10] = 10.0  # ties at the k-th: transformers keeps every tied logit
    for t, k, p in [(0.7, 5, 0.9), (1.0, None, 0.5), (1.3, 12, None), (0.5, 1, 1.0)]:
        warpers = LogitsProcessorList([TemperatureLogitsWarper(t)])
        warpers += [TopKLogitsWarper(k)] if k else []
        warpers += [TopPLogitsWarper(p)] if p else []
        theirs = warpers(torch.zeros(4, 1, dtype=torch.long), logits.clone())
        ours = Sampling(temperature=t, top_k=k, top_p=p).scores(logits)
        assert torch.equal(ours.isinf(), theirs.isinf()), (t, k, p)
        assert torch.equal(ours[~ours.isinf()], theirs[~theirs.isinf()])
    kept = Sampling(top_k=5).scores(logits).isfinite().sum(-1).tolist()
    assert kept[0] == 10 and kept[1:] == [5, 5, 5]


def test_the_gumbel_draws_sample_the_softmax_of_the_scores():
    sampling = Sampling(temperature=0.8, top_k=4, seed=3)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]], dtype=torch.float64)
    p = sampling.scores(logits).softmax(-1)[0]
    n = 4000
    counts = torch.zeros(6)
    for step in range(n):
        counts[sampling.choose(logits, sampling.noise(step, (1, 6)))] += 1
    assert counts[4] == 0 and p[4] == 0  # outside the top 4
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() <= 4 * sigma + 1e-12).all(), (counts / n, p)
    # the noise is (seed, step)'s alone: the same numbers however often it is drawn
    assert torch.equal(sampling.noise(5, (2, 6)), sampling.noise(5, (2, 6)))
    assert not torch.equal(sampling.noise(5, (2, 6)), Sampling(seed=4).noise(5, (2, 6)))


def _judged(sampling: Sampling, truth: torch.Tensor, got: torch.Tensor) -> Comparison:
    """A float64 comparison of one step: the sharded logits `got` against the truth `truth`."""
    compare = Comparison([], None, torch.float64, sampling)
    noise = sampling.noise(1, tuple(truth.shape))
    chosen = sampling.choose(got, noise)
    compare.judge(1, got, chosen, [truth], torch.ones(truth.shape[0], dtype=torch.bool), noise)
    return compare


@pytest.mark.parametrize(("shift", "tie"), [(1e-13, True), (0.25, False)])
def test_a_sampled_token_that_differs_is_a_tie_only_within_the_bound(shift, tie):
    # the truth's perturbed scores all equal, then token 5 ahead by `shift`; the sharded logits
    # put token 2 ahead by as much
    sampling = Sampling(temperature=0.5, seed=0)
    truth = -0.5 * sampling.noise(1, (1, 8))
    truth[0, 5] += shift
    got = truth.clone()
    got[0, 2] += 2 * shift
    compare = _judged(sampling, truth, got)
    seen = (compare.ties or [compare.first_difference])[0]
    assert (seen["token"], seen["truth_token"]) == (2, 5)
    assert seen["truth_gap"] == pytest.approx(shift, rel=1e-3)  # in logit units
    assert seen["bound"] == pytest.approx(1e-10 * truth.abs().max().item() + 1e-12)
    assert compare.ok is tie and (compare.first_difference is None) is tie
    assert len(compare.ties) == tie


def test_a_token_outside_the_truths_top_k_is_a_tie_only_at_its_boundary():
    # top-k 1 keeps one token: the truth's is 5, the sharded model's 3
    sampling = Sampling(top_k=1)
    truth = torch.zeros(1, 8, dtype=torch.float64)
    truth[0, 5], truth[0, 3] = 1.0, 1.0 - 1e-13  # 3 misses the top 1 by rounding
    near = truth.clone()
    near[0, 3] = 1.0 + 1e-13
    within = _judged(sampling, truth, near)
    assert within.ok and within.ties[0]["token"] == 3 and within.ties[0]["truth_gap"] == math.inf
    truth[0, 3] = 0.5  # 3 misses it by 0.5
    far = truth.clone()
    far[0, 3] = 1.5
    beyond = _judged(sampling, truth, far)
    assert not beyond.ok and beyond.ties == []
    assert (
        beyond.first_difference["token"] == 3 and beyond.first_difference["truth_gap"] == math.inf
    )


def test_a_greedy_token_is_a_tie_only_when_its_own_logit_is_within_the_bound():
    # the truth's top two tie, but the sharded model took the third, 0.5 below them
    truth = torch.zeros(1, 8, dtype=torch.float64)
    truth[0, 0], truth[0, 1], truth[0, 2] = 1.0, 1.0 - 1e-13, 0.5
    got = truth.clone()
    got[0, 2] = 1.5
    compare = Comparison([], None, torch.float64)
    compare.judge(1, got, got.argmax(-1), [truth], torch.ones(1, dtype=torch.bool))
    assert compare.ties == [] and compare.first_difference["token"] == 2
    assert compare.first_difference["truth_gap"] == pytest.approx(0.5)
