"""`dtp search`: the precision it prices by default is the profile's best half precision, and the
commands it prints for the winner carry every flag of the priced layout and run as printed."""

from __future__ import annotations

import json
import shlex
import subprocess
import textwrap

import pytest
from conftest import dtp_cli

from dtp.auto.search import Candidate, Job, commands, default_precision, launch
from dtp.cli import main
from dtp.cli.program import build_parser
from dtp.errors import UsageError
from dtp.simulate.profile import load

SMALL = ("gpt2-tiny", "--gpus", "4", "--seq", "64", "--global-batch", "16")
# one micro-batch size and one data-parallel mode: the small search's pricing in a second
QUICK = ("--micro-batch", "4", "--dp-modes", "ddp")


def cpu_profile(tmp_path, gpus_per_node: int = 4) -> str:
    """A profile with only fp32, as `dtp simulate --calibrate` writes for a CPU."""
    path = tmp_path / "cpu.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            name: cpu
            gpu:
              name: cpu
              peak_tflops: {{fp32: 0.05}}
              achieved_fraction: 1.0
              memory_GiB: 8
              hbm_GBps: 10
            node:
              gpus: {gpus_per_node}
              intra: {{busbw_GBps: 1, latency_us: 50}}
              inter: {{busbw_GBps: 1, latency_us: 50}}
            """
        )
    )
    return str(path)


def search(*args: str, tmp_path) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `dtp search ARGS --json`; (the process, the JSON's best entry)."""
    out = tmp_path / "search.json"
    proc = dtp_cli("search", *args, "--json", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())["best"]


def printed_commands(stdout: str) -> list[str]:
    """The command lines under "run it:" (the note in parentheses left out)."""
    block = stdout.split("\nrun it:\n", 1)[1].splitlines()
    return [line.strip() for line in block if line.startswith("  ") and not line.startswith("  (")]


def candidate(**changes) -> Candidate:
    """A priced layout, as `search` returns it."""
    fields = dict(
        tp=8,
        dp=64,
        micro_batch=8,
        sequence_parallel=True,
        recompute="none",
        fsdp=False,
        iteration_s=1.96,
        tflops_per_gpu=27.5,
        memory_gib=22.8,
        fits=True,
        parts={},
        plan="",
    )
    return Candidate(**{**fields, **changes})


def test_default_precision_is_the_profiles_best_half_precision(tmp_path):
    assert default_precision(load("dgx2h-v100")) == "fp16"  # V100: no bf16
    assert default_precision(load("h100-sxm")) == "bf16"
    assert default_precision(load("a100-80gb")) == "bf16"
    assert default_precision(load(cpu_profile(tmp_path))) == "fp32"


def test_v100_search_prices_fp16_and_says_why(tmp_path):
    proc, best = search(*SMALL, "--profile", "dgx2h-v100", *QUICK, tmp_path=tmp_path)
    assert (
        "global batch 16, fp16 (the profile's best half precision; --precision overrides); "
        in proc.stdout
    )
    assert best["precision"] == "fp16"
    # training on that machine predicts on the same profile
    assert best["commands"][1].endswith(" --precision fp16 --profile dgx2h-v100")


def test_fp32_only_profile_prices_fp32(tmp_path):
    proc, best = search(*SMALL, "--profile", cpu_profile(tmp_path), *QUICK, tmp_path=tmp_path)
    assert "fp32 (the profile has no half precision; --precision overrides); " in proc.stdout
    assert best["precision"] == "fp32"


def test_precision_flag_overrides_the_default(tmp_path):
    proc, best = search(
        *SMALL, "--profile", "h100-sxm", *QUICK, "--precision", "fp32", tmp_path=tmp_path
    )
    assert "global batch 16, fp32; " in proc.stdout  # asked for: no reason given
    assert best["precision"] == "fp32"
    refused = dtp_cli("search", *SMALL, "--profile", "dgx2h-v100", "--precision", "bf16")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "error: --precision bf16: profile dgx2h-v100 has no peak_tflops for it (it has: fp16, fp32)"
    )


