"""`dtp apply`: check the plan and the machine, start the ranks (or join torchrun's), enforce the timeout, report.

Not under torchrun, the ranks are started by `dtp.launcher.launch_local` (loopback rendezvous, timeout, one
paragraph for a failed rank, nothing left behind); under torchrun this process is one rank of the launched world.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from dtp.errors import RunError, UsageError
from dtp.launcher import error_summary, launch_local, under_torchrun
from dtp.run import DTYPES, RunConfig


def _apply_rank(rank: int, world: int, cfg: RunConfig) -> dict | None:
    """One rank of `dtp apply` on an initialised process group; rank 0 returns the report."""
    from dtp import run as run_mod

    return run_mod.run(cfg, None)


def launch(cfg: RunConfig) -> dict:
    """Start tp×dp local ranks, wait at most cfg.timeout seconds, and return rank 0's report."""
    try:
        return launch_local(_apply_rank, cfg.tp * cfg.dp, cfg, timeout=cfg.timeout, device=cfg.device,
                            prefix="dtp-apply-")[0]
    except RunError as err:
        raise RunError(str(err).replace("the run", "the sharded run", 1), err.rank, err.where, err.error) from None


def sequence_shape_problem(checked, tp: int, seq: int) -> str | None:
    """Why a sequence-parallel plan cannot run on `seq` tokens at `tp`, if it cannot."""
    from dtp.compiler import lower

    if seq < tp and lower(checked, tp).sequence_parallel:
        return (f"--seq {seq} is shorter than tp={tp}: sequence parallelism gives every rank a part of the "
                f"sequence, so use --seq {tp} or more")
    return None


def _torchrun_rank(cfg: RunConfig) -> dict | None:
    """This process as one rank of torchrun's world: torchrun's rendezvous settings stand."""
    import torch
    import torch.distributed as dist

    from dtp import run as run_mod

    rank = int(os.environ["RANK"])
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo", timeout=timedelta(seconds=cfg.timeout))
    try:
        return run_mod.run(cfg, None)
    except Exception as err:  # noqa: BLE001 - one paragraph per failing rank, as for local runs
        e = error_summary(err, rank)
        raise RunError(f"the sharded run failed on rank {rank} in {e['where']}: {e['error']}", rank, e["where"],
                       e["error"]) from None
    finally:
        dist.destroy_process_group()


def pick_device(requested: str, world: int) -> str:
    """`auto` is CUDA only when this machine has a GPU for every local rank, else CPU."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available on this machine")
    return requested


def writable_file(path: str, flag: str) -> str:
    """`path` made absolute, once it is known that a file can be written there (before any rank starts)."""
    target = Path(path).absolute()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file path")
    if not target.parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {target.parent} does not exist")
    existed = target.exists()
    try:  # try it: permissions, read-only mounts and /proc all answer the same way
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot write there ({err.strerror})") from None
    if not existed:
        target.unlink()
    return str(target)


def absolute_model_spec(spec: str) -> str:
    """A YAML model path made absolute (a factory may change the working directory); other specs as given."""
    return str(Path(spec).absolute()) if spec.endswith((".yaml", ".yml")) and Path(spec).is_file() else spec


def cmd_apply(args: argparse.Namespace) -> int:
    """`dtp apply PLAN MODEL ...`: exit 0 parity holds, 1 parity failed or the run failed, 2 plan/usage error."""
    from dtp import models, preflight
    from dtp.check import check, render_warnings
    from dtp.report import render
    from dtp.syntax import load

    # Every path is absolute before user code runs: a model factory may call os.chdir.
    plan_path = str(Path(args.plan).absolute())
    json_path = writable_file(args.json, "--json") if args.json else None
    model_spec = absolute_model_spec(args.model)
    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else None
    tp = args.tp or (world // args.dp if world else 2)
    if args.batch % args.dp:
        raise UsageError(f"--batch {args.batch} (the global batch) must divide by --dp {args.dp}")
    if torchrun and tp * args.dp != world:
        raise UsageError(f"--tp {tp} × --dp {args.dp} = {tp * args.dp} ranks, but torchrun started WORLD_SIZE={world}")
    device = pick_device(args.device, 1 if torchrun else tp * args.dp)
    if not torchrun:
        preflight.check_world(tp * args.dp, device)
        if device == "cuda" and tp * args.dp > preflight.cuda_device_count():
            raise UsageError(f"tp={tp} × dp={args.dp} needs {tp * args.dp} GPUs; this machine has "
                             f"{preflight.cuda_device_count()}. Use --device cpu, or torchrun across machines")

    plan = load(args.plan)  # messages name the plan as the user wrote it; ranks get the absolute path
    cwd = os.getcwd()
    model = models.build(models.resolve(model_spec), device="meta")
    os.chdir(cwd)  # ranks start where the user started dtp, whatever the factory did
    vocab = models.vocab_size(model)
    if vocab is None:
        raise UsageError(f"model {args.model} has no nn.Embedding and no config.vocab_size: dtp feeds it token "
                         "ids, so it must know the vocabulary size")
    checked = check(plan, model, tp, args.dp)  # exit 2 before any rank starts
    sys.stderr.write(render_warnings(checked))
    shape_problem = sequence_shape_problem(checked, tp, args.seq)
    if shape_problem:
        raise UsageError(shape_problem)
    elem = {"float32": 4, "bfloat16": 2, "float64": 8}[args.dtype]
    if not torchrun:
        preflight.check_memory(preflight.estimate(model, tp, args.dp, args.batch, args.seq, elem, vocab), device)
    cfg = RunConfig(plan=plan_path, model=model_spec, tp=tp, dp=args.dp, batch=args.batch, seq=args.seq,
                    steps=args.steps, seed=args.seed, dtype=args.dtype, device=device, timeout=args.timeout, lr=args.lr)

    report = _torchrun_rank(cfg) if torchrun else launch(cfg)
    if report is None:  # a torchrun rank other than 0
        return 0
    report["plan"]["file"], report["model"] = args.plan, args.model  # as the user wrote them (config: what ran)
    print(render(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if report["parity"]["ok"] else 1


def add_apply_parser(sub) -> None:
    """Register `dtp apply` on the CLI's subparsers."""
    from dtp.cli import positive_float, positive_int, seed_int

    a = sub.add_parser("apply", help="shard a model under a plan, train K steps, prove parity, report costs")
    a.add_argument("plan")
    a.add_argument("model", help="zoo name, model YAML, or package.module:factory")
    a.add_argument("--tp", type=positive_int, help="tensor-parallel size (default 2; under torchrun WORLD_SIZE/dp)")
    a.add_argument("--dp", type=positive_int, default=1, help="data-parallel size: FSDP2 over a (dp, tp) mesh; --batch is the global batch")
    a.add_argument("--batch", type=positive_int, default=2)
    a.add_argument("--seq", type=positive_int, default=16)
    a.add_argument("--steps", type=positive_int, default=3)
    a.add_argument("--seed", type=seed_int, default=0)
    a.add_argument("--lr", type=positive_float, default=0.1, help="SGD learning rate (momentum 0.9)")
    a.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    a.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when there is a GPU for every rank, else CPU")
    a.add_argument("--timeout", type=positive_float, default=300.0, help="seconds before every rank is stopped (exit 1)")
    a.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    a.set_defaults(func=cmd_apply)
