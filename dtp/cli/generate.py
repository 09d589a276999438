"""`dtp generate PLAN MODEL`: exit 0 every step's token is the unsharded model's, 1 a step differs
beyond rounding or a rank failed, 2 a plan, prompt or flag error."""

from __future__ import annotations

import argparse
import json

from dtp.cli.args import bounded, positive_int, seed_int, timeout_seconds
from dtp.errors import UsageError
from dtp.files import writable_file, write_text
from dtp.runtime.job import DEVICES, DTYPES

MAX_NEW_TOKENS = 4096


def add_parser(sub) -> None:
    """Register `dtp generate`."""
    g = sub.add_parser(
        "generate",
        help="greedy (or seeded sampled) decoding of the sharded model with its KV cache, "
        "token-exact against the unsharded model",
    )
    g.add_argument("plan")
    g.add_argument(
        "model", help="zoo name, model YAML, package.module:factory, or a save_pretrained directory"
    )
    g.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel size (default 2)")
    prompts = g.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt (repeat for a batch), tokenised by the model directory's tokenizer.json, "
        "else as bytes",
    )
    prompts.add_argument(
        "--prompt-ids", metavar='"IDS;IDS…"', help='token ids: "1 2 3;4 5" is two prompts'
    )
    g.add_argument(
        "--max-new-tokens",
        type=bounded(MAX_NEW_TOKENS),
        default=16,
        metavar="K",
        help="tokens to add to every prompt (default 16)",
    )
    g.add_argument("--dtype", choices=DTYPES, default="float32")
    g.add_argument("--device", choices=DEVICES, default="auto")
    g.add_argument("--seed", type=seed_int, default=0, help="the model's initialisation")
    sample = g.add_argument_group(
        "sampling",
        "transformers' do_sample: temperature, then top-k, then top-p; drawn by the Gumbel-max "
        "trick from noise seeded by (--sample-seed, step), the same on every rank and for the "
        "unsharded model, so the tokens still compare one for one",
    )
    sample.add_argument(
        "--sample",
        "--do-sample",
        action="store_true",
        help="sample each token instead of taking the most likely one (greedy, the default)",
    )
    # plain types here: the ranges are Sampling's to check, one line each (exit 2)
    sample.add_argument(
        "--temperature", type=float, metavar="T", help="divide the logits by T > 0 (default 1.0)"
    )
    sample.add_argument(
        "--top-k", type=int, metavar="K", help="keep the K most likely tokens (default: all)"
    )
    sample.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="keep the fewest most likely tokens holding P of the probability, 0 < P ≤ 1 "
        "(default: all)",
    )
    sample.add_argument(
        "--sample-seed",
        type=int,
        metavar="S",
        help="the sampling noise's seed (default 0; --seed is the model's)",
    )
    g.add_argument("--timeout", type=timeout_seconds, default=300.0)
    g.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Decode and print the report (rank 0)."""
    from dtp.generate.command import Sampling, generate_command, render

    json_path = writable_file(args.json, "--json") if args.json else None
    knobs = {
        "--temperature": args.temperature,
        "--top-k": args.top_k,
        "--top-p": args.top_p,
        "--sample-seed": args.sample_seed,
    }
    if not args.sample:
        given = [flag for flag, value in knobs.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} needs --sample (decoding is greedy without it)")
    sampling = (
        Sampling(
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=0 if args.sample_seed is None else args.sample_seed,
        )
        if args.sample
        else None
    )
    report = generate_command(
        plan=args.plan,
        model=args.model,
        tp=args.tp,
        prompts=args.prompt,
        prompt_ids=args.prompt_ids,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        timeout=args.timeout,
        sampling=sampling,
    )
    if report is None:
        return 0
    print(render(report))
    if json_path:
        write_text(json_path, json.dumps(report, indent=2, default=str) + "\n", "--json")
    return 0 if report["ok"] else 1