def test_printed_train_command_parses_with_dtp_train(tmp_path):
    """`dtp train`'s own parser takes the printed line and reads back the priced layout."""
    proc, best = search(*SMALL, "--profile", "h100-sxm", *QUICK, tmp_path=tmp_path)
    plan, train = printed_commands(proc.stdout)
    assert [plan, train] == best["commands"]
    sp = " --sequence-parallel" if best["sequence_parallel"] else ""
    assert plan == f"dtp plan --auto gpt2-tiny --tp {best['tp']}{sp} -o plan.tp"
    argv = shlex.split(train)
    assert argv[:2] == ["dtp", "train"]  # one node: no torchrun
    for flag in ("--batch", "--micro-batch", "--dp-mode", "--recompute", "--precision"):
        assert flag in argv
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"dtp train's parser rejects the printed command: {train}")
    assert (args.plan, args.model) == ("plan.tp", "gpt2-tiny")
    assert (args.tp, args.dp, args.tp * args.dp) == (best["tp"], best["dp"], 4)
    assert (args.batch, args.seq, args.precision) == (16, 64, "bf16")
    assert args.micro_batch == best["micro_batch"]
    assert args.dp_mode == best["dp_mode"]
    assert args.recompute == best["recompute"]
    assert args.profile == "h100-sxm"


def test_multi_node_search_prints_torchrun(tmp_path):
    two_per_node = cpu_profile(tmp_path, gpus_per_node=2)
    proc, best = search(*SMALL, "--profile", two_per_node, *QUICK, tmp_path=tmp_path)
    train = best["commands"][1]
    assert train.startswith(
        "torchrun --nnodes 2 --nproc-per-node 2 -m dtp train plan.tp gpt2-tiny "
    )
    assert (
        "  (on each of the 2 nodes, with the rendezvous flags torchrun needs, e.g. --rdzv-backend "
        "c10d --rdzv-endpoint HOST:PORT)\n" in proc.stdout
    )


def test_commands_carry_the_whole_layout_quoted():
    job = Job("my models/8.3b", gpus=512, seq=1024, global_batch=512, precision="fp16")
    assert commands(candidate(), job, gpus_per_node=16) == [
        "dtp plan --auto 'my models/8.3b' --tp 8 --sequence-parallel -o plan.tp",
        "torchrun --nnodes 32 --nproc-per-node 16 -m dtp train plan.tp 'my models/8.3b' --tp 8 "
        "--dp 64 --dp-mode ddp --batch 512 --micro-batch 8 --seq 1024 --recompute none "
        "--precision fp16",
    ]
    fsdp = candidate(tp=2, dp=4, micro_batch=2, sequence_parallel=False, fsdp=True, recompute="op")
    job = Job("gpt2-tiny", 8, 64, 16, "bf16", profile="this cpu.yaml")
    assert commands(fsdp, job, gpus_per_node=8) == [
        "dtp plan --auto gpt2-tiny --tp 2 -o plan.tp",
        "dtp train plan.tp gpt2-tiny --tp 2 --dp 4 --dp-mode fsdp --batch 16 --micro-batch 2 "
        "--seq 64 --recompute op --precision bf16 --profile 'this cpu.yaml'",
    ]


def test_launch_splits_a_job_evenly_over_nodes():
    assert launch(4, 8) == (1, 4)
    assert launch(512, 16) == (32, 16)
    assert launch(24, 16) == (2, 12)  # two nodes of 12: torchrun starts as many on each
    with pytest.raises(UsageError, match="17 GPUs do not split evenly over 2 nodes of 16"):
        launch(17, 16)


