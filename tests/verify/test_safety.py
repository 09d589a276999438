"""Safe by default, and every bad input a clean error: exit status, first line, no traceback — all
before any rank starts (these run `dtp.cli.main` in this process; the ones that start ranks are in
tests/runtime/test_safety_ranks.py)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import REPO

from dtp.cli import main

LAUGHS = (
    "\n".join(
        ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
        + [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]
    )
    + "\n"
)


@pytest.fixture
def cli(repo, capsys):
    """run(*argv) -> (exit status, stderr) of `dtp ARGV` in this process."""
    previous = signal.getsignal(signal.SIGTERM)

    def run(*argv: str) -> tuple[int, str]:
        try:
            code = main(list(argv))
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, err

    yield run
    signal.signal(signal.SIGTERM, previous)


def first(err: str) -> str:
    """The first line that is not argparse's usage banner."""
    return next(
        line
        for line in err.splitlines()
        if line.startswith(("error:", "dtp", "/", "tests/"))
        and not line.startswith("dtp [")
        and "usage:" not in line
    )


# ---- model configs are data ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        (
            LAUGHS,
            ' is not valid YAML: aliases (*name) are not allowed in a model config in "<unicode string>", line 2, '
            "column 8: b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a] ^",
        ),
        (
            "n_embd: 1e12\n",
            ": n_embd must be a positive integer, got '1e12' (YAML reads 1e12 as text and 1.0e12 as "
            "a float)",
        ),
        (
            "n_embd: 1.0e+22\n",
            ": n_embd must be a positive integer, got 1e+22 (YAML reads 1e12 as text and 1.0e12 as "
            "a float)",
        ),
        (
            "n_embd: 1000000000000\n",
            ": n_embd = 1000000000000 is out of range (at most 2147483648)",
        ),
        (
            'dropout: "0.1"\n',
            ": dropout must be a number, got '0.1' (write numbers without quotes; YAML reads 1e-5 "
            "as "
            "text: write 1.0e-5)",
        ),
        ("bias: 1\n", ": bias must be true or false, got 1"),
        (
            "? " + "x" * 5000 + "\n: 1\n",
            ": unknown key '" + "x" * 74 + " …x'; "
            "known keys: n_layer, n_head, n_embd, vocab_size, block_size, dropout, bias, "
            "tie_embeddings",
        ),
        ("x: " + "[" * 1100 + "]" * 1100 + "\n", " nests too deeply to be a model config"),
        ("# padding\n" * 7000, " is 70000 bytes; a model config is at most 64 KiB"),
    ],
    ids=[
        "billion-laughs",
        "1e12",
        "1e22",
        "huge-int",
        "quoted-float",
        "int-for-bool",
        "long-key",
        "deep",
        "big",
    ],
)
def test_bad_model_config_is_a_short_usage_error(cli, tmp_path, text, message):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    code, err = cli("check", "plans/gpt2.tp", str(path), "--tp", "2")
    assert code == 2
    assert err.splitlines()[0] == f"error: model config {path}{message}"
    assert len(err) < 600  # never the expanded value


# ---- plan files: bounded and regular ---------------------------------------------------------------------


def test_special_and_oversized_plan_files_are_refused(cli, tmp_path):
    assert cli("check", "/dev/zero") == (
        2,
        "error: /dev/zero is not a regular file (a device, FIFO or socket); "
        "a plan is a text file\n",
    )
    fifo = tmp_path / "p.tp"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    assert cli("fmt", str(fifo))[1].startswith(f"error: {fifo} is not a regular file")
    big = tmp_path / "big.tp"
    big.write_text("dtp 1\n" + "#" * (4 * 2**20))
    assert cli("check", str(big)) == (
        2,
        f"error: plan file {big} is larger than 4 MiB; a plan is a page of text\n",
    )


def test_long_set_expression_is_a_positioned_error_not_a_recursion_error(cli, tmp_path):
    path = tmp_path / "plus.tp"
    path.write_text("dtp 1\nset transformer.h.0.attn.n_head = " + " + ".join(["1"] * 494) + "\n")
    for argv in (("check", str(path), "gpt2-tiny"), ("fmt", str(path))):
        code, err = cli(*argv)
        assert code == 2
        assert err.splitlines()[0] == (
            f"{path}:2:35: error: expression nested more than 64 operators deep; a `set` "
            "expression is a short formula such as `n_heads / tp`"
        )


def test_many_unmatched_rules_render_fifty_diagnostics_and_a_count(cli, tmp_path):
    path = tmp_path / "many.tp"
    n = 5_000
    path.write_text(
        "dtp 1\n" + "".join(f"transformer.h.{i}.mlp.c_fcx: colwise\n" for i in range(n))
    )
    code, err = cli("check", str(path), "gpt2-tiny", "--tp", "2")
    assert code == 2
    lines = err.splitlines()
    assert lines[0] == (
        f"{path}:2:1: error: pattern 'transformer.h.0.mlp.c_fcx' matches no module; "
        "did you mean 'transformer.h.0.mlp.c_fc'?"
    )
    assert lines[-2:] == [f"... and {n - 50} more", f"{n} errors"]
    assert sum(": error: " in line for line in lines) == 50


