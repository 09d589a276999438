"""`dtp train --compare-tp --dtype bfloat16`: the measured band holds for correct sharding and fails
a wrong one."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from dtp.cli import main
from dtp.train.parity import K, compare

SHORT = [
    "--steps",
    "20",
    "--batch",
    "4",
    "--seq",
    "32",
    "--warmup",
    "4",
    "--eval-every",
    "20",
    "--dtype",
    "bfloat16",
    "--device",
    "cpu",
]


def _run(losses: list[float], val: float) -> dict:
    return {"losses": losses, "val_loss": val, "tokens_per_s": 1.0}


def test_bf16_curves_stay_in_the_band_and_a_wrong_plan_leaves_it(repo, tmp_path, capsys):
    out = tmp_path / "ok"
    assert (
        main(
            [
                "train",
                "plans/gpt2.tp",
                "gpt2-tiny",
                "--compare-tp",
                "1,2",
                *SHORT,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    good = json.loads((out / "compare.json").read_text())
    assert good["ok"] and good["problems"] == [] and good["dtype"] == "bfloat16"
    assert [r["steps"] for r in good["rows"]] == [20, 20]
    assert 0 < good["worst_rel_dloss"] and good["worst_margin"] <= 1.0
    assert good["rows"][1]["val_rel_diff"] <= good["band"]["val"]
    assert "convergence parity: OK" in capsys.readouterr().out

    # A planted sharding bug the checker accepts: gpt2's fused q, k, v sharded as one matrix (no
    # packed=3), so at tp 2 a rank's "heads" mix query, key and value columns. tp 1 is the same
    # model either way.
    broken = tmp_path / "unpacked.tp"
    text = Path("plans/gpt2.tp").read_text()
    assert "colwise(packed=3)" in text
    broken.write_text(text.replace("colwise(packed=3)", "colwise"))
    bad_out = tmp_path / "bad"
    assert (
        main(
            [
                "train",
                str(broken),
                "gpt2-tiny",
                "--compare-tp",
                "1,2",
                *SHORT,
                # the band is what this holds: with the verification on, its gradients under
                # autocast stop the tp 2 run first (9.4× their bound; test below)
                "--verify-every",
                "0",
                "--out",
                str(bad_out),
            ]
        )
        == 1
    )
    bad = json.loads((bad_out / "compare.json").read_text())
    assert not bad["ok"] and bad["problems"][0].startswith("tp=2 leaves the band at step ")
    assert bad["worst_margin"] > 2.0  # measured 6×: well outside, not a borderline call
    # tp 1 runs the same model whichever plan: the difference is the sharding alone
    assert bad["rows"][0]["final_loss"] == good["rows"][0]["final_loss"]
    assert "convergence parity: FAILED" in capsys.readouterr().out


def test_the_band_is_the_noise_twins_running_largest_difference_times_k():
    base = _run([5.0] * 30, 4.0)
    twin = _run([5.0] * 10 + [5.0 * (1 + 1e-5)] * 20, 4.0 * (1 + 1e-5))  # strays from step 11
    f32 = lambda other: compare({1: base, 2: other}, "float32", twin)
    band = f32(base).band
    assert [band.at(s) for s in (1, 10, 11, 30, 31)] == pytest.approx(
        [1e-6, 1e-6, K * 1e-5, K * 1e-5, K * 1e-5]
    )
    assert band.val == pytest.approx(K * 1e-5)  # the last step's band, the twin's val × K
    assert compare({1: base, 2: base}, "float32", _run(twin["losses"], 4.0)).band.val == (
        pytest.approx(K * 1e-5)
    )  # a validation loss the twin matched by chance: the last step's band still
    assert f32(_run([5.0] * 30, 4.0)).ok
    # before the twin strays the band is the floor: one forward's rounding of the loss
    early = f32(_run([5.0, 5.0 * (1 + 2e-6)] + [5.0] * 28, 4.0))
    assert not early.ok and early.worst_at == (2, 2) and early.worst_margin == pytest.approx(2.0)
    assert early.problems == [
        "tp=2 leaves the band at step 2: |Δloss| / loss 2.00e-06 > 1e-06 (1 of 30 steps out)"
    ]
    assert f32(_run([5.0] * 19 + [5.0 * (1 + 9e-5)] + [5.0] * 10, 4.0)).ok
    assert not f32(_run([5.0] * 19 + [5.0 * (1 + 2e-4)] + [5.0] * 10, 4.0)).ok
    assert not f32(_run([5.0] * 30, 4.0 * (1 + 2e-4))).ok  # final validation loss
    nan = f32(_run([5.0] * 10 + [math.nan] + [5.0] * 19, 4.0))
    assert not nan.ok and nan.worst_margin == math.inf
    assert not f32(_run([5.0] * 30, math.nan)).ok
    assert f32(_run([5.0] * 20, 4.0)).problems == ["tp=2 ran 20 steps, tp=1 30"]
    # a twin that went non-finite measures nothing: no band, not a band of infinity
    broken = compare({1: base, 2: base}, "float32", _run([5.0] * 29 + [math.nan], 4.0))
    assert broken.problems == ["the noise twin did not run every step with a finite loss: no band"]
    # bfloat16's floor: its own rounding of one forward
    assert compare({1: base, 2: base}, "bfloat16", base).band.at(1) == 1e-3


def test_a_plan_error_at_any_compared_tp_is_exit_2_before_a_rank_starts(repo, tmp_path, capsys):
    plan = tmp_path / "unpaired.tp"
    plan.write_text(
        Path("plans/gpt2.tp")
        .read_text()
        .replace("    mlp.c_proj: rowwise", "    mlp.c_proj: replicate")
    )
    assert (
        main(
            [
                "train",
                str(plan),
                "gpt2-tiny",
                "--compare-tp",
                "1,2",
                "--steps",
                "3",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        f"{plan}:13:15: error: transformer.h.0.mlp.c_fc (and 1 more module): colwise output" in err
    )
    assert not (tmp_path / "o" / "tp1").exists()  # checked for tp 2 before tp 1 trained


@pytest.mark.parametrize("value", ["2", "1,1", "0,2"])
def test_compare_tp_needs_two_distinct_sizes(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "plans/gpt2.tp", "gpt2-tiny", "--compare-tp", value])
    assert exit_.value.code == 2
    assert (
        f"argument --compare-tp: expected two or more distinct positive tp sizes, got '{value}'"
        in capsys.readouterr().err
    )


def test_bf16_verification_catches_the_unpacked_plan_before_the_band(repo, tmp_path, capsys):
    # the same planted bug, one bfloat16 run with the default verification: its logits stay near
    # bfloat16's own rounding, the gradients of the mixed heads do not
    broken = tmp_path / "unpacked.tp"
    broken.write_text(Path("plans/gpt2.tp").read_text().replace("colwise(packed=3)", "colwise"))
    args = ["train", str(broken), "gpt2-tiny", "--tp", "2", *SHORT, "--out", str(tmp_path / "o")]
    assert main(args) == 1
    err = capsys.readouterr().err
    found = re.search(r"under autocast (\S+)× their bound", err)
    assert found and float(found.group(1)) > 2, err
