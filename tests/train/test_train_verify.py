"""`dtp train` beyond apply's three steps: every --verify-every steps the sharded model is compared
with a float64 replay of its own weights on a fixed batch (dtp.train.verify), and the first step's
dropout masks are checked against their tensors' placement (dtp.verify.dropout). The planted models
are in tests/fixtures/user_paths.py and tests/fixtures/dropout_paths.py."""

from __future__ import annotations

import json
import random
import re

import pytest

from dtp.cli import main
from tests.fixtures.dropout_paths import PLAN as DROPOUT_PLAN
from tests.fixtures.user_paths import PLAN

USER, DROPOUT = "tests.fixtures.user_paths", "tests.fixtures.dropout_paths"
WORDS = (
    "the model shards its heads and the loss by vocabulary while every rank keeps a copy of the "
    "norms so that a step of training moves each replica alike and the curves agree"
).split()
_CORPUS = " ".join(random.Random(0).choice(WORDS) for _ in range(3600))[:20000]
TINY = ["--batch", "2", "--seq", "16", "--warmup", "0", "--eval-every", "100", "--device", "cpu"]


@pytest.fixture
def flags(repo, tmp_path):
    """The plans (attention colwise/rowwise) and the flags every run shares: a small corpus."""
    text = tmp_path / "text.txt"
    # a fixed text, not a file of this repository: the planted models' margins depend on the data
    text.write_text(_CORPUS, encoding="utf-8")
    (tmp_path / "user.tp").write_text(PLAN)
    (tmp_path / "dropout.tp").write_text(DROPOUT_PLAN)
    return ["--data", str(text), *TINY]


def _train(tmp_path, flags, model: str, *extra: str, out: str = "out") -> int:
    plan = tmp_path / ("dropout.tp" if model.startswith(DROPOUT) else "user.tp")
    return main(
        ["train", str(plan), model, "--tp", "2", "--out", str(tmp_path / out), *flags, *extra]
    )


def _summary(tmp_path, out: str = "out") -> dict:
    return json.loads((tmp_path / out / "summary.json").read_text())


def _rows(tmp_path, out: str = "out") -> list[dict]:
    text = (tmp_path / out / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_a_model_wrong_after_warm_up_stops_at_the_first_verification_after(tmp_path, flags, capsys):
    # wrong from its sixth train-mode forward: the verification after step 4 runs the fifth, the
    # one after step 8 sees it
    assert _train(tmp_path, flags, f"{USER}:late", "--steps", "12", "--verify-every", "4") == 1
    err = capsys.readouterr().err
    assert re.search(
        r"error: after step 8 the sharded model no longer computes what its own weights do "
        r"unsharded \(a float64 replay on a fixed batch\): logits off by (\S+) and the loss by \S+ "
        r"relative, (\S+)× the bound this step's own rounding allows; the run stopped \(exit 1\)",
        err,
    ), err
    margin = float(re.search(r"relative, (\S+)× the bound", err).group(1))
    assert margin > 100  # measured 2.4e4: the view with the global head count is not rounding
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[3]["verified"]["ok"] and not rows[7]["verified"]["ok"]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_model_whose_state_changes_its_computation_is_replayed_with_that_state(tmp_path, flags):
    # the control: halves its attention input from the sixth forward on, right at any tp
    assert _train(tmp_path, flags, f"{USER}:warm", "--steps", "12", "--verify-every", "4") == 0
    record = _summary(tmp_path)["verify"]
    assert record["ok"] and record["mode"] == "train" and record["skipped"] is None
    assert [c["step"] for c in record["checks"]] == [4, 8, 12]
    assert all(c["ok"] and c["margin"] <= 1.0 for c in record["checks"])
    # the Python counters training moved are copied into the replay
    seen = ["layers.0.attention.seen", "layers.1.attention.seen"]
    assert [c["state_copied"] for c in record["checks"]] == [seen] * 3


def test_a_model_wrong_only_under_autocast_fails_a_bfloat16_run(tmp_path, flags, capsys):
    args = ("--steps", "3", "--dtype", "bfloat16")
    assert _train(tmp_path, flags, f"{USER}:autocast_wrong", *args, out="bad") == 1
    err = capsys.readouterr().err
    assert "error: after step 3 the sharded model no longer computes" in err
    # its logits stay within bfloat16's own rounding (0.92 of the bound on this corpus); the
    # gradients of the path only autocast takes do not (2.6×)
    found = re.search(r"under autocast (\S+)× their bound", err)
    assert found and float(found.group(1)) > 2, err
    assert _train(tmp_path, flags, f"{USER}:masked", *args, out="ok") == 0
    checks = _summary(tmp_path, "ok")["verify"]["checks"]
    assert [c["step"] for c in checks] == [3] and checks[0]["margin"] <= 1.0
    assert 0 < checks[0]["grads_margin"] <= 0.5


@pytest.mark.parametrize("model", [f"{USER}:warm", f"{DROPOUT}:placed"])
def test_verification_leaves_the_run_as_it_found_it(tmp_path, flags, model):
    # buffers, Python counters and the generators (dropout) put back: the same losses, bit for bit
    assert _train(tmp_path, flags, model, "--steps", "8", "--verify-every", "2", out="on") == 0
    assert _train(tmp_path, flags, model, "--steps", "8", "--verify-every", "0", out="off") == 0
    on, off = _summary(tmp_path, "on"), _summary(tmp_path, "off")
    assert len(on["verify"]["checks"]) == 4 and off["verify"]["skipped"] == "--verify-every 0"
    assert on["losses"] == off["losses"] and on["val_loss"] == off["val_loss"]
    if model.endswith("placed"):  # dropout on: compared in eval mode
        assert on["verify"]["mode"] == "eval"


def test_dropout_masked_as_its_tensors_are_placed_trains(tmp_path, flags, capsys):
    assert _train(tmp_path, flags, f"{DROPOUT}:placed", "--steps", "2") == 0
    # per layer: the attention probabilities (sharded heads) and the residual dropout (replicated)
    assert _summary(tmp_path)["dropout"] == {"sites": 4, "problems": [], "generators": []}
    assert "dropout: 4 mask site(s) on the first step masked as their tensors are placed" in (
        capsys.readouterr().out
    )


def test_dropout_from_a_generator_the_model_holds_is_named(tmp_path, flags, capsys):
    assert _train(tmp_path, flags, f"{DROPOUT}:own_generator", "--steps", "2") == 1
    err = capsys.readouterr().err
    assert (
        "error: dropout breaks its tensors' placement on the first step (dtp.verify.dropout): "
        "layers.0.attention (mul) masks a tensor sharded across the tp ranks with the same mask "
        "(drawn from layers.0.attention.gen or layers.1.attention.gen) on every rank, so every "
        "shard drops the same pattern (a generator the model holds is outside dtp's per-rank "
        "streams: draw dropout from the default generator); layers.1.attention (mul) masks"
    ) in err, err
    assert "drop (mul)" not in err and err.count("default generator") == 1
    assert [r["step"] for r in _rows(tmp_path)] == []


def test_dropout_of_a_replicated_tensor_in_a_sharded_region_is_found(tmp_path, flags, capsys):
    # dtp's stream is the per-rank one after the colwise q and k; the input they read is replicated
    assert _train(tmp_path, flags, f"{DROPOUT}:input_dropout", "--steps", "2") == 1
    err = capsys.readouterr().err
    assert (
        "layers.0.attention (mul) masks a tensor every tp rank holds whole (replicated) with a "
        "different mask on each rank, so its copies diverge" in err
    ), err
    assert "layers.1.attention (mul) masks a tensor every tp rank holds whole" in err
