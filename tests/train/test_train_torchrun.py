"""`dtp train` under torch's own launcher: the launched world is used, rank 0 reports, and the run
is the same run as with dtp's local ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dtp.cli import main

ARGS = [
    "train",
    "plans/gpt2.tp",
    "gpt2-tiny",
    "--tp",
    "2",
    "--steps",
    "4",
    "--batch",
    "4",
    "--seq",
    "32",
    "--warmup",
    "1",
    "--eval-every",
    "4",
    "--device",
    "cpu",
]


def test_train_under_torchrun_is_the_local_run(repo, tmp_path):
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
            *ARGS,
            "--out",
            str(tmp_path / "torchrun"),
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("dtp train: gpt2-tiny") == 1  # rank 0 alone prints the summary
    launched = json.loads((tmp_path / "torchrun" / "summary.json").read_text())

    assert main([*ARGS, "--out", str(tmp_path / "local")]) == 0
    local = json.loads((tmp_path / "local" / "summary.json").read_text())

    # Same seed, same batches, same collectives in the same order: the same numbers, bit for bit.
    assert len(launched["losses"]) == 4
    assert launched["losses"] == local["losses"]
    assert launched["val_loss"] == local["val_loss"]
    assert launched["collectives"]["by_op"] == local["collectives"]["by_op"] == {"all_reduce": 13}
    assert (
        launched["param_bytes_per_rank"]
        == local["param_bytes_per_rank"]
        == launched["param_bytes_table"]
    )
