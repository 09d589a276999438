"""Golden plans: every tests/golden/bad/*.tp fails `dtp check FILE MODEL --tp N` with exactly the
text in its sibling .err file; every tests/golden/good/*.tp passes and prints its sibling .out (and
its .err, when it has one: warnings).

N comes from a `# tp: N` comment on the file's first line (default 2), MODEL from a `# model: NAME`
comment on the second (default gpt2-tiny). Paths in the expected text are relative to the repository
root, where the tests run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtp import cli

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
BAD = sorted((GOLDEN / "bad").glob("*.tp"))
GOOD = sorted((GOLDEN / "good").glob("*.tp"))


def tp_of(path: Path) -> str:
    """The tp a golden file is checked at: `# tp: N` on its first line, else 2."""
    first = path.read_bytes().split(b"\n", 1)[0].decode("utf-8", "replace")
    m = re.match(r"#\s*tp:\s*(\d+)\s*$", first)
    return m.group(1) if m else "2"


def model_of(path: Path) -> str:
    """The model a golden file is checked against: `# model: NAME` on its second line, else
    gpt2-tiny."""
    lines = path.read_bytes().split(b"\n", 2)
    m = (
        re.match(r"#\s*model:\s*(\S+)\s*$", lines[1].decode("utf-8", "replace"))
        if len(lines) > 1
        else None
    )
    return m.group(1) if m else "gpt2-tiny"


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_golden_sets_are_complete():
    # Every bad plan has its expected stderr and every good plan its expected stdout; nothing is
    # orphaned.
    assert len(BAD) >= 30 and len(GOOD) >= 4
    for path in BAD:
        assert path.with_suffix(".err").is_file(), f"{rel(path)} has no .err"
    for path in GOOD:
        assert path.with_suffix(".out").is_file(), f"{rel(path)} has no .out"
    stems = {p.stem for p in BAD}
    assert {p.stem for p in (GOLDEN / "bad").glob("*.err")} == stems
    assert {p.stem for p in (GOLDEN / "good").glob("*.out")} == {p.stem for p in GOOD}
    assert {p.stem for p in (GOLDEN / "good").glob("*.err")} <= {p.stem for p in GOOD}


def test_tp_comment_is_read():
    assert tp_of(GOLDEN / "bad" / "divisibility_tp3.tp") == "3"
    assert tp_of(GOLDEN / "bad" / "heads_tp8.tp") == "8"
    assert tp_of(GOLDEN / "bad" / "syntax_empty.tp") == "2"
    assert tp_of(GOLDEN / "bad" / "syntax_missing_colon.tp") == "2"


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_plan(path: Path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = cli.main(["check", rel(path), model_of(path), "--tp", tp_of(path)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err == path.with_suffix(".err").read_text(encoding="utf-8")


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_good_plan(path: Path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = cli.main(["check", rel(path), model_of(path), "--tp", tp_of(path)])
    out, err = capsys.readouterr()
    warnings = path.with_suffix(".err")
    assert (rc, err) == (0, warnings.read_text(encoding="utf-8") if warnings.exists() else "")
    assert out == path.with_suffix(".out").read_text(encoding="utf-8")


def test_shipped_plan_checks_at_every_working_tp(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["check", "plans/gpt2.tp", "gpt2-tiny"]) == 0
    assert capsys.readouterr().out == (
        "plans/gpt2.tp: ok on gpt2-tiny: 10 modules claimed by 6 rules, "
        "0 attribute rewrites; tp values that work: 1, 2, 4\n"
    )
    for tp in (1, 2, 4):
        assert cli.main(["check", "plans/gpt2.tp", "gpt2-tiny", "--tp", str(tp)]) == 0
        assert capsys.readouterr().out == (
            f"plans/gpt2.tp: ok on gpt2-tiny: 10 modules claimed by 6 rules, "
            f"0 attribute rewrites; tp={tp}\n"
        )


def test_override_claims_follow_specificity():
    # The good override plan passes because the specific rules win; check who claims what.
    from dtp import models
    from dtp.checks.checker import check
    from dtp.lang.parse import load

    plan = load(GOLDEN / "good" / "override.tp")
    checked = check(plan, models.build("gpt2-tiny"), 2)
    claims = {
        path: (rule.pos.line, rule.style.name) for path, rule in checked.resolution.claims.items()
    }
    assert claims == {
        "transformer.wte": (5, "vocab_parallel"),
        "transformer.h.0.mlp.c_fc": (6, "colwise"),
        "transformer.h.1.mlp.c_fc": (6, "colwise"),
        "transformer.h.0.attn.c_attn": (7, "colwise"),
        "transformer.h.1.attn.c_attn": (7, "colwise"),
        "transformer.h.0.attn.c_proj": (8, "rowwise"),
        "transformer.h.1.attn.c_proj": (8, "rowwise"),
        "transformer.h.0.mlp.c_proj": (9, "rowwise"),
        "transformer.h.1.mlp.c_proj": (9, "rowwise"),
        "lm_head": (10, "vocab_parallel"),
    }
    assert checked.admissible_tp == (1, 2, 4)


def test_ranges_and_globstar_claims():
    from dtp import models
    from dtp.checks.checker import check
    from dtp.lang.parse import load

    model = models.build("gpt2-tiny")
    ranges = check(load(GOLDEN / "good" / "ranges.tp"), model, 4).resolution.claims
    assert {p: r.pos.line for p, r in ranges.items() if ".mlp." in p} == {
        "transformer.h.0.mlp.c_fc": 10,
        "transformer.h.0.mlp.c_proj": 11,
        "transformer.h.1.mlp.c_fc": 13,
        "transformer.h.1.mlp.c_proj": 14,
    }
    glob = check(load(GOLDEN / "good" / "globstar.tp"), model, 2)
    assert glob.plan.mesh == ("dp", "tp")
    assert sorted(
        p for p, r in glob.resolution.claims.items() if r.style.name == "sequence_parallel"
    ) == [
        "transformer.drop",
        "transformer.h.0.ln_1",
        "transformer.h.0.ln_2",
        "transformer.h.1.ln_1",
        "transformer.h.1.ln_2",
        "transformer.ln_f",
    ]
    # `**.lm_head`: `**` spans zero segments
    assert glob.resolution.claims["lm_head"].pos.line == 12


def test_real_console_script_reports_without_traceback():
    exe = Path(sys.executable).parent / "dtp"
    assert exe.is_file(), f"console script missing: {exe}"
    bad = GOLDEN / "bad" / "divisibility_tp3.tp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [str(exe), "check", rel(bad), "gpt2-tiny", "--tp", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr == bad.with_suffix(".err").read_text(encoding="utf-8")
    assert proc.stdout == ""