def test_printed_commands_run(tmp_path):
    """The two printed lines, run in a fresh directory: `dtp plan --auto` writes plan.tp, `dtp
    train` trains the priced layout on 4 CPU ranks."""
    # micro-batches of 8 leave dp at most 2 of the 4 ranks: the winner splits by tp too, so the
    # plan the first command writes is a sharded one
    proc, best = search(
        *SMALL, "--profile", cpu_profile(tmp_path), "--micro-batch", "8", tmp_path=tmp_path
    )
    assert (best["tp"], best["dp"], best["micro_batch"]) == (2, 2, 8)
    plan, train = (shlex.split(line) for line in printed_commands(proc.stdout))
    work = tmp_path / "run"
    work.mkdir()
    # `dtp` as this interpreter's module (the checkout, installed or not); the flags appended to
    # train only keep the test short and off any GPU: two steps, no float64 replay, out in tmp
    extra = ["--steps", "2", "--verify-every", "0", "--out", str(work / "out"), "--device", "cpu"]
    for argv in (plan, train + extra):
        assert argv[0] == "dtp"
        done = dtp_cli(*argv[1:], cwd=work, timeout=240)
        assert done.returncode == 0, shlex.join(argv) + "\n" + done.stderr
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert len(summary["losses"]) == 2
    config = summary["config"]
    assert (config["tp"], config["dp"], config["batch"], config["seq"]) == (
        best["tp"],
        best["dp"],
        16,
        64,
    )
    assert config["micro_batch"] == best["micro_batch"]
    assert config["recompute"] == best["recompute"]
    assert config["dp_mode"] == best["dp_mode"]
    assert (best["precision"], config["dtype"]) == ("fp32", "float32")  # the fp32-only profile's


def test_seq_beyond_the_block_size_is_named_before_any_pricing(repo, capsys):
    """Not "no layout divides the batch": the sequence is too long for the model."""
    argv = ["search", *SMALL[:3], "--profile", "h100-sxm"]
    assert main([*argv, "--seq", "100000", "--global-batch", "16"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "error: --seq 100000 exceeds the block size of gpt2-tiny: at most 64 tokens per sequence\n"
    )
    assert captured.out == ""  # nothing priced, no progress lines
    assert main([*argv, "--seq", "64", "--global-batch", "16", *QUICK]) == 0


def test_a_profile_directory_is_named_as_one(repo, capsys, tmp_path):
    assert main(["search", *SMALL, "--profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: --profile {tmp_path} is a directory: give a profile YAML file or a shipped "
        "profile (a100-80gb, "
    )
    assert len(err.splitlines()) == 1


def test_a_batch_no_layout_divides_is_refused_before_any_pricing(repo, capsys):
    argv = ["search", *SMALL[:5], "--global-batch", "2", "--micro-batch", "4"]
    assert main([*argv, "--profile", "h100-sxm"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "error: no layout of 4 GPUs divides --global-batch 2 into dp × micro-batch: dp 1, 2, 4 "
        "with micro-batches of 4\n"
    )


def test_heads_that_divide_no_tp_leave_attention_whole_and_say_so(repo, capsys, tmp_path):
    """3 heads on 2 GPUs, one sequence per iteration: only tp 2 divides the batch, its auto plan
    keeps attention replicated, and the search prices it and names what it keeps whole."""
    spec = tmp_path / "gpt3heads.yaml"
    spec.write_text(
        "n_layer: 2\nn_head: 3\nn_embd: 48\nvocab_size: 256\nblock_size: 64\ndropout: 0.0\n"
        "bias: true\ntie_embeddings: true\n"
    )
    argv = [str(spec), "--profile", "h100-sxm", "--gpus", "2", "--seq", "64", "--global-batch"]
    assert main(["search", *argv, "1", "--micro-batch", "1", "--dp-modes", "ddp"]) == 0
    out = capsys.readouterr().out
    layouts = [line.split()[1:4] for line in out.splitlines() if line[:4].strip().isdigit()]
    assert layouts and all(words == ["tp", "2", "×"] for words in layouts)
    assert (
        "the tp 2 plan keeps whole on every rank: transformer.h.*.attn: 3 query heads "
        "(config.n_head) do not divide by tp=2\n" in out
    )
