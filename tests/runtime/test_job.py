"""One job, one pre-flight, one launch (dtp/runtime/job.py, dtp/runtime/preflight.py): a job is
validated once with one message per condition, `dtp apply` and `dtp train` refuse the same input in
the same words, the ranks run the text the parent checked, and a command parses its plan once per
process and checks it once."""

from __future__ import annotations

import math
import os
import pickle
import sys
from collections import Counter
from dataclasses import replace

import pytest

import dtp.checks.checker
import dtp.lang.parse
from dtp.cli import main
from dtp.errors import PlanError, UsageError
from dtp.runtime.job import MAX_SEED, MAX_TIMEOUT, Job
from dtp.runtime.preflight import prepare
from dtp.train import data
from dtp.train.loop import TrainConfig
from dtp.train.session import run_training, summary
from dtp.verify.apply import prepare_apply, run_prepared
from dtp.verify.rank import RunConfig

TINY = "dtp 1\nplan tiny\n"  # a plan text for jobs that are never run
TORCHRUN = {
    "WORLD_SIZE": "2",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
# what the plan file says once the parent has checked it
BROKEN = "dtp 1\ntransformer.h.*.mlp.c_fc: colwse\n"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tp": 0}, "--tp must be a positive integer, got 0"),
        ({"dp": True}, "--dp must be a positive integer, got True"),
        ({"batch": 2.0}, "--batch must be a positive integer, got 2.0"),
        ({"seq": -1}, "--seq must be a positive integer, got -1"),
        ({"batch": 3, "dp": 2}, "--batch 3 (the global batch) must divide by --dp 2"),
        ({"seed": -1}, f"--seed must be an integer between 0 and {MAX_SEED}, got -1"),
        ({"dtype": "float16"}, "--dtype must be one of float32, bfloat16, float64, got 'float16'"),
        ({"device": "tpu"}, "--device must be one of auto, cpu, cuda, got 'tpu'"),
        (
            {"timeout": math.nan},
            f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT:.0f}], got nan",
        ),
        ({"timeout": 0}, f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT:.0f}], got 0"),
        (
            {"model": " "},
            "MODEL must name a model (a zoo name, a model YAML, package.module:factory or a "
            "save_pretrained directory), got ' '",
        ),
        ({"plan_text": b"dtp 1\n"}, "the plan's text must be a string, got bytes"),
        ({"plan": "missing.tp", "plan_text": None}, "plan file missing.tp does not exist"),
    ],
)
def test_a_job_refuses_each_bad_field_with_its_own_message(repo, fields, message):
    with pytest.raises(UsageError) as info:
        Job(**{"plan": "tiny.tp", "plan_text": TINY, "model": "gpt2-tiny", **fields})
    assert str(info.value) == message


@pytest.mark.parametrize(
    "config, fields, message",
    [
        (RunConfig, {"steps": 0}, "--steps must be a positive integer, got 0"),
        (RunConfig, {"max_seq": 0}, "--max-seq must be a positive integer, got 0"),
        (
            TrainConfig,
            {"dtype": "float64"},
            "--dtype must be one of float32, bfloat16, float16, got 'float64'",
        ),
        (TrainConfig, {"lr": math.inf}, "--lr must be a finite number > 0, got inf"),
        (TrainConfig, {"clip": -1.0}, "--clip must be a finite number ≥ 0, got -1.0"),
        (TrainConfig, {"min_lr": 1.0}, "--min-lr 1.0 is above --lr 0.003"),
        (TrainConfig, {"warmup": 201}, "--warmup 201 is longer than --steps 200"),
        (TrainConfig, {"save_every": 5}, "--save-every needs --checkpoint DIR (where to save)"),
        (TrainConfig, {"convert": True}, "--convert applies to --resume DIR only"),
        # the Job's own
        (TrainConfig, {"batch": 3, "dp": 2}, "--batch 3 (the global batch) must divide by --dp 2"),
    ],
)
def test_the_commands_configs_are_jobs_validated_once(config, fields, message):
    with pytest.raises(UsageError) as info:
        config(plan="tiny.tp", plan_text=TINY, model="gpt2-tiny", **fields)
    assert str(info.value) == message


def test_a_job_reads_its_plan_once_and_keeps_the_text(tmp_path):
    path = tmp_path / "p.tp"
    path.write_text(TINY)
    job = TrainConfig(plan=str(path), model="gpt2-tiny")
    path.unlink()  # never read again: not by a copy, not by a rank
    again = replace(job, tp=4)
    assert job.plan_text == again.plan_text == TINY and again.plan == str(path)
    # reports name the plan; the text ran
    assert job.warmup == 20 and "plan_text" not in job.to_json()


