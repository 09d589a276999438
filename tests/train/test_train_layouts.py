"""`dtp train` runs every layout `dtp search` prices: micro-batches (gradient accumulation), the
four recomputation policies, float16 with loss scaling, DDP beside FSDP2, and checkpoints that move
between DDP and FSDP2."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Shard

from dtp.cli import main
from dtp.runtime.launcher import launch_local
from dtp.train.optim import LocalGradScaler

SHORT = [
    "--steps",
    "4",
    "--batch",
    "8",
    "--seq",
    "32",
    "--warmup",
    "1",
    # a constant learning rate after warm-up: a 2-step run is the first half of a 4-step one
    "--min-lr",
    "3e-3",
    "--eval-every",
    "4",
    "--verify-every",
    "4",
    "--device",
    "cpu",
]


def _train(tmp_path, name: str, *flags: str) -> dict:
    out = tmp_path / name
    code = main(["train", "plans/gpt2.tp", "gpt2-tiny", *SHORT, "--out", str(out), *flags])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


def _worst_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 4
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _predicted_holds(summary: dict) -> None:
    """dtp simulate's figures for the run's own layout against what it measured: bytes exact,
    saved activations within 10 %."""
    predicted, measured = summary["predicted"], summary["measured"]
    for key in ("tp_bytes", "dp_bytes", "parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        assert measured[key] == predicted[key], key
    ratio = measured["activation_bytes"] / predicted["activation_bytes"]
    assert 0.9 <= ratio <= 1.1, ratio
    assert predicted["step_ms"] is None and measured["step_ms"] > 0  # no --profile


def test_micro_batches_equal_one_big_batch(repo, tmp_path):
    whole = _train(tmp_path, "whole", "--tp", "2")
    micro = _train(tmp_path, "micro", "--tp", "2", "--micro-batch", "2")
    assert micro["config"]["micro_batch"] == 2 and whole["config"]["micro_batch"] == 8
    # the same gradient summed in another order: rounding only
    assert _worst_rel(micro["losses"], whole["losses"]) <= 1e-5
    assert abs(micro["val_loss"] - whole["val_loss"]) / whole["val_loss"] <= 1e-5
    # every micro-batch runs the plan's collectives: 4 × the one-batch step, as the schedule says
    assert micro["collectives"]["total"] == 4 * whole["collectives"]["total"] == 4 * 13
    assert micro["collectives"]["by_op"] == micro["analytic_collectives"]["by_op"]
    assert micro["verify"]["ok"]
    _predicted_holds(micro)
    # 4× the collectives, each a quarter of the tokens: the same bytes a step; a micro-batch of 2
    # leaves about a quarter of the 8's activations
    assert micro["measured"]["tp_bytes"] == whole["measured"]["tp_bytes"] > 0
    quarter = micro["measured"]["activation_bytes"] / whole["measured"]["activation_bytes"]
    assert 0.2 < quarter < 0.3, quarter


def test_recompute_policies_leave_the_losses_unchanged(repo, tmp_path):
    base = _train(tmp_path, "none", "--tp", "2")
    counts = {}
    for policy in ("full", "selective", "op"):
        run = _train(tmp_path, policy, "--tp", "2", "--recompute", policy)
        assert run["config"]["recompute"] == policy
        assert _worst_rel(run["losses"], base["losses"]) <= 1e-6, policy
        assert run["collectives"]["by_op"] == run["analytic_collectives"]["by_op"], policy
        counts[policy] = run["collectives"]["total"]
    # full re-runs each block's 2 forward all-reduces (2 blocks) in backward; selective and op keep
    # every collective's output
    assert counts == {"full": 13 + 4, "selective": 13, "op": 13}


def test_checkpoint_activations_is_recompute_full_and_contradictions_are_refused(repo, capsys):
    assert (
        main(
            [
                "train",
                "plans/gpt2.tp",
                "gpt2-tiny",
                "--checkpoint-activations",
                "--recompute",
                "op",
            ]
        )
        == 2
    )
    assert "--checkpoint-activations is --recompute full" in capsys.readouterr().err
    assert main(["train", "plans/gpt2.tp", "gpt2-tiny", "--batch", "8", "--micro-batch", "3"]) == 2
    err = capsys.readouterr().err
    assert "--micro-batch 3 must divide the 8 sequences each dp rank runs" in err
    assert (
        main(["train", "plans/gpt2.tp", "gpt2-tiny", "--precision", "fp16", "--dtype", "bfloat16"])
        == 2
    )
    assert "--precision fp16 and --dtype bfloat16 disagree" in capsys.readouterr().err


def test_float16_trains_with_a_loss_scale(repo, tmp_path):
    fp32 = _train(tmp_path, "fp32", "--tp", "2")
    fp16 = _train(tmp_path, "fp16", "--tp", "2", "--precision", "fp16")
    assert fp16["config"]["dtype"] == "float16"
    assert fp16["loss_scale"] == {"final": 65536.0, "skipped_steps": 0}
    # float16 autocast: 2^-11 rounding per op, far from float32's, far below a wrong model's
    assert 0 < _worst_rel(fp16["losses"], fp32["losses"]) <= 1e-3
    # its verification replays in float16 autocast too
    assert fp16["verify"]["ok"] and fp16["verify"]["checks"][0]["margin"] <= 1.0


def _scaler_skips(rank, world):
    """A step whose one sharded gradient holds an inf on rank 1 only: every rank skips it."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    sharded = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    plain = nn.Parameter(torch.ones(3))  # a tensor beside the DTensor: torch's foreach refuses
    opt = torch.optim.SGD([sharded, plain], lr=0.1)
    scaler = LocalGradScaler(device="cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale is made by its first use, as in a training step
    out = []
    for bad in (True, False):
        grad = torch.full((2, 2), 1024.0)
        if bad and rank == 1:
            grad[0, 0] = math.inf
        sharded.grad = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
        sharded.grad._local_tensor.copy_(grad)
        plain.grad = torch.full((3,), 1024.0)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), float(plain.detach()[0]), float(sharded.to_local()[0, 0])))
    return out


