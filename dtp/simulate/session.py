"""`dtp simulate`: the command line of the simulator."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dtp.errors import UsageError
from dtp.files import write_text


def simulate_command(args: argparse.Namespace) -> int:
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
        write_text(path, text)  # a regular file only, replaced atomically (dtp.files)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
