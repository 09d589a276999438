"""`dtp train --init model` (the default): the full initial weights are what the unsharded model's
own init gives for the seed — Gemma's zero norm weights, per-head sinks, zero gates, activation
scalars — at any tp and dp; `--init keyed` still refuses what GPT-2's init cannot draw; rank 0's
whole model must fit its host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtp import models
from dtp.checks.checker import check
from dtp.cli import main
from dtp.errors import UsageError
from dtp.lang.parse import load
from dtp.runtime.launcher import launch_local
from dtp.runtime.mesh import make_mesh
from dtp.train import budget, data
from dtp.train.budget import check_init_memory
from dtp.train.loop import TrainConfig, Trainer
from tests.train.planted_init import PLAN

PLANTED = "tests.train.planted_init:model"
SEED = 5


@pytest.fixture
def planted(repo, tmp_path):
    """(plan path, corpus of 128-id tokens) for the planted model and the tiny Hugging Face ones."""
    plan = tmp_path / "planted.tp"
    plan.write_text(PLAN)
    tokens = tmp_path / "tokens.bin"
    (np.arange(4096) * 7 % 127).astype(np.uint16).tofile(tokens)
    return str(plan), data.prepare(str(tokens), tmp_path / "cache", model_vocab=128)


def _initial(rank, world, plan, spec, dp, corpus, init):
    cfg = TrainConfig(
        plan=plan, model=spec, tp=world // dp, dp=dp, batch=2, seq=16, steps=1, seed=SEED, init=init
    )
    trainer = Trainer(cfg, corpus, make_mesh(cfg.tp, dp))
    return {
        n: trainer.applied.full(n, p.detach()).clone() for n, p in trainer.model.named_parameters()
    }


def _own_init(spec: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return dict(
        models.build(models.resolve(spec), device="cpu", dtype=torch.float32).named_parameters()
    )


def _assert_equal(full: dict, expected: dict, where: str) -> None:
    assert full.keys() == expected.keys(), where
    for name, value in expected.items():
        assert torch.equal(full[name], value.detach()), (where, name)


def test_planted_model_starts_from_its_own_init_at_tp_1_2_and_dp_2(planted):
    plan, corpus = planted
    expected = _own_init(PLANTED)
    for world, dp in ((1, 1), (2, 1), (4, 2)):
        _assert_equal(
            launch_local(_initial, world, plan, PLANTED, dp, corpus, "model", timeout=120)[0],
            expected,
            f"tp {world // dp} dp {dp}",
        )
    # x · (1 + 0): unit scale, not keyed's 2
    assert torch.equal(expected["norm.weight"], torch.zeros(32))
    assert torch.equal(expected["blocks.0.gate"], torch.zeros(1)) and expected[
        "blocks.1.scale"
    ].tolist() == [0.5]
    # drawn in __init__ from the seeded generator
    assert expected["blocks.0.attn.sinks"].std() > 0.1
    torch.manual_seed(SEED + 1)
    other = models.build(models.resolve(PLANTED), device="cpu")
    # the seed drives it
    assert not torch.equal(other.blocks[0].attn.sinks, expected["blocks.0.attn.sinks"])


@pytest.mark.parametrize(
    "family,own",
    [
        ("gemma", "model.norm.weight"),  # GemmaRMSNorm: x · (1 + w), w zero
        ("gpt_oss", "model.layers.0.self_attn.sinks"),  # per-head sinks
        ("apertus", "model.layers.0.mlp.act_fn.alpha_p"),  # xIELU's learnt scalars
    ],
)
def test_hugging_face_models_start_from_their_own_init_at_tp_2(planted, family, own):
    pytest.importorskip("transformers")
    _, corpus = planted
    spec = f"dtp.models.hf:{family}"
    expected = _own_init(spec)
    _assert_equal(
        launch_local(_initial, 2, f"plans/hf/{family}.tp", spec, 1, corpus, "model", timeout=120)[
            0
        ],
        expected,
        family,
    )
    value = expected[own]
    if family == "gemma":
        # keyed init would set 1: every norm at scale 2
        assert torch.equal(value, torch.zeros_like(value))
    else:
        assert value.abs().min() > 0  # drawn or set by the model's own init, neither 0 nor refused


def test_keyed_init_still_refuses_what_it_cannot_draw(planted, tmp_path, capsys):
    plan, _ = planted
    code = main(["train", plan, PLANTED, "--init", "keyed", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert (
        code == 2
        and "keyed initialisation knows matrices, biases and norms; blocks.0.gate is a 1-D" in err
    )
    assert "--init model" in err


def test_rank0s_whole_model_must_fit_the_host(repo, tmp_path, capsys, monkeypatch):
    meta = models.build(models.resolve("gpt2-tiny"), device="meta")
    checked = check(load("plans/gpt2.tp"), meta, 2)
    check_init_memory(checked, meta, 2, 1, "cpu", available=10**9)
    with pytest.raises(
        UsageError, match=r"whole model on rank 0 .* 471\.\d KiB in float32, next to the ranks' "
    ):
        check_init_memory(checked, meta, 2, 1, "cpu", available=600_000)
    check_init_memory(checked, meta, 2, 1, "cuda", available=600_000)  # the shards live on the GPUs

    monkeypatch.setattr(budget, "available_bytes", lambda: 600_000)
    short = tmp_path / "short.txt"
    short.write_text("def f():\n    return 1\n" * 10)
    args = [
        "train",
        "plans/gpt2.tp",
        "gpt2-tiny",
        "--device",
        "cpu",
        "--data",
        str(short),
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --init model builds the whole model") and "use --init keyed" in err
    )
    assert err.count("\n") == 1
    # passes the init check; the whole run's memory does not fit
    assert main([*args, "--init", "keyed"]) == 2
    err = capsys.readouterr().err
    assert (
        "this run needs about" in err
        and "--init model" not in err
        and "use --init keyed" not in err
    )
    monkeypatch.setattr(budget, "available_bytes", lambda: 10**12)
    assert main([*args, "--init", "keyed"]) == 2  # refused later, for its short data
    assert "are too few for --batch" in capsys.readouterr().err


def test_a_0d_parameter_under_dp_is_refused_before_any_rank(planted, tmp_path, capsys):
    plan, _ = planted
    assert (
        main(
            [
                "train",
                plan,
                "tests.train.planted_init:scalar",
                "--dp",
                "2",
                "--tp",
                "1",
                "--batch",
                "2",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == (
        "error: --dp 2 shards parameters with FSDP2, which cannot shard 0-D parameters "
        "(blocks.0.scale, "
        "blocks.1.scale); train with --dp 1, or make them 1-D tensors of one element\n"
    )