def test_local_grad_scaler_skips_on_every_rank_and_unscales_local_tensors(repo):
    for steps in launch_local(_scaler_skips, 2, timeout=60):
        # step 1: rank 1's inf skips the step on both ranks (nothing moves) and halves the scale;
        # step 2: gradients 1024 / 512 = 2 each, SGD moves 1 by -0.2
        assert steps[0] == (512.0, 1.0, 1.0)
        assert steps[1][0] == 512.0
        assert steps[1][1] == pytest.approx(0.8) and steps[1][2] == pytest.approx(0.8)


def test_ddp_equals_fsdp_and_its_checkpoint_resumes_under_fsdp(repo, tmp_path):
    layout = ["--tp", "2", "--dp", "2"]
    fsdp = _train(tmp_path, "fsdp", *layout)
    ddp = _train(tmp_path, "ddp", *layout, "--dp-mode", "ddp")
    assert ddp["config"]["dp_mode"] == "ddp"
    assert _worst_rel(ddp["losses"], fsdp["losses"]) <= 1e-5
    # DDP: the tp collectives and one gradient all-reduce per unit (2 blocks and the root), no
    # FSDP2 gathers or reduce-scatters; the schedule says the same
    assert ddp["collectives"]["by_op"] == {"all_reduce": 13 + 3}
    assert ddp["collectives"]["by_op"] == ddp["analytic_collectives"]["by_op"]
    assert set(fsdp["collectives"]["by_op"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    # replicated over dp: every rank holds its tp rank's whole shard (FSDP2: half of it)
    assert ddp["param_bytes_per_rank"] == ddp["param_bytes_table"]
    assert [2 * b for b in fsdp["param_bytes_per_rank"]] == ddp["param_bytes_per_rank"]
    _predicted_holds(ddp)
    _predicted_holds(fsdp)
    assert ddp["measured"]["dp_bytes"] > 0 and fsdp["measured"]["dp_bytes"] > 0
    # a 2-step DDP run's checkpoint, resumed under FSDP2, continues as the uninterrupted FSDP2 run
    ck = str(tmp_path / "ck")
    _train(tmp_path, "ddp2", *layout, "--dp-mode", "ddp", "--steps", "2", "--checkpoint", ck)
    out = tmp_path / "resumed"
    code = main(
        [
            "train",
            "plans/gpt2.tp",
            "gpt2-tiny",
            *SHORT,
            *layout,
            "--resume",
            ck,
            "--out",
            str(out),
        ]
    )
    assert code == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["start_step"] == 2 and len(resumed["losses"]) == 2
    assert max(abs(a - b) / b for a, b in zip(resumed["losses"], fsdp["losses"][2:])) <= 1e-5
