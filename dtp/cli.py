"""The `dtp` command line: check, fmt, explain, apply."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from dtp.errors import DtpError, Terminated, UsageError


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (no nan, inf, 0 or negative)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text[:40]}'") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text[:40]}")
    return value


MAX_SEED = 2**63 - 2**16  # torch seeds are 64-bit; ranks add their index


def seed_int(text: str) -> int:
    """argparse type: an integer seed in [0, 2^63 - 2^16]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got '{text[:40]}'") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"seed must be between 0 and {MAX_SEED}, got {text[:40]}")
    return value


def _load_checked(plan_path: str, model_spec: str | None, tp: int | None, dp: int | None = None):
    from dtp.check import check, render_warnings
    from dtp.syntax import load

    plan = load(plan_path)
    model = None
    if model_spec:  # torch only when there is a model: `dtp check PLAN` never imports it
        from dtp import models

        model = models.build(models.resolve(model_spec), device="meta")
    checked = check(plan, model, tp, dp)
    sys.stderr.write(render_warnings(checked))
    return plan, model, checked


def cmd_check(args: argparse.Namespace) -> int:
    """`dtp check PLAN [MODEL] [--tp N]`."""
    plan, model, checked = _load_checked(args.plan, args.model, args.tp, args.dp)
    if model is None:
        print(f"{args.plan}: ok (syntax and styles; give a MODEL to check it against a model)")
        return 0
    res = checked.resolution
    rules = len({r.pos for r in res.claims.values()})
    where = f"tp={args.tp}" if args.tp else "tp values that work: " + ", ".join(map(str, checked.admissible_tp))
    print(f"{args.plan}: ok on {args.model}: {len(res.claims)} modules claimed by {rules} rules, "
          f"{len(res.sets)} attribute rewrites; {where}")
    return 0


def cmd_fmt(args: argparse.Namespace) -> int:
    """`dtp fmt FILE... [--write | --check]`."""
    from dtp.fmt import format_plan
    from dtp.syntax import load

    status = 0
    for name in args.files:
        plan = load(name)
        text = format_plan(plan, plan.source)
        if args.check:
            if text != plan.source:
                print(f"{name}: not formatted (run `dtp fmt --write {name}`)", file=sys.stderr)
                status = 1
        elif args.write:
            if text != plan.source:
                Path(name).write_text(text, encoding="utf-8")
                print(f"formatted {name}")
        else:
            sys.stdout.write(text)
    return status


def cmd_explain(args: argparse.Namespace) -> int:
    """`dtp explain PLAN MODEL --tp N [--json PATH]`."""
    from dtp.explain import explain, render

    dtype = _dtype(args.dtype)
    plan, model, checked = _load_checked(args.plan, args.model, args.tp, args.dp)
    seq = args.seq or getattr(getattr(model, "config", None), "block_size", None) or 1024
    ex = explain(checked, model, args.model, args.tp, dtype, args.batch, seq, args.dp, args.checkpoint_activations)
    print(render(ex))
    if args.json:
        _write_json(args.json, ex.to_json())
    return 0


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]


def _write_json(path: str, data: dict) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None


def cmd_bench(argv: list[str]) -> int:
    """`dtp bench ...` (dtp/bench/, shipped with the package)."""
    from dtp.bench.run import main as bench_main

    return bench_main(argv)


def build_parser(full: bool = True) -> argparse.ArgumentParser:
    """The argument parser for every subcommand; without `full`, `apply` is only listed (its parser
    lives next to the launcher, which imports torch)."""
    p = argparse.ArgumentParser(prog="dtp", description="Declarative tensor parallelism on PyTorch DTensor.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check", help="check a plan, alone or against a model")
    c.add_argument("plan")
    c.add_argument("model", nargs="?", help="zoo name, model YAML, or package.module:factory")
    c.add_argument("--tp", type=positive_int, help="tensor-parallel size to check divisibility for")
    c.add_argument("--dp", type=positive_int, help="data-parallel size the plan's `mesh` header must agree with")
    c.set_defaults(func=cmd_check)

    f = sub.add_parser("fmt", help="format plans canonically")
    f.add_argument("files", nargs="+", metavar="PLAN")
    mode = f.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite files in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when a file is not formatted")
    f.set_defaults(func=cmd_fmt)

    e = sub.add_parser("explain", help="show where every parameter lives and its cost per rank")
    e.add_argument("plan")
    e.add_argument("model")
    e.add_argument("--tp", type=positive_int, required=True)
    e.add_argument("--dp", type=positive_int, default=1, help="data-parallel size (FSDP2) for the schedule")
    e.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    e.add_argument("--batch", type=positive_int, default=1, help="sequences per step, for the schedule (default 1)")
    e.add_argument("--seq", type=positive_int, help="tokens per sequence, for the schedule (default: the block size)")
    e.add_argument("--checkpoint-activations", action="store_true",
                   help="the schedule with each block's forward recomputed in backward (as dtp train does)")
    e.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    e.set_defaults(func=cmd_explain)

    from dtp.fuzz.cli import add_fuzz_parser
    from dtp.simulate.cli import add_simulate_parser
    from dtp.train.cli import add_train_parser

    if full:
        from dtp.launch import add_apply_parser

        add_apply_parser(sub)
    else:
        sub.add_parser("apply", help="shard a model under a plan, train K steps, prove parity, report costs")
    add_fuzz_parser(sub)
    add_simulate_parser(sub)
    add_train_parser(sub)
    if full:
        from dtp.export import add_export_parser

        add_export_parser(sub)
    else:
        sub.add_parser("export", help="write a checkpoint's unsharded state dict (torch, safetensors, HF)")
    sub.add_parser("bench", help="benchmarks next to a Megatron-style baseline (`dtp bench --help`)")
    if full:
        from dtp.hf_plan import add_plan_parser

        add_plan_parser(sub)
    else:
        sub.add_parser("plan", help="write a plan from a Hugging Face model, or a plan as an HF tp_plan")
    return p


def _terminate(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dtp` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        try:
            return cmd_bench(argv[1:])
        except DtpError as err:
            print(err.render(), file=sys.stderr)
            return err.exit_code
    args = build_parser(full=argv[:1] in (["apply"], ["export"], ["plan"])).parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # like Ctrl-C: ranks stopped, temp dirs removed, then exit
    try:
        return args.func(args)
    except DtpError as err:
        print(err.render(), file=sys.stderr)
        return err.exit_code
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dtp explain ... | head`
        return 0


def entry() -> NoReturn:
    """The `dtp` console script and `python -m dtp`: `main`, then exit (a torchrun rank skips finalisation)."""
    from dtp.launcher import leave_rank, under_torchrun

    code = main()
    if under_torchrun():
        leave_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
