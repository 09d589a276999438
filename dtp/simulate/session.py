"""`dtp simulate`: the command line of the simulator."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dtp.errors import UsageError
from dtp.simulate.report import write_output


def simulate_command(args: argparse.Namespace) -> int:
    """`dtp simulate PLAN MODEL --profile P [...]` or `dtp simulate --calibrate -o PROFILE`."""
    if args.calibrate:
        return _calibrate(args)
    if getattr(args, "reproduce", None):
        if args.plan or args.model or args.sweep or args.plot:
            raise UsageError("--reproduce SOURCE takes no PLAN, MODEL, --sweep or --plot: each row brings its own")
        from dtp.simulate.cli_reproduce import reproduce_command

        return reproduce_command(args)
    if not (args.plan and args.model and args.profile):
        raise UsageError("dtp simulate needs PLAN, MODEL and --profile (or --calibrate -o PROFILE, or --reproduce SOURCE)")
    if args.plot and not args.sweep or args.markdown and not args.sweep:
        raise UsageError("--plot and --markdown write the --sweep (or --reproduce) tables; add --sweep")
    if args.fsdp and args.dp_overlap is False:
        raise UsageError("--fsdp always overlaps its collectives with compute; drop --no-dp-overlap")
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
              args.optimizer, prof.dp_overlap if args.dp_overlap is None else args.dp_overlap,
              fsdp=args.fsdp, compile=args.compile, attention=args.attention or "flash",
              tp_overlap=args.tp_overlap)
    result = simulate(prepared.workload(args.tp, args.micro_batch, args.precision), run, prof)
    print(render(result, prepared, args, prof, time.perf_counter() - start))
    if args.json:
        write_output(args.json, json.dumps({"profile": prof.name, "model": args.model, "plan": args.plan,
                                      **result.to_json()}, indent=2) + "\n")
    return 0


def _sweep(args: argparse.Namespace, prof) -> int:
    from dtp.simulate import sweep

    rows = sweep.paper_sweep(args.plan, args.model, prof, args.precision, args.recompute, args.dp_overlap,
                             args.attention or "unfused")
    text = sweep.markdown(rows, prof)
    print(text, end="")
    if args.markdown:
        write_output(args.markdown, text)
    if args.json:
        write_output(args.json, json.dumps({"profile": prof.name, "plan": args.plan, "efficiency": "flop",
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
    write_output(args.output, text)
    print(text, end="")
    print(f"wrote {args.output}")
    return 0
