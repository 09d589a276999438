"""`dtp export CHECKPOINT [--format torch|safetensors] [-o PATH | --hf-dir DIR]`: exit 0 written, 2
a bad input or no room to write (one line; the output as it was), 143/130 stopped by a signal."""

from __future__ import annotations

import argparse
import time

from dtp.files import writable_dir, writable_file


def add_parser(sub) -> None:
    """Register `dtp export`."""
    e = sub.add_parser(
        "export",
        help="write a checkpoint's unsharded state dict (torch, safetensors, Hugging Face)",
    )
    e.add_argument("checkpoint", help="a checkpoint directory written by dtp")
    e.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        help="file format (default: torch for -o, safetensors for --hf-dir)",
    )
    where = e.add_mutually_exclusive_group()
    where.add_argument(
        "-o", "--output", metavar="PATH", help="output file (default: CHECKPOINT.pt / .safetensors)"
    )
    where.add_argument(
        "--hf-dir", metavar="DIR", help="write config.json and the weights for from_pretrained(DIR)"
    )
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint's unsharded state dict and say where, how many tensors, how long."""
    from dtp.checkpoint.export import export

    # outputs checked before the checkpoint is read: never a device, FIFO, directory or /proc (issue
    # 20)
    if args.hf_dir:
        writable_dir(args.hf_dir, "--hf-dir", create=False)
    else:
        suffix = "safetensors" if args.format == "safetensors" else "pt"
        writable_file(args.output or f"{args.checkpoint.rstrip('/')}.{suffix}", "-o")
    t0 = time.perf_counter()
    where, count = export(args.checkpoint, args.format, args.output, args.hf_dir)
    print(
        f"{args.checkpoint}: {count} tensors written to {where} in {time.perf_counter() - t0:.2f} s"
    )
    return 0
