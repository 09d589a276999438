"""`dtp search MODEL --profile P --gpus G --seq S --global-batch B`: the best layout for a cluster;
`--decode --micro-batch ROWS`: the best tp for serving it. Exit 0 found, 1 nothing fits, 2 a usage
error."""

from __future__ import annotations

import argparse
import json
import os
import sys

from dtp.cli.args import bounded
from dtp.cli.generate import MAX_NEW_TOKENS
from dtp.errors import UsageError
from dtp.files import writable_file, write_text

# typos, not clusters
LIMITS = {"gpus": 1 << 20, "seq": 1 << 20, "global_batch": 1 << 24, "micro_batch": 1 << 16}
SHOWN = 12
OBJECTIVES = ("latency", "throughput")  # what --decode's choice serves first


def add_parser(sub) -> None:
    """Register `dtp search`."""
    s = sub.add_parser(
        "search",
        help="rank tp × dp, sequence parallelism and recomputation for a cluster by `dtp "
        "simulate` on the auto plan",
    )
    s.add_argument(
        "model", help="zoo name, model YAML, package.module:factory, or a save_pretrained directory"
    )
    s.add_argument(
        "--profile",
        required=True,
        help="a shipped hardware profile (see dtp simulate) or a YAML file",
    )
    s.add_argument("--gpus", type=bounded(LIMITS["gpus"]), required=True)
    s.add_argument(
        "--seq",
        type=bounded(LIMITS["seq"]),
        required=True,
        help="tokens per sequence (with --decode: tokens of KV cache per row)",
    )
    s.add_argument(
        "--global-batch",
        type=bounded(LIMITS["global_batch"]),
        help="sequences per iteration (training: required)",
    )
    s.add_argument(
        "--micro-batch",
        type=bounded(LIMITS["micro_batch"]),
        help="sequences per micro-batch (default: try 1, 2, 4, 8, 16); with --decode: the rows "
        "each replica decodes together (required)",
    )
    s.add_argument(
        "--precision",
        choices=("fp16", "bf16", "fp32"),
        help="default: the profile's best half precision (bf16, else fp16, else fp32)",
    )
    s.add_argument(
        "--dp-modes",
        help="data parallelism to try: ddp, fsdp or ddp,fsdp (default: both)",
    )
    s.add_argument(
        "--decode",
        action="store_true",
        help="serve instead of train: the tp per replica (replicas = gpus / tp) by `dtp simulate "
        "--decode`'s model, --micro-batch rows per replica, --seq tokens of KV cache",
    )
    s.add_argument(
        "--objective",
        choices=OBJECTIVES,
        help="with --decode: latency (default; the smallest tp that fits and that no tp beats by "
        "more than 5%% in ms per token) or throughput (the most tokens/s over the cluster)",
    )
    s.add_argument(
        "--json", metavar="PATH", help="also write the best layout and every candidate as JSON"
    )
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Price every layout and print the ranked table and the commands that run the winner."""
    from dtp import models
    from dtp.auto.search import (
        Job,
        check_seq,
        commands,
        default_precision,
        launch,
        search,
        tp_values,
        why_lost,
    )
    from dtp.simulate import profile

    _refuse_mixed(args)
    modes = tuple(m.strip() for m in (args.dp_modes or "ddp,fsdp").split(",") if m.strip())
    if not modes or set(modes) - {"ddp", "fsdp"}:
        raise UsageError(f"--dp-modes takes ddp, fsdp or ddp,fsdp, not {args.dp_modes!r}")
    json_path = writable_file(args.json, "--json") if args.json else None
    if os.path.isdir(args.profile):
        raise UsageError(
            f"--profile {args.profile} is a directory: give a profile YAML file or a shipped "
            f"profile ({', '.join(profile.profile_names())})"
        )
    prof = profile.load(args.profile)
    precision, why = _precision(args.precision, prof, default_precision(prof))
    model = models.build(models.resolve(args.model), device="meta")
    check_seq(model, args.model, args.seq)  # before anything is priced
    if args.decode:
        return _decode(args, model, prof, precision, why, json_path)
    nodes, _ = launch(args.gpus, prof.gpus_per_node)  # uneven over nodes: refused before the search
    job = Job(args.model, args.gpus, args.seq, args.global_batch, precision, args.profile)
    micro = [args.micro_batch] if args.micro_batch else [1, 2, 4, 8, 16]
    dps = sorted({args.gpus // t for t in tp_values(args.gpus, prof.gpus_per_node)})
    if all(args.global_batch % (m * dp) for m in micro for dp in dps):  # before any pricing
        raise UsageError(
            f"no layout of {args.gpus} GPUs divides --global-batch {args.global_batch} into dp × "
            f"micro-batch: dp {', '.join(map(str, dps))} with micro-batches of "
            f"{', '.join(map(str, micro))}"
        )
    found = search(
        model,
        job,
        prof,
        micro_batches=micro,
        dp_modes=modes,
        log=lambda m: print(m, file=sys.stderr),
    )
    if not found:  # every tp whose dp divides the batch left out (search raises where it knows why)
        raise UsageError(f"no layout of {args.gpus} GPUs could be priced for {args.model}")
    best, capacity = found[0], prof.memory_GiB
    print(
        f"dtp search: {args.model} on {args.gpus} × {prof.name} ({capacity:.0f} GiB), seq "
        f"{args.seq}, global batch {args.global_batch}, {precision}{why}; {len(found)} layouts "
        f"priced by dtp simulate, {sum(c.fits for c in found)} fit"
    )
    shown = found[:SHOWN]
    whys = ["best" if c is best and c.fits else why_lost(c, best, capacity) for c in shown]
    _print_table(shown, whys, len(found))
    if best.fits and best.left_whole:
        print(_left_whole(best))
    if not best.fits:
        print(
            f"nothing fits in {capacity:.0f} GiB per GPU: the smallest needs "
            f"{min(c.memory_gib for c in found):.1f} GiB"
        )
    lines = commands(best, job, prof.gpus_per_node) if best.fits else []
    if lines:
        _print_commands(lines, nodes, job.gpus)
    if json_path:
        write_text(json_path, json.dumps(_json(found, job, lines), indent=2) + "\n", "--json")
    return 0 if best.fits else 1


def _refuse_mixed(args: argparse.Namespace) -> None:
    """Training's flags with --decode, --decode's without it, and what each mode needs: one line
    each, before anything is loaded."""
    if args.decode:
        given = [
            f
            for f, v in (("--global-batch", args.global_batch), ("--dp-modes", args.dp_modes))
            if v
        ]
        if given:
            raise UsageError(
                f"{' and '.join(given)}: training only; --decode prices serving (rows per replica: "
                "--micro-batch, tokens of KV cache: --seq)"
            )
        if args.micro_batch is None:
            raise UsageError("--decode needs --micro-batch: the rows each replica decodes together")
        return
    if args.objective:
        raise UsageError(
            "--objective is for --decode; training layouts are ranked by iteration time"
        )
    if args.global_batch is None:
        raise UsageError(
            "dtp search needs --global-batch (sequences per iteration), or --decode to search "
            "serving"
        )


def _precision(asked: str | None, prof, default: str) -> tuple[str, str]:
    """(the precision priced, why when it was not asked for): --precision, else `default`, the
    profile's best half precision; one the profile has no rate for is a usage error before any
    pricing."""
    if asked is None:
        if default == "fp32":
            return default, " (the profile has no half precision; --precision overrides)"
        return default, " (the profile's best half precision; --precision overrides)"
    if asked not in prof.peak_tflops:
        raise UsageError(
            f"--precision {asked}: profile {prof.name} has no peak_tflops for it (it has: "
            f"{', '.join(prof.peak_tflops)})"
        )
    return asked, ""


def _print_table(shown: list, whys: list[str], total: int) -> None:
    """The first layouts, each with why it is not first."""
    print(f"{'rank':>4}  {'layout':56s} {'iter s':>8} {'TFLOP/s':>8} {'GiB':>7}  why not first")
    for i, (c, why) in enumerate(zip(shown, whys)):
        print(
            f"{i + 1:>4}  {c.key():56s} {c.iteration_s:8.3f} {c.tflops_per_gpu:8.1f} "
            f"{c.memory_gib:7.1f}  {why}"
        )
    if total > len(shown):
        print(f"  … {total - len(shown)} more (--json lists all)")


def _print_commands(lines: list[str], nodes: int, gpus: int) -> None:
    """The commands that run the winner, and the one thing they cannot say: where a multi-node
    job meets."""
    print("\nrun it:")
    for line in lines:
        print(f"  {line}")
    if nodes > 1:
        print(
            f"  (on each of the {nodes} nodes, with the rendezvous flags torchrun needs, e.g. "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT)"
        )
    else:
        print(f"  (one node: dtp train starts its {gpus} ranks itself)")


def _json(found: list, job, lines: list[str]) -> dict:
    """The winner as it would run (layout, job, commands) and every candidate."""
    best = found[0]
    keys = ("tp", "dp", "sequence_parallel", "recompute", "iteration_s", "memory_gib", "plan")
    return {
        "best": {
            **{k: best.to_json()[k] for k in keys},
            "dp_mode": best.dp_mode,
            "fsdp": best.fsdp,
            "micro_batch": best.micro_batch,
            "global_batch": job.global_batch,
            "seq": job.seq,
            "precision": job.precision,
            "tflops_per_gpu": best.tflops_per_gpu,
            "fits": best.fits,
            "commands": lines,
        },
        "candidates": [c.to_json() for c in found],
    }


def _decode(args: argparse.Namespace, model, prof, precision: str, why: str, json_path) -> int:
    """`--decode`: every tp of a node priced for serving, the choice by --objective, where tp stops
    paying, and the lines that check the choice with `dtp generate`."""
    from dtp.auto.search import (
        MEANINGFUL,
        Serving,
        decode_commands,
        search_decode,
        serving_pick,
        stops_paying,
    )
    from dtp.generate.prompts import MAX_PROMPTS

    job = Serving(
        args.model,
        args.gpus,
        args.micro_batch,
        args.seq,
        precision,
        args.objective or "latency",
    )
    rows, refused = search_decode(model, job, prof)
    if not rows:
        raise UsageError(
            f"{args.model}: no tp could be planned for decoding: "
            + "; ".join(f"tp {t}: {w}" for t, w in refused.items())
        )
    best = serving_pick(rows, job.objective)
    knee = stops_paying(rows)
    capacity = prof.memory_GiB
    goal = {
        "latency": f"the smallest tp that fits and that no tp beats by more than {MEANINGFUL:.0%} "
        "in ms per token (the fastest, or a smaller tp nearly as fast: more replicas)",
        "throughput": "the most tokens/s over the cluster that fits, a tp within "
        f"{MEANINGFUL:.0%} of it that answers sooner taken instead",
    }[job.objective]
    print(
        f"dtp search --decode: {args.model} on {args.gpus} × {prof.name} ({capacity:.0f} GiB), "
        f"{job.batch} row(s) per replica, {job.context} tokens of KV cache, {precision}{why}; "
        f"objective {job.objective}: {goal}"
    )
    print(
        f"{'tp':>4} {'replicas':>8} {'ms/token':>9} {'tok/s replica':>14} {'tok/s cluster':>14} "
        f"{'tok/s per GPU':>14} {'GiB/GPU':>8}  why not chosen"
    )
    for r in rows:
        print(
            f"{r.tp:>4} {r.replicas:>8} {r.ms:>9.3f} {r.tokens_per_s:>14.1f} "
            f"{r.cluster_tokens_per_s:>14.1f} {r.gpu_tokens_per_s:>14.1f} "
            f"{r.memory_gib:>8.1f}  {_why_not(r, best)}"
        )
    for t, w in refused.items():
        print(f"tp {t}: not priced ({w})")
    for line in _verdict(rows, knee, prof.gpus_per_node, MEANINGFUL):
        print(line)
    lines = decode_commands(best, job, MAX_PROMPTS, MAX_NEW_TOKENS) if best else []
    if best:
        if best.left_whole:
            print(_left_whole(best))
        _print_decode_commands(lines, best, job, MAX_PROMPTS, MAX_NEW_TOKENS)
    else:
        least = min(rows, key=lambda r: r.memory_bytes)
        print(
            f"nothing fits in {capacity:.0f} GiB per GPU: the least is "
            f"{least.memory_gib:.1f} GiB at tp {least.tp}"
        )
    if json_path:
        out = {
            "objective": job.objective,
            "profile": prof.name,
            "gpus": job.gpus,
            "batch": job.batch,
            "context": job.context,
            "precision": precision,
            "best": {**best.to_json(), "commands": lines} if best else None,
            "stops_paying_at": knee.tp if knee else None,
            "candidates": [r.to_json() for r in rows],
            "refused": {str(t): w for t, w in refused.items()},
        }
        write_text(json_path, json.dumps(out, indent=2) + "\n", "--json")
    return 0 if best else 1


def _why_not(r, best) -> str:
    """Why a tp is not the choice: it does not fit, or what it costs against the choice."""
    if not r.fits:
        return r.why_not_fit()
    if r is best:
        return "chosen"
    return (
        f"{r.ms / best.ms - 1:+.1%} ms/token, "
        f"{r.cluster_tokens_per_s / best.cluster_tokens_per_s - 1:+.1%} tokens/s over the cluster"
    )


def _verdict(rows: list, knee, per_node: int, meaningful: float) -> list[str]:
    """Where tp stops paying for decoding: for latency, the tp from which a larger one is at most
    `meaningful` faster (and what the larger one's collectives take); for throughput, the tp at
    which each GPU serves the most."""
    fit = [r for r in rows if r.fits]
    if knee is None or not fit:
        return []
    larger = [r for r in fit if r.tp > knee.tp]
    if larger:
        nxt = larger[0]
        gain = 1 - nxt.ms / knee.ms
        faster = f"only {gain:.1%} faster" if gain > 0 else f"{-gain:.1%} slower"
        latency = (
            f"latency: tp stops paying at tp {knee.tp}: tp {nxt.tp} is {faster} per token (its "
            f"{nxt.step.collectives} collectives take {nxt.step.comm_ms:.2f} of its {nxt.ms:.2f} "
            "ms)"
        )
    else:
        limit = (
            f"a replica stays within a node of {per_node} GPUs"
            if 2 * knee.tp > per_node
            else "the largest that divides --gpus"
        )
        latency = (
            f"latency: tp still pays at tp {knee.tp}, the largest here ({limit}): every smaller tp "
            f"is more than {meaningful:.0%} slower per token"
        )
    most = max(fit, key=lambda r: (r.gpu_tokens_per_s, -r.tp))
    last = fit[-1]
    throughput = (
        f"throughput: each GPU serves the most at tp {most.tp} ({most.gpu_tokens_per_s:.1f} "
        "tokens/s)"
    )
    if last.tp != most.tp:
        throughput += (
            f"; at tp {last.tp}, {1 - last.gpu_tokens_per_s / most.gpu_tokens_per_s:.0%} fewer"
        )
    return [latency, throughput]


def _left_whole(best) -> str:
    """What the chosen tp's auto plan keeps replicated, with dtp plan --auto's reasons."""
    return f"the tp {best.tp} plan keeps whole on every rank: " + "; ".join(best.left_whole)


def _print_decode_commands(lines: list[str], best, job, max_prompts: int, max_new: int) -> None:
    """The lines that check the chosen replica, and what they cannot say."""
    print("\nrun it:")
    for line in lines:
        print(f"  {line}")
    gpus = f"{best.tp} GPU{'s' if best.tp > 1 else ''}"
    where = (
        f"one replica on the job's {gpus}"
        if best.replicas == 1
        else f"one replica on {gpus}; each of the {best.replicas} runs on its own, e.g. "
        f"CUDA_VISIBLE_DEVICES={','.join(map(str, range(best.tp)))} for the first"
    )
    print(
        f"  ({where}. dtp generate checks the replica token-exact against the unsharded model; "
        "it is not a server)"
    )
    if job.batch > max_prompts or job.context - 1 > max_new:
        print(
            f"  (dtp generate takes at most {max_prompts} prompts and {max_new} new tokens: the "
            "line decodes fewer rows or a shorter cache than was priced)"
        )