def _refusal(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (
            ["plans/gpt2.tp", "gpt2-tiny", "--tp", "4"],
            TORCHRUN,
            "error: --tp 4 × --dp 1 = 4 ranks, but torchrun started WORLD_SIZE=2\n",
        ),
        (
            ["plans/gpt2.tp", "tests.fixtures.hostile_models:no_embedding"],
            {},
            "error: model tests.fixtures.hostile_models:no_embedding has no nn.Embedding and no "
            "config.vocab_size: dtp "
            "feeds it token ids, so it must know the vocabulary size\n",
        ),
        (
            ["plans/gpt2.tp", "tests.fixtures.hostile_models:nested_2000"],
            {},
            "error: model factory tests.fixtures.hostile_models:nested_2000 nests modules 2002 "
            "deep; torch walks a model recursively (named_modules), and dtp takes at most 200 "
            "levels\n",
        ),
        (
            ["plans/gpt2.tp", "gpt2-tiny", "--seq", "65"],
            {},
            "error: --seq 65 exceeds the model's block_size 64\n",
        ),
        (
            ["plans/gpt2.tp", "gpt2-tiny", "--batch", "3", "--dp", "2"],
            {},
            "error: --batch 3 (the global batch) must divide by --dp 2\n",
        ),
    ],
)
def test_apply_and_train_refuse_the_same_input_in_the_same_words(
    repo, tmp_path, capsys, monkeypatch, argv, env, message
):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    applied = _refusal(capsys, "apply", *argv)
    trained = _refusal(capsys, "train", *argv, "--out", str(tmp_path / "out"))
    assert applied == trained == message


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Count every call of the parser and the checker, in this process and in the ranks it forks (a
    log line per call, by process id): patched wherever dtp imported them."""
    log = tmp_path / "calls.log"
    for fn, kind in ((dtp.lang.parse.parse, "parse"), (dtp.checks.checker.check, "check")):

        def wrapper(*args, _fn=fn, _kind=kind, **kwargs):
            with open(log, "a") as f:
                f.write(f"{_kind} {os.getpid()}\n")
            return _fn(*args, **kwargs)

        for name, module in list(sys.modules.items()):
            if name.startswith("dtp"):
                for attr, value in list(vars(module).items()):
                    if value is fn:
                        monkeypatch.setattr(module, attr, wrapper)

    def counts() -> dict[str, Counter]:
        """{"parent": Counter(parse=…, check=…), "ranks": Counter over every rank}"""
        calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
        me = str(os.getpid())
        return {
            "parent": Counter(k for k, pid in calls if pid == me),
            "ranks": Counter(k for k, pid in calls if pid != me),
        }

    return counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_parses_once_and_checks_once(repo, capsys, counted, dtype):
    assert (
        main(
            [
                "apply",
                "plans/gpt2.tp",
                "gpt2-tiny",
                "--tp",
                "2",
                "--steps",
                "1",
                "--seq",
                "8",
                "--dtype",
                dtype,
            ]
        )
        == 0
    )
    assert "parity vs unsharded reference: OK" in capsys.readouterr().out
    # 2026-12-05: 3 parses and 3 checks (5 and 5 in bfloat16: each rank re-read and re-checked the
    # file per run); 2026-12-06: each rank parsed the checked text. Now the ranks take the plan as
    # the pre-flight parsed and checked it.
    assert counted() == {"parent": Counter(parse=1, check=1), "ranks": Counter()}


def test_apply_ranks_run_the_text_the_parent_checked(repo, tmp_path, counted):
    path = tmp_path / "gpt2.tp"
    path.write_text((repo / "plans/gpt2.tp").read_text())
    prepared = prepare_apply(RunConfig(plan=str(path), model="gpt2-tiny", tp=2, seq=8, steps=1))
    # edited after the check: a rank that read the file would fail to parse it
    path.write_text(BROKEN)
    report = run_prepared(prepared)
    assert report.ok and report.plan["name"] == "gpt2-megatron" and report.plan["file"] == str(path)
    assert report.collectives["by_op"] == {"all_reduce": 13}  # Megatron's count for gpt2.tp at tp 2
    assert counted() == {"parent": Counter(parse=1, check=1), "ranks": Counter()}
    with pytest.raises(PlanError):  # the file as it is now is refused, by a job made from it
        prepare(RunConfig(plan=str(path), model="gpt2-tiny"))


def test_train_ranks_run_the_text_the_parent_checked_and_the_summary_checks_nothing(
    repo, tmp_path, counted
):
    path = tmp_path / "gpt2.tp"
    path.write_text((repo / "plans/gpt2.tp").read_text())
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    cfg = TrainConfig(
        plan=str(path),
        model="gpt2-tiny",
        tp=2,
        batch=2,
        seq=16,
        steps=2,
        eval_every=2,
        eval_batches=1,
        out=str(tmp_path / "out"),
    )
    prepared = prepare(cfg, weights=False)
    path.write_text(BROKEN)
    corpus = data.prepare(str(text), tmp_path / "cache", model_vocab=prepared.vocab)
    results = run_training(prepared, corpus)
    s = summary(prepared, corpus, results)
    assert len(s["losses"]) == 2 and all(math.isfinite(loss) for loss in s["losses"])
    assert s["collectives"]["by_op"] == {"all_reduce": 13} and s["config"]["plan"] == str(path)
    # before: 4 and 4
    assert counted() == {"parent": Counter(parse=1, check=1), "ranks": Counter()}


def test_a_prepared_job_carries_its_checked_plan_to_spawned_ranks(repo):
    """CUDA ranks are spawned, so the job is pickled: the plan arrives as it was checked, equal and
    with its text; a report names the plan, never its text or its parse."""
    prepared = prepare(RunConfig(plan="plans/gpt2.tp", model="gpt2-tiny", tp=2, seq=8))
    arrived = pickle.loads(pickle.dumps(prepared.job))
    assert arrived.plan_ir() == prepared.checked.plan
    assert arrived.plan_ir().source == (repo / "plans/gpt2.tp").read_text()
    assert arrived == prepared.job  # the parse is not part of what the job is
    assert {"plan_text", "parsed"}.isdisjoint(arrived.to_json())
    # a job no pre-flight made parses its text itself
    assert RunConfig(plan="plans/gpt2.tp", model="gpt2-tiny").plan_ir() == prepared.checked.plan
