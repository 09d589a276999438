"""Outputs never clobber what is not a regular file, user YAML/JSON goes through one
bounded loader, imported HF plans are data, and flags are bounded — each refusal exit 2, one short
paragraph, no traceback."""

from __future__ import annotations

import os
import stat
import sys
import time

import pytest

from dtp.cli import main
from dtp.errors import UsageError
from dtp.files import replace_atomically

PLAN, MODEL = "plans/gpt2.tp", "gpt2-tiny"
LAUGHS = "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
)
# ~600 bytes, 9^9 strings expanded
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + LAUGHS + "name: *i\n"


def refused(capsys, argv: list[str]) -> str:
    """stderr of `dtp ARGV`, which must exit 2 with one short paragraph and no traceback."""
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err) < 1024 and time.perf_counter() - start < 20
    return err.strip().splitlines()[-1]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)  # opening it to write would wait for a reader forever
    return path


def _is_char_device(path: str) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


# ---- outputs ---------------------------------------------------------------------------------------------


def test_export_never_replaces_dev_null_or_a_fifo(repo, capsys, tmp_path, fifo):
    assert _is_char_device("/dev/null")
    link = tmp_path / "link"
    link.symlink_to("/dev/null")
    for target, kind in (
        ("/dev/null", "a character device"),
        (str(link), "a character device"),
        (str(fifo), "a FIFO"),
    ):
        for fmt in ("torch", "safetensors"):
            err = refused(capsys, ["export", str(tmp_path), "--format", fmt, "-o", target])
            assert err == f"error: -o {target} is {kind}; dtp writes only regular files"
    assert (
        _is_char_device("/dev/null") and stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
    )
    # no temp file left beside them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link"]


