"""`dtp apply`: check the plan, start the ranks (or join torchrun's), enforce the timeout, report.

Not under torchrun, the ranks are started with torch's own `torch.multiprocessing.start_processes`;
under torchrun (WORLD_SIZE set) this process is one rank of the launched world.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from dtp.errors import RunError, UsageError
from dtp.ranks import die_with_parent, free_port
from dtp.run import DTYPES, RunConfig


def _error_summary(err: BaseException, where: str, rank: int) -> dict:
    frames = traceback.extract_tb(err.__traceback__)
    frame = frames[-1] if frames else None
    message = " ".join(str(err).split())
    if len(message) > 400:
        message = message[:400] + " …"
    return {"rank": rank, "where": where, "error": f"{type(err).__name__}: {message}",
            "at": f"{frame.filename}:{frame.lineno}" if frame else ""}


def _run_rank(cfg: RunConfig, out_dir: Path, rank: int, world: int) -> int:
    """One rank's life: process group, run, clean up; failures become a JSON summary, not a traceback."""
    import torch
    import torch.distributed as dist

    from dtp import run as run_mod

    torch.set_num_threads(1)
    try:
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=cfg.timeout))
        report = run_mod.run(cfg, out_dir if rank == 0 else None)
        ok = bool(report["parity"]["ok"]) if report else True
        return 0 if ok else 1
    except Exception as err:  # noqa: BLE001 - every failure is reported as one paragraph
        summary = _error_summary(err, getattr(err, "__dtp_where__", None) or "start-up", rank)
        (out_dir / f"error-{rank}.json").write_text(json.dumps(summary))
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_rank(rank: int, cfg: RunConfig, out_dir: str, world: int, port: int) -> None:
    die_with_parent()  # a rank must not outlive `dtp apply`, even one killed with SIGKILL
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops every rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    code = _run_rank(cfg, Path(out_dir), rank, world)
    if code:
        sys.exit(code)


def _collect_errors(out_dir: Path) -> RunError | None:
    errors = [json.loads(p.read_text()) for p in sorted(out_dir.glob("error-*.json"))]
    if not errors:
        return None
    first = errors[0]
    others = f" ({len(errors) - 1} other rank(s) failed too)" if len(errors) > 1 else ""
    return RunError(f"the sharded run failed on rank {first['rank']} in {first['where']}: {first['error']}{others}")


def _read_report(out_dir: Path) -> dict | None:
    path = out_dir / "report.json"  # written by rank 0 only
    return json.loads(path.read_text()) if path.exists() else None


def _start_method(cfg: RunConfig) -> str:
    # fork saves every rank re-importing torch (seconds on a small CPU machine); CUDA cannot be forked.
    return "spawn" if cfg.device == "cuda" else "fork"


def launch(cfg: RunConfig) -> dict:
    """Start tp×dp local ranks, wait at most cfg.timeout seconds, and return rank 0's report."""
    import torch.multiprocessing as mp

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report failures ourselves
    world = cfg.tp * cfg.dp
    with tempfile.TemporaryDirectory(prefix="dtp-apply-") as tmp:
        out_dir = Path(tmp)
        ctx = mp.start_processes(_spawned_rank, args=(cfg, tmp, world, free_port()), nprocs=world, join=False,
                                 start_method=_start_method(cfg))
        deadline = time.monotonic() + cfg.timeout
        failed: BaseException | None = None
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise RunError(f"the sharded run did not finish within --timeout {cfg.timeout:g} s; every rank "
                                   "was stopped (a rank may be stuck in a collective that another rank never joined)")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:
            failed = err
        finally:
            for proc in ctx.processes:  # nothing is left behind, whatever happened
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
        error = _collect_errors(out_dir)
        if error:
            raise error
        report = _read_report(out_dir)
        if report is not None:
            return report  # parity may have failed: ranks exit 1 then, but the report says why
        raise RunError(f"a rank died without a report: {' '.join(str(failed).split())[:300] if failed else 'no exit status'}")


def sequence_shape_problem(checked, tp: int, seq: int) -> str | None:
    """Why a sequence-parallel plan cannot run on `seq` tokens at `tp`, if it cannot."""
    from dtp.compiler import lower

    if seq < tp and lower(checked, tp).sequence_parallel:
        return (f"--seq {seq} is shorter than tp={tp}: sequence parallelism gives every rank a part of the "
                f"sequence, so use --seq {tp} or more")
    return None


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def cmd_apply(args: argparse.Namespace) -> int:
    """`dtp apply PLAN MODEL ...`: exit 0 parity holds, 1 parity failed or the run failed, 2 plan/usage error."""
    import torch

    from dtp import models
    from dtp.check import check, render_warnings
    from dtp.report import render
    from dtp.syntax import load

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available on this machine")
    torchrun = _under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else None
    tp = args.tp or (world // args.dp if world else 2)
    if args.batch % args.dp:
        raise UsageError(f"--batch {args.batch} (the global batch) must divide by --dp {args.dp}")
    if torchrun and tp * args.dp != world:
        raise UsageError(f"--tp {tp} × --dp {args.dp} = {tp * args.dp} ranks, but torchrun started WORLD_SIZE={world}")
    if device == "cuda" and not torchrun and tp * args.dp > torch.cuda.device_count():
        raise UsageError(f"tp={tp} × dp={args.dp} needs {tp * args.dp} GPUs; this machine has "
                         f"{torch.cuda.device_count()}. Use --device cpu, or torchrun across machines")

    plan = load(args.plan)
    checked = check(plan, models.build(models.resolve(args.model), device="meta"), tp, args.dp)  # exit 2 before any rank starts
    sys.stderr.write(render_warnings(checked))
    shape_problem = sequence_shape_problem(checked, tp, args.seq)
    if shape_problem:
        raise UsageError(shape_problem)
    cfg = RunConfig(plan=args.plan, model=args.model, tp=tp, dp=args.dp, batch=args.batch, seq=args.seq,
                    steps=args.steps, seed=args.seed, dtype=args.dtype, device=device, timeout=args.timeout, lr=args.lr)

    if torchrun:
        rank = int(os.environ["RANK"])
        with tempfile.TemporaryDirectory(prefix="dtp-apply-") as tmp:
            code = _run_rank(cfg, Path(tmp), rank, world)
            error = _collect_errors(Path(tmp))
            if error:
                raise error
            report = _read_report(Path(tmp))
        if report is None:
            return code
    else:
        report = launch(cfg)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if report["parity"]["ok"] else 1


def add_apply_parser(sub) -> None:
    """Register `dtp apply` on the CLI's subparsers."""
    from dtp.cli import positive_int

    a = sub.add_parser("apply", help="shard a model under a plan, train K steps, prove parity, report costs")
    a.add_argument("plan")
    a.add_argument("model", help="zoo name, model YAML, or package.module:factory")
    a.add_argument("--tp", type=positive_int, help="tensor-parallel size (default 2; under torchrun WORLD_SIZE/dp)")
    a.add_argument("--dp", type=positive_int, default=1, help="data-parallel size: FSDP2 over a (dp, tp) mesh; --batch is the global batch")
    a.add_argument("--batch", type=positive_int, default=2)
    a.add_argument("--seq", type=positive_int, default=16)
    a.add_argument("--steps", type=positive_int, default=3)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (momentum 0.9)")
    a.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    a.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    a.add_argument("--timeout", type=float, default=300.0, help="seconds before every rank is stopped (exit 1)")
    a.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    a.set_defaults(func=cmd_apply)
