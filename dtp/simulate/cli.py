"""`dtp simulate`: the command line of the simulator."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dtp.errors import UsageError

LIMITS = {"tp": 4096, "dp": 1 << 20, "micro_batch": 1 << 16, "global_batch": 1 << 24, "seq": 1 << 20}


def _bounded(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
        if not 1 <= value <= LIMITS[name]:
            raise argparse.ArgumentTypeError(f"expected an integer in [1, {LIMITS[name]}], got {value}")
        return value
    return parse


def add_simulate_parser(sub) -> None:
    """Register `dtp simulate` on the subcommand parser."""
    s = sub.add_parser("simulate", help="predict a training iteration at scale from the plan and a hardware profile")
    s.add_argument("plan", nargs="?")
    s.add_argument("model", nargs="?", help="zoo name, model YAML, or package.module:factory")
    s.add_argument("--profile", help="a shipped profile (dgx2h-v100, dgx-a100, h100-sxm, h200-sxm) or a YAML file")
    s.add_argument("--tp", type=_bounded("tp"), default=1)
    s.add_argument("--dp", type=_bounded("dp"), default=1)
    s.add_argument("--micro-batch", type=_bounded("micro_batch"), default=8, help="sequences per micro-batch (default 8)")
    s.add_argument("--global-batch", type=_bounded("global_batch"), help="sequences per iteration (default micro-batch × dp)")
    s.add_argument("--seq", type=_bounded("seq"), help="tokens per sequence (default: the model's block size)")
    s.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    s.add_argument("--recompute", choices=("none", "full", "selective"), default="full",
                   help="activation checkpointing (default full, as the paper: every layer)")
    s.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    s.add_argument("--dp-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the gradient all-reduce with backward (default: the profile's dp_overlap)")
    s.add_argument("--sweep", action="store_true",
                   help="the paper's weak-scaling experiment (Table-1 models) and MODEL's strong scaling")
    s.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    s.add_argument("--plot", metavar="PATH", help="with --sweep: write the scaling plot (PNG)")
    s.add_argument("--markdown", metavar="PATH", help="with --sweep: write the tables as Markdown")
    s.add_argument("--calibrate", action="store_true", help="measure this machine and write a profile (-o)")
    s.add_argument("-o", "--output", metavar="PROFILE", help="with --calibrate: the profile file to write")
    s.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    """`dtp simulate PLAN MODEL --profile P [...]` or `dtp simulate --calibrate -o PROFILE`."""
    if args.calibrate:
        return _calibrate(args)
    if not (args.plan and args.model and args.profile):
        raise UsageError("dtp simulate needs PLAN, MODEL and --profile (or --calibrate -o PROFILE)")
    if (args.plot or args.markdown) and not args.sweep:
        raise UsageError("--plot and --markdown write the --sweep tables; add --sweep")
    from dtp.simulate import profile

    prof = profile.load(args.profile)
    if args.sweep:
        return _sweep(args, prof)
    return _single(args, prof)


def _single(args: argparse.Namespace, prof) -> int:
    from dtp.simulate.model import Run, simulate
    from dtp.simulate.prepare import Prepared
    from dtp.simulate.report import render

    start = time.perf_counter()
    global_batch = args.global_batch or args.micro_batch * args.dp
    if global_batch % (args.micro_batch * args.dp):
        raise UsageError(f"--global-batch {global_batch} is not a multiple of --micro-batch × --dp = "
                         f"{args.micro_batch * args.dp}")
    prepared = Prepared(args.plan, args.model, args.seq)
    run = Run(args.tp, args.dp, args.micro_batch, global_batch, prepared.seq, args.precision, args.recompute,
              args.optimizer, prof.dp_overlap if args.dp_overlap is None else args.dp_overlap)
    result = simulate(prepared.workload(args.tp, args.micro_batch, args.precision), run, prof)
    print(render(result, prepared, args, prof, time.perf_counter() - start))
    if args.json:
        _write(args.json, json.dumps({"profile": prof.name, "model": args.model, "plan": args.plan,
                                      **result.to_json()}, indent=2) + "\n")
    return 0


def _sweep(args: argparse.Namespace, prof) -> int:
    from dtp.simulate import sweep

    rows = sweep.paper_sweep(args.plan, args.model, prof, args.precision, args.recompute, args.dp_overlap)
    text = sweep.markdown(rows, prof)
    print(text, end="")
    if args.markdown:
        _write(args.markdown, text)
    if args.json:
        _write(args.json, json.dumps({"profile": prof.name, "plan": args.plan, "efficiency": "flop",
                                      "rows": [r.to_json() for r in rows]}, indent=2) + "\n")
    if args.plot:
        try:
            sweep.plot(rows, args.plot)
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from dtp.simulate.calibrate import profile_yaml
    from dtp.simulate.profile import parse

    if not args.output:
        raise UsageError("--calibrate writes a profile: give -o PROFILE.yaml")
    name = Path(args.output).name.rsplit(".", 1)[0] or "this-machine"
    text, raw = profile_yaml(name)
    parse(text, args.output)  # what we write must load
    _write(args.output, text)
    print(text, end="")
    print(f"wrote {args.output}")
    return 0


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
