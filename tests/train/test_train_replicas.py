"""`dtp train` checks that the tp ranks' replicated tensors stay equal: a planted attention whose
per-channel query gain sits under plain `replicate` (a plan `dtp check` accepts; the gain's gradient
is each rank's partial sum) stops the run with exit 1 naming the tensor and the step, also under
--compare-tp and before a checkpoint; correct plans train and the summary says what was checked."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dtp.cli import main
from dtp.runtime.launcher import launch_local
from dtp.runtime.mesh import make_mesh
from dtp.train.replica_checks import ReplicaChecks, due
from tests.train.planted_init import DRIFT_PLAN, PLAN

DRIFTING, PLANTED = "tests.train.planted_init:drifting", "tests.train.planted_init:model"
TINY = ["--batch", "2", "--seq", "16", "--warmup", "0", "--eval-every", "100", "--device", "cpu"]


@pytest.fixture
def plans(repo, tmp_path):
    """(the drifting plan, the correct one, the flags every run shares): a small text corpus, tiny
    batches."""
    text = tmp_path / "text.txt"
    text.write_text((repo / "README.md").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    (tmp_path / "drift.tp").write_text(DRIFT_PLAN)
    (tmp_path / "planted.tp").write_text(PLAN)
    return str(tmp_path / "drift.tp"), str(tmp_path / "planted.tp"), ["--data", str(text), *TINY]


def test_drifting_replicas_stop_the_run_with_the_tensor_and_the_step(plans, tmp_path, capsys):
    drift, _, args = plans
    out = tmp_path / "out"
    assert (
        main(["train", drift, DRIFTING, "--tp", "2", "--steps", "8", "--out", str(out), *args]) == 1
    )
    err = capsys.readouterr().err
    # the most drifted tensor first: one of the gains (the others move only through the clipped norm
    # they share)
    assert re.match(
        r"error: the tp ranks' copies of replicated tensors diverged at step 1 \(the first check of "
        r"this run\): parameter blocks\.[01]\.attn\.q_gain differs on rank\(s\) 1 from the first tp "
        r"rank's copy by up to \S+ \(\S+ of its largest value\); \d+ other replicated tensor",
        err,
    )
    assert "replicate(reduce_grad=true)" in err and "sharded_norm" in err and err.count("\n") == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert {f"blocks.{i}.attn.q_gain" for i in (0, 1)} <= {
        d.split()[1] for d in rows[0]["replica_divergences"]
    }
    assert not (out / "summary.json").exists()


def test_no_checkpoint_of_drifted_replicas_is_saved(plans, tmp_path, capsys):
    drift, _, args = plans
    ck = tmp_path / "ck"
    assert (
        main(
            [
                "train",
                drift,
                DRIFTING,
                "--tp",
                "2",
                "--steps",
                "3",
                "--check-replicas",
                "0",
                "--checkpoint",
                str(ck),
                "--out",
                str(tmp_path / "out"),
                *args,
            ]
        )
        == 1
    )
    # 0: at the end only
    assert "diverged at step 3 (the first check of this run)" in capsys.readouterr().err
    assert not ck.exists()


def test_compare_tp_fails_a_plan_whose_replicas_drift(plans, tmp_path, capsys):
    drift, _, args = plans
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "train",
                drift,
                DRIFTING,
                "--compare-tp",
                "1,2",
                "--steps",
                "4",
                "--out",
                str(out),
                *args,
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "\nerror: at tp=2: the tp ranks' copies of replicated tensors diverged at step 1" in err
    assert not (out / "compare.json").exists()


def test_a_correct_plan_trains_and_the_summary_records_the_checks(plans, tmp_path, capsys):
    _, planted, args = plans
    out = tmp_path / "ok"
    assert (
        main(
            [
                "train",
                planted,
                PLANTED,
                "--tp",
                "2",
                "--steps",
                "7",
                "--check-replicas",
                "3",
                "--out",
                str(out),
                *args,
            ]
        )
        == 0
    )
    replicas = json.loads((out / "summary.json").read_text())["replicas"]
    assert (
        replicas["steps"] == [1, 3, 6, 7]
        and replicas["divergences"] == []
        and replicas["rtol"] == 0.0
    )
    # per block: 2 norms, the gate, the scale, down.bias; the final norm
    assert replicas["tensors"] == 2 * 5 + 1
    assert (
        "replicas: 11 replicated tensors equal across the tp ranks (bitwise) at steps 1, 3, 6, 7"
        in capsys.readouterr().out
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "replicas_checked" in r] == [1, 3, 6, 7]


def test_qwen3_per_head_norms_with_reduce_grad_stay_equal(repo, plans, tmp_path):
    pytest.importorskip("transformers")
    import numpy as np

    tokens = tmp_path / "tokens.bin"
    # the tiny model's vocabulary is 128
    (np.arange(8192) * 7 % 127).astype(np.uint16).tofile(tokens)
    out = tmp_path / "qwen3"
    assert (
        main(
            [
                "train",
                "plans/hf/qwen3.tp",
                "dtp.models.hf:qwen3",
                "--tp",
                "2",
                "--steps",
                "4",
                "--out",
                str(out),
                "--data",
                str(tokens),
                *TINY,
            ]
        )
        == 0
    )
    replicas = json.loads((out / "summary.json").read_text())["replicas"]
    assert replicas["steps"] == [1, 4] and replicas["divergences"] == []
    # per layer 2 norms, q_norm, k_norm; the final norm; 2 rotary buffers
    assert replicas["tensors"] == 2 * 4 + 1 + 2


def _tolerance(rank, world, bump):
    """A CUDA-like check (rtol > 0) on gloo: rank 1's copy of a replicated weight moved by `bump`
    (relative)."""
    torch.manual_seed(0)
    mesh = make_mesh(world)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8))
    with torch.no_grad():
        model[0].weight.uniform_(1.0, 2.0)
        if rank == 1:
            model[0].weight[3] *= 1 + bump
    checks = ReplicaChecks.over(mesh, model, torch.device("cpu"))
    checks.rtol = 64 * torch.finfo(torch.float32).eps
    ok = checks.check(model, 5)
    return ok, checks.resynced, [d.name for d in checks.divergences], model[0].weight.clone()


def test_last_bit_noise_is_put_back_under_a_tolerance_and_a_real_difference_is_not():
    (ok, resynced, found, w0), (_, _, _, w1) = launch_local(_tolerance, 2, 4e-7, timeout=60)
    assert ok and resynced == ["0.weight"] and found == [] and torch.equal(w0, w1)
    (ok, resynced, found, w0), (_, _, _, w1) = launch_local(_tolerance, 2, 1e-3, timeout=60)
    assert not ok and resynced == [] and found == ["0.weight"] and not torch.equal(w0, w1)


def _one_group_drifts(rank, world):
    """dp 2 × tp 2: only the second tp group's copies differ (global rank 3)."""
    mesh = make_mesh(2, 2)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8))
    with torch.no_grad():
        model[0].weight.fill_(1.0 + (rank == 3))
    checks = ReplicaChecks.over(mesh, model, torch.device("cpu"))
    return checks.check(model, 2), [d.name for d in checks.divergences]


def test_every_rank_stops_when_any_tp_group_drifts():
    results = launch_local(_one_group_drifts, 4, timeout=60)
    # rank 0's group is fine, and stops too: no rank hangs
    assert [ok for ok, _ in results] == [False] * 4
    assert [found for _, found in results] == [[], [], ["0.weight"], ["0.weight"]]


def test_when_replicas_are_checked():
    assert [s for s in range(1, 26) if due(s, 0, 10, 25)] == [1, 10, 20, 25]
    assert [s for s in range(6, 26) if due(s, 5, 10, 25)] == [6, 10, 20, 25]  # resumed at step 5
    assert [s for s in range(1, 26) if due(s, 0, 0, 25)] == [25]


@pytest.mark.parametrize("value", ["-1", "x", "2000000000"])
def test_bad_check_interval_exits_2(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "plans/gpt2.tp", "gpt2-tiny", "--check-replicas", value])
    assert exit_.value.code == 2 and "argument --check-replicas" in capsys.readouterr().err
