"""Faults survived: a run restarted with its own --checkpoint DIR continues from it, by itself, and
under torchrun --max-restarts a killed worker costs only the steps since the last save."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dtp.cli import main

FLAGS = [
    "--tp",
    "2",
    "--batch",
    "4",
    "--seq",
    "32",
    "--warmup",
    "1",
    # a constant learning rate after warm-up: the first steps of a longer run are a shorter run
    "--min-lr",
    "3e-3",
    "--eval-every",
    "1000",
    "--verify-every",
    "0",
    "--device",
    "cpu",
]


def _losses(out) -> list[float]:
    return json.loads((out / "summary.json").read_text())["losses"]


def test_a_run_with_its_checkpoint_continues_from_it(repo, tmp_path, capsys):
    ck, base = str(tmp_path / "ck"), ["train", "plans/gpt2.tp", "gpt2-tiny", *FLAGS]
    assert main([*base, "--steps", "6", "--out", str(tmp_path / "whole")]) == 0
    assert main([*base, "--steps", "4", "--checkpoint", ck, "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    # the same command with more steps: it continues from step 4, as if never stopped
    assert main([*base, "--steps", "6", "--checkpoint", ck, "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        f"dtp train: continuing from {ck} at step 4 (saved at tp 2 × dp 1; now tp 2 × dp 1); "
        "--fresh starts over"
    )
    assert _losses(tmp_path / "b") == _losses(tmp_path / "whole")[4:]
    # nothing left: said, with the way out
    assert main([*base, "--steps", "6", "--checkpoint", ck, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert (
        "is at step 6, not before --steps 6: nothing left to train (raise --steps, or --fresh"
        in err
    )
    # another plan's checkpoint is not continued, and --fresh starts over (replacing it at its save)
    other = ["train", "plans/gpt2-sp.tp", "gpt2-tiny", *FLAGS, "--steps", "2", "--checkpoint", ck]
    assert main([*other, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: this run would continue from its --checkpoint {ck}, but ")
    assert err.rstrip().endswith("; --fresh starts over") and err.count("\n") == 1
    assert main([*other, "--fresh", "--out", str(tmp_path / "e")]) == 0
    assert _losses(tmp_path / "e") == _losses(tmp_path / "whole")[:2]  # sp: the same sums here


def test_fresh_never_replaces_what_is_not_a_checkpoint(repo, tmp_path, capsys):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("not a checkpoint")
    argv = [
        "train",
        "plans/gpt2.tp",
        "gpt2-tiny",
        *FLAGS,
        "--steps",
        "2",
        "--checkpoint",
        str(keep),
    ]
    assert main([*argv, "--fresh"]) == 2
    assert (
        "holds files and is not a dtp checkpoint; dtp never replaces it" in capsys.readouterr().err
    )
    assert main([*argv]) == 2  # continuing: it is not a complete checkpoint
    assert "is not a complete dtp checkpoint" in capsys.readouterr().err
    assert main([*argv, "--fresh", "--resume", str(keep)]) == 2
    assert "--fresh starts over; it contradicts --resume DIR" in capsys.readouterr().err
    assert [p.name for p in keep.iterdir()] == ["notes.txt"]


def test_torchrun_restarts_a_killed_worker_and_the_run_ends_as_if_never_killed(repo, tmp_path):
    model = "tests.fixtures.faults:gpt_killed_once"
    argv = ["train", "plans/gpt2.tp", model, *FLAGS, "--steps", "40", "--save-every", "10"]
    mark = tmp_path / "killed"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DTP_KILL_AT": "25",  # rank 1 dies in step 25's forward, after the save at step 20
        "DTP_KILL_MARK": str(mark),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, "--standalone", "--max-restarts", "2", "-m", "dtp", *argv]
        + ["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "run")],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert mark.read_text() == "killed\n"  # it did die
    assert f"dtp train: continuing from {tmp_path / 'ck'} at step 20 " in proc.stdout
    restarted = _losses(tmp_path / "run")  # the restarted workers' steps 21–40
    # the same command never killed, on dtp's local ranks
    whole_ck = str(tmp_path / "ck-whole")
    assert main([*argv, "--checkpoint", whole_ck, "--out", str(tmp_path / "whole")]) == 0
    whole = _losses(tmp_path / "whole")
    assert len(restarted) == 20
    assert abs(restarted[-1] - whole[-1]) <= 1e-6 * whole[-1]
    assert max(abs(a - b) / b for a, b in zip(restarted, whole[20:])) <= 1e-6
