"""`dtp simulate PLAN MODEL --profile P`: predict a training iteration at scale; exit 2 on a usage
error."""

from __future__ import annotations

import argparse

from dtp.cli.args import bounded
from dtp.files import writable_file

# a typo must not ask for a million GPUs
LIMITS = {
    "tp": 4096,
    "dp": 1 << 20,
    "micro_batch": 1 << 16,
    "global_batch": 1 << 24,
    "seq": 1 << 20,
}


def add_parser(sub) -> None:
    """Register `dtp simulate`."""
    s = sub.add_parser(
        "simulate",
        help="predict a training iteration at scale from the plan and a hardware profile",
    )
    s.add_argument("plan", nargs="?")
    s.add_argument(
        "model",
        nargs="?",
        help="zoo name, model YAML, package.module:factory, or a save_pretrained directory",
    )
    s.add_argument(
        "--profile",
        help="a shipped profile (dgx2h-v100, dgx-a100, h100-sxm, h200-sxm) or a YAML file",
    )
    s.add_argument("--tp", type=bounded(LIMITS["tp"]), default=1)
    s.add_argument("--dp", type=bounded(LIMITS["dp"]), default=1)
    s.add_argument(
        "--micro-batch",
        type=bounded(LIMITS["micro_batch"]),
        default=8,
        help="sequences per micro-batch (default 8)",
    )
    s.add_argument(
        "--global-batch",
        type=bounded(LIMITS["global_batch"]),
        help="sequences per iteration (default micro-batch × dp)",
    )
    s.add_argument(
        "--seq",
        type=bounded(LIMITS["seq"]),
        help="tokens per sequence (default: the model's block size)",
    )
    s.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    s.add_argument(
        "--recompute",
        choices=("none", "full", "selective", "op"),
        default="full",
        help="activation checkpointing: full (default, every layer, as the paper), selective (Megatron's "
        "attention core), op (per-op: every other matmul and the attention output kept), none",
    )
    s.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    s.add_argument(
        "--dp-overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap the gradient all-reduce with backward (default: the profile's dp_overlap)",
    )
    s.add_argument(
        "--fsdp",
        action="store_true",
        help="data parallel as FSDP2/ZeRO-3: per-block all-gathers and reduce-scatters, sharded state",
    )
    s.add_argument(
        "--tp-overlap",
        action="store_true",
        help="input-gradient TP collectives run during the weight-gradient GEMMs (Megatron's async all-reduce)",
    )
    s.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile: fused elementwise ops move fewer bytes",
    )
    s.add_argument(
        "--attention",
        choices=("flash", "fused", "unfused"),
        help="flash (default; --sweep: unfused): scores never in memory; fused: Megatron's fused softmax; "
        "unfused: 2019's kernels",
    )
    s.add_argument(
        "--reproduce",
        metavar="SOURCE",
        help="predicted vs published for a source's rows: megatron2019, a100, torchtitan, torchtitan-a100, all",
    )
    s.add_argument(
        "--sweep",
        action="store_true",
        help="the paper's weak-scaling experiment (Table-1 models) and MODEL's strong scaling",
    )
    s.add_argument(
        "--decode",
        action="store_true",
        help="predict one decoded token (--micro-batch rows, --seq tokens of KV cache) at tp 1, 2, "
        "4, … up to the node's GPUs: where tensor parallelism stops paying for decoding",
    )
    s.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    s.add_argument("--plot", metavar="PATH", help="with --sweep: write the scaling plot (PNG)")
    s.add_argument(
        "--markdown",
        metavar="PATH",
        help="with --sweep or --reproduce: write the tables as Markdown",
    )
    s.add_argument(
        "--calibrate", action="store_true", help="measure this machine and write a profile (-o)"
    )
    s.add_argument(
        "-o", "--output", metavar="PROFILE", help="with --calibrate: the profile file to write"
    )
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Predict one configuration, the paper's sweep, or calibrate this machine."""
    from dtp.simulate.session import simulate_command

    # every output proven writable before any work
    for flag in ("json", "plot", "markdown", "output"):
        if getattr(args, flag):
            writable_file(getattr(args, flag), "-o" if flag == "output" else f"--{flag}")
    if args.decode:
        return _decode(args)
    return simulate_command(
        plan=args.plan,
        model=args.model,
        profile_name=args.profile,
        tp=args.tp,
        dp=args.dp,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        seq=args.seq,
        precision=args.precision,
        recompute=args.recompute,
        optimizer=args.optimizer,
        dp_overlap=args.dp_overlap,
        fsdp=args.fsdp,
        tp_overlap=args.tp_overlap,
        torch_compile=args.compile,
        attention=args.attention,
        reproduce=args.reproduce,
        sweep_paper=args.sweep,
        json_path=args.json,
        plot=args.plot,
        markdown=args.markdown,
        calibrate=args.calibrate,
        output=args.output,
    )


def _decode(args: argparse.Namespace) -> int:
    """`--decode`: the predicted decode step at every tp of the node."""
    from dtp.simulate.decode import decode_command

    return decode_command(
        plan=args.plan,
        model=args.model,
        profile_name=args.profile,
        tp=args.tp,
        batch=args.micro_batch,
        context=args.seq or 512,
        precision=args.precision,
        json_path=args.json,
    )
