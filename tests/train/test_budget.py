"""`dtp train --max-rank-memory`: a model whose training state does not fit one rank's budget is
refused at tp 1 and trains at tp 2, where each rank materialises only its shards."""

from __future__ import annotations

import json

import pytest

from dtp.cli import main

# gpt2-tiny: 482304 B of float32 parameters, × 4 (grad, AdamW moments) = 1929216 B
BUDGET = 1_500_000
TRAIN = [
    "train",
    "plans/gpt2.tp",
    "gpt2-tiny",
    "--steps",
    "2",
    "--batch",
    "2",
    "--seq",
    "16",
    "--warmup",
    "0",
    "--eval-every",
    "2",
    "--device",
    "cpu",
    "--max-rank-memory",
    str(BUDGET),
]


def test_too_big_for_one_rank_trains_at_tp2(repo, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text((repo / "README.md").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    train = TRAIN + ["--data", str(text)]
    assert main(train + ["--tp", "1", "--out", str(tmp_path / "tp1")]) == 2
    err = capsys.readouterr().err
    assert (
        "at --tp 1 --dp 1 a rank would hold 1.8 MiB (1929216 B) of parameters, gradients and AdamW "
        "state, "
        "over --max-rank-memory 1.4 MiB (1500000 B)"
    ) in err
    assert not (tmp_path / "tp1" / "metrics.jsonl").exists()  # refused before any rank started

    assert main(train + ["--tp", "2", "--out", str(tmp_path / "tp2")]) == 0
    summary = json.loads((tmp_path / "tp2" / "summary.json").read_text())
    held = summary["param_bytes_per_rank"]  # measured on each rank: its local shards
    assert held == summary["param_bytes_table"] == [251136, 251136]
    assert all(4 * b <= BUDGET for b in held)
    assert len(summary["losses"]) == 2 and all(0 < loss < 10 for loss in summary["losses"])


@pytest.mark.parametrize("value", ["0", "-5", "12XB", "lots"])
def test_bad_budget_exits_2(repo, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["train", "plans/gpt2.tp", "gpt2-tiny", "--max-rank-memory", value])
    assert exc.value.code == 2
    assert (
        f"expected a positive size like 3000000, 512KiB or 1.5GiB, got '{value}'"
        in capsys.readouterr().err
    )
