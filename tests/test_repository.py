"""The repository holds the product, not the lab notebook: bench/results keeps one small report per
claim the docs make (raw runs, plots and logs stay in the history, not the tree), nothing tracked is
over 200 KB, and the wheel's dtp/bench is `dtp bench` and its documented tp 1 comparison, no lab
harness (those are scripts in the checkout's bench/, which the wheel does not ship)."""

from __future__ import annotations

import ast
import subprocess
import tomllib

import yaml
from conftest import REPO

MAX_REPORTS = 30
MAX_KB = 200  # .pre-commit-config.yaml's check-added-large-files --maxkb
# dtp/bench modules that are entries of their own: the package face, `dtp
# bench`'s main, and the tp 1 comparison with a plain transformers loop (docs/bench.md). Every other
# module must be reached from these by imports; a module nothing reaches is a lab harness and
# belongs in bench/.
BENCH_ENTRIES = {"__init__", "run", "plain_tp1"}


def _git(*args: str) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    ).stdout
    return [name for name in out.split("\0") if name]


def _committed(folder: str) -> list:
    """The files under `folder` that the next commit holds (`git add -A`): tracked or addable,
    present."""
    names = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", folder)
    return sorted({REPO / n for n in names if (REPO / n).is_file()})


def test_this_is_a_git_checkout():
    assert (
        subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--is-inside-work-tree"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "true"
    ), f"{REPO} is not a git checkout"


def test_bench_results_holds_a_few_small_reports():
    files = _committed("bench/results")
    assert 0 < len(files) <= MAX_REPORTS, [str(f.relative_to(REPO)) for f in files]
    assert {f.suffix for f in files} <= {".md", ".yaml"}, (
        "raw runs, plots and logs stay out of the tree (the reports name their commit)"
    )


def test_nothing_tracked_is_over_the_size_limit():
    big = {
        str(f.relative_to(REPO)): f.stat().st_size // 1024
        for f in _committed(".")
        if f.stat().st_size > MAX_KB * 1024
    }
    assert not big, f"files over {MAX_KB} KB (KB): {big}"


def test_pre_commit_refuses_large_files_at_the_same_limit():
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    assert hooks["check-added-large-files"]["args"] == [f"--maxkb={MAX_KB}"]


def _bench_imports(name: str) -> set[str]:
    tree = ast.parse((REPO / "dtp" / "bench" / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "dtp.bench":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtp.bench."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("dtp.bench.")}
    return found


def test_the_wheel_holds_no_lab_harness():
    modules = {p.stem for p in (REPO / "dtp" / "bench").glob("*.py")}
    reached, todo = set(), list(BENCH_ENTRIES & modules)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += sorted(_bench_imports(name) & modules)
    assert modules - reached == set(), (
        "dtp/bench modules `dtp bench` never imports: lab harnesses belong in bench/"
    )
    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "targets"
    ]["wheel"]
    assert wheel["packages"] == ["dtp"] and not any(
        k.startswith("bench") for k in wheel.get("force-include", {})
    )