# ---- flags -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--timeout", "nan", "argument --timeout: expected a finite number > 0, got nan"),
        ("--timeout", "-5", "argument --timeout: expected a finite number > 0, got -5"),
        ("--timeout", "0", "argument --timeout: expected a finite number > 0, got 0"),
        ("--lr", "inf", "argument --lr: expected a finite number > 0, got inf"),
        ("--lr", "nan", "argument --lr: expected a finite number > 0, got nan"),
        ("--seed", "1e23", "argument --seed: expected an integer seed, got '1e23'"),
        (
            "--seed",
            str(2**64),
            f"argument --seed: seed must be between 0 and {2**63 - 2**16}, got {2**64}",
        ),
        ("--seed", "-1", f"argument --seed: seed must be between 0 and {2**63 - 2**16}, got -1"),
    ],
)
def test_bad_flag_values_exit_2(cli, flag, value, message):
    code, err = cli("apply", "plans/gpt2.tp", "gpt2-tiny", flag, value)
    assert code == 2
    assert err.splitlines()[-1] == f"dtp apply: error: {message}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["gpt2-tiny", "--tp", "1000", "--device", "cpu"],
            f"error: tp × dp = 1000 ranks is far more than this machine's {os.cpu_count()} cores "
            "can host",
        ),
        (
            ["megatron-8.3b", "--tp", "2", "--device", "cpu"],
            "error: this run needs about 404.7 GiB of memory (parameters 31.0 GiB",
        ),
        (
            ["gpt2-tiny", "--batch", "1000000", "--device", "cpu"],
            "error: this run needs about 778.2 GiB of memory (parameters 0.0 GiB, activations 194.5 "
            "GiB",
        ),
        (
            ["gpt2-tiny", "--json", "/proc/dtp-report.json"],
            "error: --json /proc/dtp-report.json: cannot write there",
        ),
        (
            ["tests.fixtures.hostile_models:no_embedding"],
            "error: model tests.fixtures.hostile_models:no_embedding has no nn.Embedding and no "
            "config.vocab_size",
        ),
    ],
)
def test_apply_refuses_before_any_rank_starts(cli, argv, message):
    code, err = cli("apply", "plans/gpt2.tp", *argv)
    assert code == 2
    assert err.splitlines()[0].startswith(message), err


def test_json_into_a_missing_directory_is_refused_before_launch(cli, tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    code, err = cli("apply", "plans/gpt2.tp", "gpt2-tiny", "--json", str(target / "r.json"))
    assert (code, err) == (
        2,
        f"error: --json {target / 'r.json'}: directory {target} does not exist\n",
    )


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "raise RuntimeError('no GPU here')\n",
            "importing '{m}' for model factory {m}:f raised RuntimeError: no GPU here",
        ),
        (
            "def f(:\n",
            "cannot import '{m}' for model factory {m}:f: SyntaxError in {path}:1: invalid syntax",
        ),
    ],
)
def test_factory_module_that_fails_to_import_is_a_usage_error(
    cli, tmp_path, monkeypatch, source, message
):
    name = f"dtp_safety_{abs(hash(source)) % 10**8}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = cli("check", "plans/gpt2.tp", f"{name}:f")
    assert code == 2
    assert err.splitlines()[0] == "error: " + message.format(m=name, path=path)


def test_device_auto_means_cuda_only_with_a_gpu_per_rank(monkeypatch):
    import torch

    from dtp.runtime.preflight import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto", 2) == "cpu"
    assert pick_device("auto", 1) == "cuda"
    assert pick_device("cpu", 1) == "cpu"


# ---- fuzz: a case is data ------------------------------------------------------------------------------------


def _case(tmp_path, **fields) -> str:
    data = json.loads(
        (REPO / "tests/regressions/shared-input-with-explicit-default.json").read_text()
    )
    path = tmp_path / "case.json"
    path.write_text(json.dumps({**data, **fields}))
    return str(path)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"model": "os:abort"},
            "error: case {p} names the model factory 'os:abort', which would import and run code; "
            "to "
            "run it, name it yourself: dtp fuzz --replay {p} --factory os:abort",
        ),
        ({"tp": "2"}, "error: case {p}: 'tp' must be an integer from 1 to 64, got '2'"),
        ({"tp": True}, "error: case {p}: 'tp' must be an integer from 1 to 64, got True"),
        ({"seq": -1}, "error: case {p}: 'seq' must be an integer from 1 to 65536, got -1"),
        (
            {"dtype": "int8"},
            "error: case {p}: 'dtype' must be one of float32, bfloat16, float64, got 'int8'",
        ),
        ({"plan": 7}, "error: case {p}: 'plan' must be the plan's text, got 7"),
        (
            {"model": {"family": "gpt", "dropout": "0.1"}},
            "error: model config in case {p}: dropout must be a number, got '0.1' (write numbers "
            "without quotes; YAML reads "
            "1e-5 as text: write 1.0e-5)",
        ),
        ({"tp": 64}, "error: tp × dp = 64 ranks is far more than this machine's"),
        ({"batch": 4096, "seq": 65536}, "error: this run needs about"),
    ],
)
def test_replayed_case_is_validated_before_any_rank_starts(
    cli, tmp_path, monkeypatch, fields, message
):
    monkeypatch.setattr(os, "abort", lambda: pytest.fail("a case ran os.abort"))
    path = _case(tmp_path, **fields)
    code, err = cli("fuzz", "--replay", path)
    assert code == 2
    assert err.splitlines()[0].startswith(message.format(p=path)), err


def test_fuzz_save_to_an_unwritable_directory_is_refused_first(cli):
    assert cli("fuzz", "--save", "/proc/dtp-cases", "--examples", "1") == (
        2,
        "error: --save /proc/dtp-cases: cannot write there (No such file or directory)\n",
    )