def test_replace_atomically_itself_refuses_what_is_not_a_regular_file(tmp_path, fifo):
    for target in (fifo, tmp_path, "/dev/null"):
        with pytest.raises(UsageError, match="dtp writes only regular files|is a directory"):
            replace_atomically(target, lambda tmp: tmp.write_text("x"))
    assert _is_char_device("/dev/null") and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["export", "{tmp}", "-o", "/proc/x"],
            "error: -o /proc/x: cannot write there (/proc holds the kernel's files",
        ),
        (
            ["export", "{tmp}", "-o", "/sys/x.pt"],
            "error: -o /sys/x.pt: cannot write there (/sys holds the kernel's files",
        ),
        (
            ["export", "{tmp}", "--hf-dir", "{file}"],
            "error: --hf-dir {file} exists and is a file, not a directory",
        ),
        (
            ["export", "{tmp}", "--hf-dir", "/dev/null"],
            "error: --hf-dir /dev/null exists and is a character device",
        ),
        (
            ["plan", "--from-hf", MODEL, "-o", "/proc/x"],
            "error: -o /proc/x: cannot write there (/proc holds",
        ),
        (
            ["plan", "--from-hf", MODEL, "-o", "{fifo}"],
            "error: -o {fifo} is a FIFO; dtp writes only regular files",
        ),
        (
            ["plan", "--from-hf", MODEL, "-o", "{tmp}"],
            "error: -o {tmp} is a directory; give a file path",
        ),
        (
            ["train", PLAN, MODEL, "--out", "{file}"],
            "error: --out {file} exists and is a file, not a directory",
        ),
        (
            ["train", PLAN, MODEL, "--out", "/proc/x"],
            "error: --out /proc/x: cannot write there (/proc holds",
        ),
        (
            ["train", PLAN, MODEL, "--out", "{file}/sub"],
            "error: --out {file}/sub: {file} is a file, so no directory",
        ),
        (
            ["train", PLAN, MODEL, "--json", "/dev/null"],
            "error: --json /dev/null is a character device",
        ),
        (
            ["train", PLAN, MODEL, "--checkpoint", "{fifo}"],
            "error: --checkpoint {fifo} exists and is a FIFO",
        ),
        (["apply", PLAN, MODEL, "--json", "{fifo}"], "error: --json {fifo} is a FIFO"),
        (
            ["apply", PLAN, MODEL, "--json", "/dev/null"],
            "error: --json /dev/null is a character device",
        ),
        (
            ["simulate", PLAN, MODEL, "--profile", "dgx-a100", "--json", "{fifo}"],
            "error: --json {fifo} is a FIFO",
        ),
        (
            ["simulate", "--calibrate", "-o", "/proc/self/x.yaml"],
            "error: -o /proc/self/x.yaml: cannot write there",
        ),
        (
            ["explain", PLAN, MODEL, "--tp", "2", "--json", "/dev/null"],
            "error: --json /dev/null is a character device",
        ),
        (
            ["fuzz", "--save", "{file}"],
            "error: --save {file} exists and is a file, not a directory",
        ),
        (["export", "{tmp}", "-o", "{loop}"], "error: -o {loop}: not a usable path"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_every_output_flag_refuses_what_is_not_a_place_for_it(
    repo, capsys, tmp_path, fifo, argv, message
):
    names = {"tmp": tmp_path, "fifo": fifo, "file": tmp_path / "file", "loop": tmp_path / "loop"}
    names["file"].write_text("keep\n")
    names["loop"].symlink_to(names["loop"])
    err = refused(capsys, [a.format(**names) for a in argv])
    assert err.startswith(message.format(**names)), err
    assert names["file"].read_text() == "keep\n" and _is_char_device("/dev/null")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file", "loop"]  # nothing created


# ---- flags -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["apply", PLAN, MODEL, "--timeout", "1e15"],
            "argument --timeout: expected at most 604800 seconds (a week), got 1e15",
        ),
        (
            ["train", PLAN, MODEL, "--timeout", "1e15"],
            "argument --timeout: expected at most 604800 seconds (a week), got 1e15",
        ),
        (
            ["fuzz", "--timeout", "1e300"],
            "argument --timeout: expected at most 604800 seconds (a week), got 1e300",
        ),
        (
            ["train", PLAN, MODEL, "--max-rank-memory", "9" * 400],
            f"argument --max-rank-memory: expected at most {2**60} bytes (1 EiB), got '{'9' * 40}'",
        ),
        (
            ["train", PLAN, MODEL, "--max-rank-memory", "2000000000GiB"],
            f"argument --max-rank-memory: expected at most {2**60} bytes (1 EiB), got "
            "'2000000000GiB'",
        ),
        (
            ["train", PLAN, MODEL, "--steps", "9" * 5000],
            f"argument --steps: expected a positive integer, got '{'9' * 40}'",
        ),
    ],
)
def test_flag_bounds(capsys, argv, message):
    assert refused(capsys, argv).endswith(f"error: {message}")


# ---- user YAML and JSON: one bounded loader --------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        (LAUGHS, "is not valid YAML: aliases (*name) are not allowed in a profile"),
        ("name: x\ngpu: " + "[" * 5000 + "]" * 5000 + "\n", "nests too deeply to be a profile"),
        (
            "name: x\ngpu: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
            "nests too deeply to be a profile",
        ),
        (
            "name: x\ngpu: {memory_GiB: " + "9" * 5000 + "}\n",
            "is not valid YAML: Exceeds the limit (4300 digits)",
        ),
        ("name: x\n" + "k" * 60000 + ": 1\n", "is not valid YAML: while scanning a simple key"),
        ("#\n" * 40000, "is 80000 bytes; a profile is at most 64 KiB"),
    ],
    ids=["billion-laughs", "deep-lists", "deep-maps", "huge-int", "huge-key", "big"],
)
def test_hostile_profiles(repo, capsys, tmp_path, text, message):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    err = refused(capsys, ["simulate", PLAN, MODEL, "--profile", str(path)])
    assert err.startswith(f"error: profile {path} {message}"), err


