"""The tp 1 comparison's machinery (python -m dtp.bench.plain_tp1): both arms run and are
interleaved; the timings mean nothing here."""

from __future__ import annotations

import json

import pytest


def test_arms_interleave_and_record_the_load(repo, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from dtp.bench import plain_tp1

    devices = []
    # the arms are stubs: no device is touched
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(
        plain_tp1,
        "hf_loop_process",
        lambda steps, threads, apply=False, device="cpu": devices.append(device) or 1.0,
    )
    monkeypatch.setattr(
        plain_tp1,
        "dtp_train",
        lambda steps, threads, plan, src, device: devices.append(device) or 2.0,
    )
    out = tmp_path / "tp1.json"
    assert (
        plain_tp1.main(
            [
                "--repeats",
                "2",
                "--steps",
                "3",
                "--threads",
                "1",
                "--base",
                str(tmp_path),
                "--out",
                str(out),
                "--device",
                "cuda",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    # every arm on the device asked for
    assert devices == ["cuda"] * 6 and result["device"] == "cuda"
    assert [s["arm"] for s in result["samples"]] == [
        "dtp",
        "hf-loop",
        "dtp-base",
        "hf-loop",
        "dtp-base",
        "dtp",
    ]
    assert all(len(s["load_before"].split()) == 3 for s in result["samples"])
    assert result["median"] == {"dtp": 2.0, "hf-loop": 1.0, "dtp-base": 2.0}


def test_apply_mode_times_dtp_apply_against_the_loop_at_its_shape(repo, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from dtp.bench import plain_tp1

    seen = []
    monkeypatch.setattr(
        plain_tp1,
        "hf_loop_process",
        lambda steps, threads, apply=False, device="cpu": seen.append((apply, device)) or 1.0,
    )
    monkeypatch.setattr(plain_tp1, "dtp_apply", lambda steps, threads, plan, src, device: 3.0)
    out = tmp_path / "apply.json"
    assert (
        plain_tp1.main(
            ["--apply", "--repeats", "1", "--steps", "3", "--threads", "1", "--out", str(out)]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert (
        seen == [(True, "cpu")]
        and result["apply"]
        and result["median"] == {"dtp": 3.0, "hf-loop": 1.0}
    )


def test_no_gpu_and_a_failed_arm_are_one_line_errors(repo, tmp_path, monkeypatch, capsys):
    from dtp.bench import plain_tp1

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert plain_tp1.main(["--device", "cuda", "--repeats", "1"]) == 2
    assert capsys.readouterr().err == (
        "error: --device cuda: this machine has no CUDA device "
        "(torch.cuda.is_available() is False)\n"
    )

    def failing(*args, **kwargs):
        raise plain_tp1.ArmFailed("python -m dtp train ... exited 2: error: bad flag")

    monkeypatch.setattr(plain_tp1, "dtp_train", failing)
    monkeypatch.setattr(plain_tp1, "hf_loop_process", lambda *a, **k: 1.0)
    out = tmp_path / "never.json"
    assert (
        plain_tp1.main(["--repeats", "1", "--steps", "3", "--threads", "1", "--out", str(out)]) == 1
    )
    err = capsys.readouterr().err
    assert (
        err
        == "error: arm 'dtp' failed in repeat 0: python -m dtp train ... exited 2: error: bad flag\n"
    )
    assert not out.exists()


def test_the_loops_train(repo):
    pytest.importorskip("transformers")
    from dtp.bench.plain_tp1 import hf_apply_loop, hf_loop

    assert hf_loop(3, 1) > 0 and hf_apply_loop(3, 1) > 0
