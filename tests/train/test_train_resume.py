"""`dtp train --save-every/--checkpoint/--resume`: a resumed run continues the uninterrupted one
exactly at the same tp, within float32 tolerance at another tp (DCP reshards), and bad resumes are
exit 2 before any rank."""

from __future__ import annotations

import json

import pytest
from conftest import dtp_cli

from dtp.cli import main

# A constant learning rate (--min-lr = --lr, no warm-up): the schedule then does not depend on
# --steps, so a 3-step run that is resumed to 6 follows the 6-step run's schedule.
TINY = [
    "plans/gpt2.tp",
    "gpt2-tiny",
    "--batch",
    "2",
    "--seq",
    "16",
    "--lr",
    "1e-2",
    "--min-lr",
    "1e-2",
    "--warmup",
    "0",
    "--eval-every",
    "100",
    "--device",
    "cpu",
]
RTOL = 1e-4


def _train(*args: str):
    result = dtp_cli("train", *TINY, *args, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def _losses(out) -> dict[int, float]:
    return {
        m["step"]: m["loss"]
        for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 6 steps at tp 2, and 3 steps saved then resumed to 6 at tp 2 and at dp 2 ×
    tp 1."""
    root = tmp_path_factory.mktemp("resume")
    _train("--tp", "2", "--steps", "6", "--out", str(root / "full"))
    saved = _train(
        "--tp",
        "2",
        "--steps",
        "3",
        "--save-every",
        "3",
        "--checkpoint",
        str(root / "ck"),
        "--out",
        str(root / "first"),
    )
    resumed = {
        2: _train(
            "--tp", "2", "--steps", "6", "--resume", str(root / "ck"), "--out", str(root / "tp2")
        )
    }
    # dp 2 × tp 1 (FSDP2), saving at the end after the final evaluation (FSDP2 leaves the root
    # gathered there)
    resumed[1] = _train(
        "--tp",
        "1",
        "--dp",
        "2",
        "--steps",
        "6",
        "--resume",
        str(root / "ck"),
        "--checkpoint",
        str(root / "ck-dp"),
        "--out",
        str(root / "tp1"),
    )
    return root, saved, resumed


def test_resume_at_the_same_tp_continues_bit_exactly(runs):
    root, saved, resumed = runs
    full, first, again = _losses(root / "full"), _losses(root / "first"), _losses(root / "tp2")
    assert list(full) == [1, 2, 3, 4, 5, 6]
    assert first == {s: full[s] for s in (1, 2, 3)}  # same init, same batches, same (constant) lr
    assert list(again) == [4, 5, 6]
    # bit-equal: model, AdamW state, step all restored
    assert again == {s: full[s] for s in (4, 5, 6)}
    assert again[4] != pytest.approx(full[1], rel=RTOL)  # continued from step 3, not restarted
    ck = json.loads((root / "first" / "summary.json").read_text())["checkpoints"]
    assert [c["step"] for c in ck] == [3] and ck[0]["bytes"] > 1e6 and ck[0]["seconds"] > 0
    last = json.loads((root / "first" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["checkpoint_bytes"] == ck[0]["bytes"]
    assert f"checkpoint: {root / 'ck'} saved after step 3" in saved.stdout
    summary = json.loads((root / "tp2" / "summary.json").read_text())
    assert summary["start_step"] == 3 and summary["resumed"]["step"] == 3
    assert (
        summary["resumed"]["path"] == str(root / "ck")
        and summary["resumed"]["bytes"] == ck[0]["bytes"]
    )
    assert f"resumed from {root / 'ck'} at step 3" in resumed[2].stdout


def test_resume_at_another_tp_and_dp_reshards(runs):
    root, _, resumed = runs
    full, at_tp1 = _losses(root / "full"), _losses(root / "tp1")
    assert list(at_tp1) == [4, 5, 6]
    for step in (4, 5, 6):
        assert at_tp1[step] == pytest.approx(full[step], rel=RTOL), step
    assert at_tp1[4] != pytest.approx(full[1], rel=RTOL)
    summary = json.loads((root / "tp1" / "summary.json").read_text())
    assert summary["config"]["tp"] == 1 and summary["config"]["dp"] == 2
    assert [c["step"] for c in summary["checkpoints"]] == [6] and (
        root / "ck-dp" / "COMPLETE"
    ).is_file()
    assert f"checkpoint: {root / 'ck-dp'} saved after step 6" in resumed[1].stdout


def test_missing_resume_directory_exits_2_before_any_rank(repo, tmp_path, capsys):
    code = main(["train", *TINY, "--resume", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: no checkpoint at {tmp_path / 'nope'}"
    assert not (tmp_path / "o").exists()  # refused before the data and the ranks


@pytest.mark.parametrize(
    "args,message",
    [
        (["--save-every", "2"], "error: --save-every needs --checkpoint DIR (where to save)"),
        (
            ["--resume", "{ck}", "--steps", "3"],
            "error: checkpoint {ck} is at step 3, not before --steps 3: nothing left to train "
            "(raise --steps)",
        ),
        (
            ["--resume", "{ck}", "--steps", "6", "--convert", "--compare-tp", "1,2"],
            "error: --compare-tp trains from scratch at each tp; it takes no --checkpoint or "
            "--resume",
        ),
    ],
)
def test_bad_checkpoint_flags_exit_2(repo, runs, tmp_path, capsys, args, message):
    ck = runs[0] / "ck"
    code = main(["train", *TINY, "--out", str(tmp_path / "o"), *[a.format(ck=ck) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and err == message.format(ck=ck) + "\n"


def test_checkpoint_of_another_plan_is_refused_unless_converted(repo, runs, tmp_path, capsys):
    """The checkpoint module's message, before any rank; --convert passes the plan check (and meets
    the next)."""
    ck = runs[0] / "ck"
    other = tmp_path / "other.tp"
    other.write_text(
        open("plans/gpt2.tp")
        .read()
        .replace("plan gpt2-megatron version 1", "plan gpt2-other version 2")
    )
    code = main(
        [
            "train",
            str(other),
            *TINY[1:],
            "--steps",
            "6",
            "--resume",
            str(ck),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        f"error: checkpoint {ck} was written by plan 'gpt2-megatron' version 1 (sha256 "
    )
    assert "not by plan 'gpt2-other' version 2" in err
    assert err.rstrip().endswith("for this plan (`dtp train --convert`)")
    code = main(
        [
            "train",
            str(other),
            *TINY[1:],
            "--steps",
            "3",
            "--resume",
            str(ck),
            "--convert",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2 and "is at step 3, not before --steps 3" in capsys.readouterr().err


def test_checkpoint_of_another_model_is_refused_before_any_rank(repo, runs, tmp_path, capsys):
    # gpt2-tiny's names, 4 layers, n_embd 512
    ck, mid = runs[0] / "ck", "tests/fixtures/gpt-train-mid.yaml"
    code = main(
        [
            "train",
            TINY[0],
            mid,
            *TINY[2:],
            "--steps",
            "6",
            "--resume",
            str(ck),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(
        f"error: checkpoint {ck} does not fit {mid}: it has no "
        "model/transformer.h.2.attn.c_attn.bias, "
    )
    assert (
        "model/transformer.h.0.attn.c_attn.weight is [192, 64] in the checkpoint, [1536, 512] here"
        in err
    )
    assert not (tmp_path / "o").exists()


def test_plain_tp1_checkpoints_reshard_both_ways(runs):
    """tp 1 runs as plain PyTorch (no DTensor, no collective); its checkpoint stores the packed
    c_attn in the tp layout all the same, so it resumes at tp 2, and a tp 2 checkpoint resumes at
    plain tp 1."""
    root, _, _ = runs
    _train("--tp", "1", "--steps", "6", "--out", str(root / "plain-full"))
    _train(
        "--tp",
        "1",
        "--steps",
        "3",
        "--save-every",
        "3",
        "--checkpoint",
        str(root / "ck1"),
        "--out",
        str(root / "plain-first"),
    )
    _train(
        "--tp", "2", "--steps", "6", "--resume", str(root / "ck1"), "--out", str(root / "from-tp1")
    )
    _train(
        "--tp", "1", "--steps", "6", "--resume", str(root / "ck"), "--out", str(root / "from-tp2")
    )
    plain, full = _losses(root / "plain-full"), _losses(root / "full")
    summary = json.loads((root / "plain-full" / "summary.json").read_text())
    assert summary["plain"] and summary["collectives"]["total"] == 0
    assert summary["analytic_collectives"]["total"] == 0
    for s, loss in _losses(root / "from-tp1").items():
        assert loss == pytest.approx(plain[s], rel=RTOL), s
    for s, loss in _losses(root / "from-tp2").items():
        assert loss == pytest.approx(full[s], rel=RTOL), s
