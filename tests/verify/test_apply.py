"""`dtp apply` end to end on real gloo ranks: parity, exact collective counts, memory, failures."""

from __future__ import annotations

import inspect
import json
import time
import uuid

import pytest
from conftest import default_sigint, dtp_cli, processes_with_mark
from fixtures import broken_models

from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig

# gpt2-tiny: 2 layers, n_embd 64, vocab 256, block 64, biases, wte tied to lm_head.
V, C, L, BLOCK = 256, 64, 2, 64
B, T = 2, 16
# wte, c_attn, c_proj, c_fc, c_proj
SHARDED = V * C + L * ((3 * C * C + 3 * C) + C * C + (4 * C * C + 4 * C) + 4 * C * C)
# wpe, ln_1, ln_2, both c_proj biases, ln_f
REPLICATED = BLOCK * C + L * (2 * C + 2 * C + C + C) + 2 * C
UNIQUE_PARAMS = 2 + L * 12 + 2  # wte, wpe, 12 per block, ln_f weight and bias


def _run(tp: int, model: str = "gpt2-tiny", plan: str = "plans/gpt2.tp", **kw) -> dict:
    return launch_apply(
        RunConfig(plan=plan, model=model, tp=tp, batch=B, seq=T, steps=kw.pop("steps", 2), **kw)
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt2_plan_reaches_parity_with_megatron_collectives(repo, tp):
    report = _run(tp)
    parity = report.parity
    assert parity["ok"], parity
    for q in ("logits", "loss", "grads", "params"):
        assert parity[q]["max_rel"] < 1e-5, (q, parity[q])
    # one gradient for the tied wte/lm_head weight: 28 unique parameters, compared after each of 2
    # steps
    assert parity["grads"]["compared"] == UNIQUE_PARAMS * 2
    assert report.tied_parameters == [["transformer.wte.weight", "lm_head.weight"]]
    # Megatron: per block 2 forward + 2 backward all-reduces; embedding 1 forward; head
    # input-gradient 1 backward; vocab-parallel cross-entropy 3 forward (max, sum of exponentials,
    # target logit). At tp=1 the model runs as plain PyTorch (no DTensor): no collective at all, the
    # loss's included.
    coll = report.collectives
    layers = (2 * L * 2 + 1 + 1) if tp > 1 else 0
    loss = 3 if tp > 1 else 0
    assert (
        coll["by_op"]
        == ({"all_reduce": layers + loss} if tp > 1 else {})
        == ({"all_reduce": 13} if tp > 1 else {})
    )
    assert coll["forward"] == ({"all_reduce": 2 * L + 1 + loss} if tp > 1 else {})
    assert coll["backward"] == ({"all_reduce": 2 * L + 1} if tp > 1 else {})
    assert report.analytic_collectives["total"] == coll["total"]
    activation = B * T * C * 4
    buffers = layers * activation + loss * B * T * 4
    assert report.collectives["bytes"] == ({"all_reduce": buffers} if tp > 1 else {})
    # ring all-reduce: each rank sends 2(n-1)/n
    assert report.comm_bytes == 2 * (tp - 1) * buffers // tp
    assert report.param_bytes_unsharded == 4 * (SHARDED + REPLICATED)
    assert report.param_bytes_per_rank == [4 * (REPLICATED + SHARDED // tp)] * tp
    assert report.ideal_param_bytes_per_rank == 4 * (REPLICATED + SHARDED // tp)
    assert len(report.peak_memory_bytes) == tp and min(report.peak_memory_bytes) > 0
    assert report.step_time_ms > 0 and report.tokens_per_s > 0


def test_world_size_three(repo):
    report = _run(3, model="tests/fixtures/gpt-tp3.yaml")
    assert report.parity["ok"], report.parity
    assert report.collectives["by_op"] == {"all_reduce": 4 * 1 + 1 + 1 + 3}


def test_bring_your_own_model_with_set_rewrite(repo):
    report = _run(2, model="dtp.models.examples:tiny_lm", plan="plans/tinylm.tp")
    assert report.parity["ok"], report.parity
    # separate q/k/v projections share one input redistribution: Megatron's 13 for two layers, not
    # 17
    assert report.collectives["by_op"] == {"all_reduce": 13}
    assert report.tied_parameters == []


def test_hugging_face_llama(repo):
    report = _run(2, model="dtp.models.examples:tiny_llama", plan="plans/hf-llama.tp", steps=1)
    assert report.parity["ok"], report.parity


def test_cli_main_job_prints_report_and_json(repo, tmp_path):
    out = tmp_path / "r.json"
    proc = dtp_cli(
        "apply", "plans/gpt2.tp", "gpt2-tiny", "--tp", "2", "--steps", "1", "--json", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    assert "parity vs unsharded reference: OK" in proc.stdout
    assert "collectives per training step: 13 (13 all_reduce)" in proc.stdout
    report = json.loads(out.read_text())
    assert report["plan"] == {"name": "gpt2-megatron", "version": 1, "file": "plans/gpt2.tp"}
    assert report["mesh"] == {"tp": 2, "dp": 1}
    assert set(report["parity"]) >= {"ok", "logits", "loss", "grads", "params", "worst_tensor"}


def test_gradient_reducing_layouts_under_fsdp2(repo):
    # Qwen3's replicate(reduce_grad=true) q/k norms at dp 2 × tp 2: their gradient reductions must
    # survive the build path's new storage and FSDP2's unsharded parameters (they were lost to both
    # once)
    pytest.importorskip("transformers")
    report = launch_apply(
        RunConfig(
            plan="plans/hf/qwen3.tp",
            model="dtp.models.hf:qwen3",
            tp=2,
            dp=2,
            batch=4,
            seq=8,
            steps=1,
        )
    )
    assert report.parity["ok"], report.parity
    assert report.collectives["by_op"] == report.analytic_collectives["by_op"]
    # Megatron's, the loss's, 2 × (q, k) norms
    assert report.collectives["backward"]["all_reduce"] == 4 + 1 + 2 * 2


def test_mispacked_qkv_fails_parity(repo):
    proc = dtp_cli(
        "apply", "tests/fixtures/unpacked-qkv.tp", "gpt2-tiny", "--tp", "2", "--steps", "1"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "parity vs unsharded reference: FAILED" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_unconsumed_colwise_is_rejected_before_launch(repo):
    # once a shape error on rank 0 mid-forward; now the layout flow of `check` finds it (exit 2, no
    # rank starts)
    proc = dtp_cli(
        "apply", "tests/fixtures/unconsumed-colwise.tp", "gpt2-tiny", "--tp", "2", "--steps", "1"
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "tests/fixtures/unconsumed-colwise.tp:3:27: error: transformer.h.0.mlp.c_fc (and 1 "
        "more module): colwise output (each rank's slice of the features (shard(-1), local)) "
        "reaches mlp.c_proj (Linear, not sharded)"
    )
    assert "Traceback" not in proc.stderr


def test_width_dependent_model_fails_parity(repo):
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "tests.fixtures.broken_models:width_dependent",
        "--tp",
        "2",
        "--steps",
        "1",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "logits   FAIL" in proc.stdout


def test_crashing_rank_exits_1_naming_rank_and_module(repo):
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "tests.fixtures.broken_models:crash_on_rank1",
        "--tp",
        "2",
        "--timeout",
        "60",
    )
    assert proc.returncode == 1
    assert (
        "the sharded run failed on rank 1 in module transformer.h.1.mlp.gelu.1 during forward: "
        "RuntimeError: planted failure on rank 1"
    ) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_hanging_rank_times_out_and_leaves_no_process(repo):
    # this run's processes only, not a leftover of an earlier run
    mark = f"hang-test-{uuid.uuid4().hex}"
    start = time.monotonic()
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "tests.fixtures.broken_models:hang_on_rank1",
        "--tp",
        "2",
        "--timeout",
        "8",
        env={"DTP_TEST_MARK": mark},
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "did not finish within --timeout 8 s" in proc.stderr
    where = proc.stderr.split("where each rank was: ", 1)[1]  # from each stuck rank's own stack
    lines, first = inspect.getsourcelines(broken_models._Hang.forward)
    line = first + next(i for i, text in enumerate(lines) if "time.sleep(3600)" in text)
    assert f"rank 1: broken_models.py:{line} forward <- " in where, proc.stderr
    assert "rank 0: " in where and "Traceback" not in proc.stderr
    assert elapsed < 8 + 20  # the timeout plus start-up, never the hour the rank sleeps
    time.sleep(0.5)
    assert processes_with_mark(mark) == []


def test_plan_error_exits_2_before_any_rank_starts(repo, tmp_path):
    bad = tmp_path / "bad.tp"
    bad.write_text("dtp 1\ntransformer.h.*.mlp.c_fc: colwse\n")
    proc = dtp_cli("apply", str(bad), "gpt2-tiny", "--tp", "2")
    assert proc.returncode == 2
    assert f"{bad}:2:27: error: unknown style 'colwse'; did you mean 'colwise'?" in proc.stderr
    assert "parity" not in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["plans/gpt2.tp", "no-such-model"], "unknown model 'no-such-model'"),
        (["plans/gpt2.tp", "gpt2-tiny", "--tp", "0"], "expected a positive integer"),
        (
            ["plans/gpt2.tp", "gpt2-tiny", "--dp", "2", "--batch", "3"],
            "--batch 3 (the global batch) must divide by --dp 2",
        ),
        (["plans/gpt2.tp", "nosuchpkg.mod:factory"], "cannot import 'nosuchpkg.mod'"),
        (["missing.tp", "gpt2-tiny"], "plan file missing.tp does not exist"),
    ],
)
def test_usage_errors_exit_2(repo, args, message):
    proc = dtp_cli("apply", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("tp", [2, 4])
def test_vocabulary_that_does_not_divide_shards_unevenly(repo, tp):
    # 257 rows: torch.chunk gives ceil(257/tp) rows to each rank but the last, which holds the rest.
    vocab = 257
    report = _run(tp, model="tests/fixtures/gpt-odd-vocab.yaml")
    assert report.parity["ok"], report.parity
    chunk = -(-vocab // tp)
    rows = [chunk] * (tp - 1) + [vocab - chunk * (tp - 1)]
    others = SHARDED - V * C  # the even shards
    assert report.param_bytes_per_rank == [4 * (REPLICATED + others // tp + r * C) for r in rows]
    assert report.collectives["by_op"] == {"all_reduce": 13}


def test_ctrl_c_stops_every_rank(repo):
    import os
    import signal
    import subprocess
    import sys

    # this run's processes only, not a leftover of an earlier run
    mark = f"ctrl-c-test-{uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTP_TEST_MARK": mark}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtp",
            "apply",
            "plans/gpt2.tp",
            "tests.fixtures.broken_models:hang_on_rank1",
            "--tp",
            "2",
            "--timeout",
            "120",
        ],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 60
    # the parent and both ranks
    while len(processes_with_mark(mark)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # well inside the run
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    assert processes_with_mark(mark) == []


def test_under_torchrun_uses_the_launched_world(repo, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "dtp",
            "apply",
            "plans/gpt2.tp",
            "gpt2-tiny",
            "--steps",
            "1",
            "--json",
            str(out),
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["mesh"] == {"tp": 2, "dp": 1}  # --tp defaults to WORLD_SIZE
    assert report["parity"]["ok"]
    assert report["collectives"]["by_op"] == {"all_reduce": 13}
