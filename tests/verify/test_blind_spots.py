"""Parity beyond the steps' one shape: each planted model is right at batch 2 × seq 16,
train mode, float32, 3 steps, and wrong elsewhere; each must fail, naming the mode, shape or tensor,
beside a correct twin that passes. The models are in tests/fixtures/blind_spots.py."""

from __future__ import annotations

import pytest
from conftest import dtp_cli
from fixtures.blind_spots import chunked, plan

from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig

MODELS = "tests.fixtures.blind_spots"


def _apply(tmp_path, factory: str, extra: str = "", **kw) -> dict:
    path = tmp_path / "plan.tp"
    path.write_text(plan(extra))
    return launch_apply(RunConfig(plan=str(path), model=f"{MODELS}:{factory}", tp=2, **kw)).parity


def _failing(parity: dict) -> dict[str, str]:
    return {
        q: parity[q]["worst"]
        for q in ("logits", "loss", "grads", "params", "buffers", "probes", "replicas")
        if not parity[q]["ok"]
    }


def test_the_probes_and_their_shapes_are_stated(tmp_path, repo):
    parity = _apply(tmp_path, "chunked")
    assert parity["ok"], _failing(parity)
    assert parity["shapes"] == [
        "train, 2×16: 3 steps (logits, loss, gradients, parameters, buffers; replicas on every "
        "rank)",
        # 64: the config's maximum
        "eval, 2×16: logits",
        "eval, 2×16, left-padded: logits",
        "eval, 2×16, bfloat16 autocast: logits",
        "eval, 1×64: logits",
        "train, 1×64: logits",
        "train, 2×16, bfloat16 autocast: gradients (one forward and backward, no step)",
    ]
    # 5 probes' logits, then every parameter's gradient under autocast
    assert parity["probes"]["compared"] == 5 + len(list(chunked().parameters()))
    # 2 floating + 2 integer buffers, after 3 steps, the probes and the autocast step
    assert parity["buffers"]["compared"] == 4 * 5


def test_case_1_a_path_above_32_tokens_fails_at_the_longest_sequence(tmp_path, repo):
    proc = dtp_cli("apply", str(_plan_file(tmp_path)), f"{MODELS}:long_path", "--tp", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "probes   FAIL" in proc.stdout
    assert "worst: logits (train, 1×64) (probes)" in proc.stdout
    assert "logits   ok" in proc.stdout  # the steps at seq 16 saw nothing
    # --max-seq 32 keeps the probes on the usual path: the bug is out of sight again, and the report
    # says so
    proc = dtp_cli(
        "apply", str(_plan_file(tmp_path)), f"{MODELS}:long_path", "--tp", "2", "--max-seq", "32"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compared: eval, 1×32: logits" in proc.stdout


def _plan_file(tmp_path, extra: str = ""):
    path = tmp_path / "cli.tp"
    path.write_text(plan(extra))
    return path


def test_case_2_a_set_that_halves_a_window_fails_beyond_it(tmp_path, repo):
    parity = _apply(tmp_path, "window", "set attention.window = window / tp")
    failing = _failing(parity)
    # invisible at 16 tokens
    assert set(failing) == {"probes"} and failing["probes"].endswith(", 1×64)")
    assert _apply(tmp_path, "window")["ok"]  # the window untouched: right


def test_case_3_bfloat16_is_decided_on_a_float32_run(tmp_path, repo):
    parity = _apply(tmp_path, "softcap", "set attention.softcap = softcap / 2", dtype="bfloat16")
    assert not parity["ok"] and parity["decided_in"] == "float32"
    # float32 sees the halved cap everywhere
    assert {"logits", "grads", "probes"} <= set(_failing(parity))
    low = parity["low_precision"]
    # bfloat16's own check ran beside it, with its coarser resolution
    assert low["rule"]["eps"] == 2**-7
    assert low["grads"]["resolution"] > 100 * parity["grads"]["resolution"]
    control = _apply(tmp_path, "softcap", dtype="bfloat16")
    assert control["ok"], _failing(control)
    assert control["low_precision"]["ok"] and control["low_precision"]["logits"]["compared"] == 3


def test_a_path_taken_in_bfloat16_only_fails_although_float32_holds(tmp_path, repo):
    parity = _apply(tmp_path, "bfloat16_path", dtype="bfloat16")
    assert not parity["ok"] and _failing(parity) == {}  # the float32 run cannot see it
    assert not parity["low_precision"]["ok"] and parity["low_precision"]["params"]["margin"] > 5


def test_case_4_an_eval_branch_fails_in_eval_mode(tmp_path, repo):
    parity = _apply(tmp_path, "eval_path")
    failing = _failing(parity)
    assert set(failing) == {"probes"} and failing["probes"].startswith("logits (eval, ")
    assert parity["probes"]["margin"] > 1e3
    assert _apply(tmp_path, "chunked")["ok"]


def test_case_5_a_buffer_from_a_sharded_activation_fails_at_step_1(tmp_path, repo):
    parity = _apply(tmp_path, "running_hidden")
    failing = _failing(parity)
    # outputs are right: the statistic is used after 4 steps
    assert set(failing) == {"buffers", "replicas"}
    assert any(
        p.startswith(
            "buffer layers.0.mlp.mean differs across the ranks that replicate it (rank 1 vs the "
            "first)"
        )
        and p.endswith("(after step 1)")
        for p in parity["replicas"]["problems"]
    )
    assert parity["buffers"]["max_rel"] > 1e-2
    assert _apply(tmp_path, "running_input")["ok"]


@pytest.mark.parametrize("max_seq", ["0", "8"])
def test_max_seq_is_bounded(tmp_path, repo, max_seq):
    proc = dtp_cli("apply", "plans/gpt2.tp", "gpt2-tiny", "--max-seq", max_seq)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert ("--max-seq 8 is shorter than --seq 16" in proc.stderr) == (max_seq == "8")


def test_a_low_precision_run_must_hold_in_its_own_dtype_too():
    from dtp.verify.rank import decided_by

    proof = {"ok": True, "nonfinite": None, "worst_tensor": "a", "worst_quantity": "grads"}
    beyond = {"ok": False, "nonfinite": None, "worst_tensor": "b", "worst_quantity": "probes"}
    within = {"ok": True, "nonfinite": None, "worst_tensor": "c", "worst_quantity": "logits"}
    # the float32 run cannot speak for a path the model takes in bfloat16 only
    assert not decided_by(proof, beyond)["ok"] and decided_by(proof, beyond)["worst_tensor"] == "b"
    assert decided_by(proof, within)["ok"]
    assert not decided_by({**proof, "ok": False}, within)["ok"]