def test_a_profile_that_is_a_fifo_or_a_device_is_never_opened_for_long(repo, capsys, fifo):
    for path in (str(fifo), "/dev/zero", str(fifo.parent)):  # a directory too: never a traceback
        assert (
            refused(capsys, ["simulate", PLAN, MODEL, "--profile", path])
            == f"error: profile {path} is not a regular file"
        )


def test_deeply_nested_model_config(repo, capsys, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("n_layer: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")
    assert (
        refused(capsys, ["check", PLAN, str(path)])
        == f"error: model config {path} nests too deeply to be a model config"
    )


@pytest.mark.parametrize(
    "text, reason",
    [
        ("[" * 100000 + "]" * 100000, "case {p} nests too deeply to be a case"),
        ('{"a": ' * 40 + "1" + "}" * 40, "case {p} nests too deeply to be a case"),
        (
            '{"tp": ' + "9" * 5000 + "}",
            "case {p} is not valid JSON: Exceeds the limit (4300 digits)",
        ),
    ],
)
def test_hostile_fuzz_cases(repo, capsys, tmp_path, text, reason):
    path = tmp_path / "case.json"
    path.write_text(text)
    err = refused(capsys, ["fuzz", "--replay", str(path)])
    assert err.startswith(
        f"error: cannot replay {path}: not a saved dtp fuzz case ({reason.format(p=path)}"
    ), err


# ---- imported HF plans are data --------------------------------------------------------------------------

FACTORY = """
import torch.nn as nn


class Config:
    model_type = "injected"
    base_model_tp_plan = {"layers.*.q_proj\\nlm_head": "colwise", "layers.*.k_proj": "colwise\\nmodel.embed_tokens: rowwise",
                          "layers.*.v_proj": "colwise", "layers.*.o_proj": "rowwise", "set": "colwise",
                          "layers.*.gate\\x00": "colwise", "layers.*.up": ["colwise"]}


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([Layer()])


class Model(nn.Module):
    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        self.config, self.model, self.lm_head = Config(), Base(), nn.Linear(8, 16)


def make():
    return Model()
"""


def test_from_hf_entries_cannot_inject_rules(repo, capsys, tmp_path, monkeypatch):
    from dtp.lang.parse import parse

    name = f"dtp_injected_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "imported.tp"
    assert main(["plan", "--from-hf", f"{name}:make", "-o", str(out)]) == 0
    sys.modules.pop(name, None)
    warnings = capsys.readouterr().err.splitlines()
    text = out.read_text()
    rules = [(str(r.pattern), r.style.name) for r in parse(text, str(out)).body]
    assert rules == [("model.layers.*.v_proj", "colwise"), ("model.layers.*.o_proj", "rowwise")]
    assert "lm_head" not in text and "embed_tokens" not in text  # not even in comments
    assert all("\n" not in w for w in warnings) and len(warnings) == 4
    assert (
        "warning: 'model.layers.*.q_proj\\nlm_head': not a module path the plan language can hold"
        in warnings[0]
    )
    assert warnings[1] == (
        "warning: model.layers.*.k_proj: 'colwise\\nmodel.embed_tokens: rowwise' is not a "
        "Hugging Face style name; entry dropped"
    )
    assert all(w.endswith("entry dropped") for w in warnings)


def test_imported_keys_are_patterns_of_the_plan_language():
    from dtp.hf.plan import import_plan
    from dtp.lang.parse import parse

    text, warnings = import_plan(
        {
            "plan": "colwise",
            "dtp": "rowwise",
            "a.[0..3].b": "colwise",
            "x" * 600: "colwise",
            "lm_head": "colwise\r",
            "a\tb": "colwise",
            "a.b": "rowwise",
        }
    )
    assert [str(r.pattern) for r in parse(text, "<imported>").body] == ["a.b"]
    assert len(warnings) == 6 and all(
        w.endswith("entry dropped") and len(w) < 300 for w in warnings
    )
