"""tp 1 against plain PyTorch: `dtp train PLAN gpt2-tiny --tp 1` beside a single-process training
loop on transformers' GPT2LMHeadModel with the same dimensions, batch, optimizer and threads.

    python -m dtp.bench.plain_tp1 [--repeats 3] [--steps 200] [--threads N] [--base DIR] [--out
    FILE] [--apply]
                                  [--device cuda]

Each arm is a fresh process, the arms interleaved and their order rotated per repeat; the machine's
load (`/proc/loadavg`) is recorded before every run, since a shared machine's numbers mean little
without it. `--base DIR` adds the arm `dtp train` from another source tree (e.g. `git archive
HEAD`), for before/after. Tokens/s are per-step medians after the first step (dtp's own summary; the
loop measures the same way). `--apply` compares `dtp apply PLAN gpt2-tiny --tp 1` instead (its
report's median step time, batch 2 × 16, SGD) with the same loop at apply's shape and optimizer
(forward, loss, backward, SGD step: what apply times). `--device cuda` runs both arms on the GPU
(fp32, as both default): at gpt2-tiny's size every kernel is shorter than its launch, so the
comparison is the host's cost per step, which is where DTensor's per-op cost would show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dtp.runtime.threads import cores

DIMS = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64)  # gpt2-tiny
BATCH, SEQ = 8, 64
APPLY_BATCH, APPLY_SEQ, APPLY_LR = 2, 16, 0.1  # dtp apply's defaults (dtp.verify.rank.RunConfig)


def _hf_model(threads: int, device: str = "cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel  # optional package

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=DIMS["n_layer"],
        n_head=DIMS["n_head"],
        n_embd=DIMS["n_embd"],
        vocab_size=DIMS["vocab_size"],
        n_positions=DIMS["block_size"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg).to(device).train()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_apply_loop(steps: int, threads: int, device: str = "cpu") -> float:
    """tokens/s of a plain loop at `dtp apply`'s shape: GPT2LMHeadModel, forward, loss, backward,
    torch SGD."""
    model = _hf_model(threads, device)
    opt = torch.optim.SGD(model.parameters(), lr=APPLY_LR)
    data = torch.randint(0, DIMS["vocab_size"], (steps, APPLY_BATCH, APPLY_SEQ + 1), device=device)
    times = []
    for s in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        logits = model(data[s, :, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[s, :, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return APPLY_BATCH * APPLY_SEQ / statistics.median(times[1:])


def hf_loop(steps: int, threads: int, device: str = "cpu") -> float:
    """tokens/s of a plain loop: GPT2LMHeadModel, torch AdamW (β 0.9/0.95, decay on matrices), clip
    1.0."""
    model = _hf_model(threads, device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # torch's defaults otherwise, as a user writes it
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    data = torch.randint(0, DIMS["vocab_size"], (steps, BATCH, SEQ + 1), device=device)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        ids = data[s]
        logits = model(ids[:, :-1]).logits  # (B, T, vocab)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the loss is read every step, as dtp train does (on a GPU: the step's sync)
        times.append(time.perf_counter() - t0)
    return BATCH * SEQ / statistics.median(times[1:])


class ArmFailed(RuntimeError):
    """An arm's process exited non-zero (its stderr's end in the message)."""


def hf_loop_process(steps: int, threads: int, apply: bool = False, device: str = "cpu") -> float:
    """`hf_loop` (or `hf_apply_loop`) in a fresh process, as every arm runs."""
    cmd = [
        sys.executable,
        "-m",
        "dtp.bench.plain_tp1",
        "--hf-loop",
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--device",
        device,
    ] + (["--apply"] if apply else [])
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    if done.returncode:
        raise ArmFailed(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def _dtp(args: list[str], threads: int, src: str | None) -> None:
    """`python -m dtp ARGS` on `threads` intra-op threads (from `src`'s dtp when given); ArmFailed
    on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **({"PYTHONPATH": src} if src else {})}
    cmd = [sys.executable, "-m", "dtp", *args]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=src or None, timeout=900
    )
    if done.returncode:
        raise ArmFailed(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")


def dtp_apply(steps: int, threads: int, plan: str, src: str | None, device: str = "cpu") -> float:
    """tokens/s from `dtp apply PLAN gpt2-tiny --tp 1`'s median step time (from `src`'s dtp when
    given)."""
    with tempfile.TemporaryDirectory(prefix="dtp-bench-tp1-") as tmp:
        report = Path(tmp, "apply.json")
        _dtp(
            [
                "apply",
                plan,
                "gpt2-tiny",
                "--tp",
                "1",
                "--steps",
                str(steps),
                "--batch",
                str(APPLY_BATCH),
                "--seq",
                str(APPLY_SEQ),
                "--json",
                str(report),
                "--device",
                device,
            ],
            threads,
            src,
        )
        return APPLY_BATCH * APPLY_SEQ / (json.loads(report.read_text())["step_time_ms"] / 1e3)


def dtp_train(steps: int, threads: int, plan: str, src: str | None, device: str = "cpu") -> float:
    """tokens/s from `dtp train PLAN gpt2-tiny --tp 1`'s summary (from `src`'s dtp when given)."""
    with tempfile.TemporaryDirectory(prefix="dtp-bench-tp1-") as tmp:
        _dtp(
            [
                "train",
                plan,
                "gpt2-tiny",
                "--tp",
                "1",
                "--steps",
                str(steps),
                "--batch",
                str(BATCH),
                "--seq",
                str(SEQ),
                "--eval-every",
                str(steps),
                "--out",
                tmp,
                "--device",
                device,
            ],
            threads,
            src,
        )
        return json.loads(Path(tmp, "summary.json").read_text())["tokens_per_s"]


def _load() -> str:
    """The 1, 5 and 15-minute load averages, as uptime prints them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved comparison; print a markdown table, write JSON to --out."""
    ap = argparse.ArgumentParser(prog="python -m dtp.bench.plain_tp1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--threads",
        type=int,
        default=cores(),
        help="intra-op threads of every arm (default: every core)",
    )
    ap.add_argument(
        "--plan", default=str(Path(__file__).resolve().parents[2] / "plans" / "gpt2.tp")
    )
    ap.add_argument("--base", help="a dtp source tree to run as the arm 'dtp-base'")
    ap.add_argument("--out", help="write every sample as JSON here")
    ap.add_argument(
        "--apply", action="store_true", help="compare dtp apply's step time instead of dtp train's"
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="run every arm here (cuda: one GPU)",
    )
    # the child process of the loop arm
    ap.add_argument("--hf-loop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hf_loop:
        print((hf_apply_loop if args.apply else hf_loop)(args.steps, args.threads, args.device))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda: this machine has no CUDA device (torch.cuda.is_available() is "
            "False)",
            file=sys.stderr,
        )
        return 2
    run = dtp_apply if args.apply else dtp_train
    arms = {
        "dtp": lambda: run(args.steps, args.threads, args.plan, None, args.device),
        "hf-loop": lambda: hf_loop_process(args.steps, args.threads, args.apply, args.device),
    }
    if args.base:
        arms["dtp-base"] = lambda: run(
            args.steps, args.threads, args.plan, str(Path(args.base).resolve()), args.device
        )
    names = list(arms)
    samples: list[dict] = []
    for r in range(args.repeats):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]  # rotate the starting arm every repeat
            load = _load()
            try:
                tokens_per_s = arms[name]()
            except (ArmFailed, subprocess.TimeoutExpired) as e:
                print(f"error: arm '{name}' failed in repeat {r}: {e}", file=sys.stderr)
                return 1
            samples.append(
                {"repeat": r, "arm": name, "load_before": load, "tokens_per_s": tokens_per_s}
            )
            print(
                f"repeat {r} {name:9s} {samples[-1]['tokens_per_s']:9.0f} tokens/s  (load {load})",
                flush=True,
            )
    med = {n: statistics.median(s["tokens_per_s"] for s in samples if s["arm"] == n) for n in names}
    print("\n| arm | median tokens/s | ÷ hf-loop |\n|---|---|---|")
    for n in names:
        print(f"| {n} | {med[n]:.0f} | {med[n] / med['hf-loop']:.2f} |")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "threads": args.threads,
                    "steps": args.steps,
                    "apply": args.apply,
                    "device": args.device,
                    "samples": samples,
                    "median": med,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
