"""What `dtp train PLAN MODEL` does: check, prepare the data, start the ranks (or join torchrun's), summarise.

Exit status: 0 trained (and, with --compare-tp, the curves agree); 1 a rank failed, the loss diverged, the tp
ranks' replicas diverged or the curves differ; 2 a plan, data, flag or resource error (before any rank starts);
130 interrupted (Ctrl-C), 143 terminated (SIGTERM), as every dtp command.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

from dtp import models
from dtp.checkpoint.lock import held
from dtp.checks.checker import check, sequence_shape_problem
from dtp.cost.explain import human_bytes
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.errors import RunError, Terminated, UsageError
from dtp.lang.parse import load, resolve_plan
from dtp.layout.trace import TRACES
from dtp.runtime import preflight
from dtp.runtime.keyed_init import init_rule
from dtp.runtime.launcher import launch_local, pick_device
from dtp.runtime.threads import cores
from dtp.runtime.torchrun import torchrun_group, torchrun_world, under_torchrun
from dtp.train import data, replica_checks, resume
from dtp.train.budget import check_budget, check_init_memory, check_train_memory
from dtp.train.loop import TrainConfig, train
from dtp.train.parity import compare, markdown
from dtp.train.plot import loss_png
from dtp.train.resume import resumed_line, saved_line


def _finite(name: str, value: float, low: float = 0.0, strict: bool = False) -> None:
    if not math.isfinite(value) or value < low or (strict and value <= low):
        what = "a positive" if strict else f"a finite number ≥ {low:g}, a"
        raise UsageError(f"--{name} must be {what} finite number, got {value}")


def validate(args: argparse.Namespace) -> None:
    """Hyper-parameters that cannot train: one paragraph, exit 2."""
    _finite("lr", args.lr, strict=True)
    _finite("min-lr", args.min_lr)
    _finite("weight-decay", args.weight_decay)
    _finite("clip", args.clip)
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.warmup is None:
        args.warmup = args.steps // 10
    if args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more steps, got {args.warmup}")
    if args.warmup > args.steps:
        raise UsageError(f"--warmup {args.warmup} is longer than --steps {args.steps}")
    if args.batch % args.dp:
        raise UsageError(f"--batch {args.batch} (the global batch) must divide by --dp {args.dp}")


def _preflight(args, tps: list[int], device: str, local: bool):
    """Check the plan at every tp, the memory of a local run (`local`: not under torchrun) and prepare the
    data, before any process starts."""
    plan = load(args.plan)
    source = models.resolve(args.model)
    model = models.build(source, device="meta")
    # a pretrained directory's --init model: each rank reads its own slices (dtp.runtime.pretrained), no rank 0 copy
    whole_on_rank0 = args.init == "model" and source.pretrained is None
    if args.init == "model" and source.pretrained is not None:  # a missing or mis-shaped tensor: exit 2 now
        models.check_weights(model, source.pretrained)
    block = getattr(getattr(model, "config", None), "block_size", None)
    if block is not None and args.seq > block:
        raise UsageError(f"--seq {args.seq} exceeds the model's block_size {block}")
    if args.checkpoint_activations and any(getattr(m, "p", 0) > 0 for m in model.modules()
                                           if type(m).__name__ == "Dropout"):
        raise UsageError("--checkpoint-activations with dropout > 0 would redraw different masks when the "
                         "forward is recomputed; use a model with dropout 0")

    if args.dp > 1:  # FSDP2 refuses these mid-start-up on every rank: one paragraph here instead
        scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
        if scalars:
            raise UsageError(f"--dp {args.dp} shards parameters with FSDP2, which cannot shard 0-D parameters "
                             f"({', '.join(scalars[:3])}{', …' if len(scalars) > 3 else ''}); train with --dp 1, or "
                             "make them 1-D tensors of one element")
    if args.init == "keyed":  # a parameter the keyed initialisation cannot draw: exit 2 here
        for path, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                init_rule(model, module, pname, f"{path}.{pname}".lstrip("."), param.dim())
    vocab = models.vocab_size(model)
    if vocab is None:
        raise UsageError(f"{args.model}: cannot tell the vocabulary size (no config.vocab_size, no nn.Embedding)")
    TRACES.calling(model, args.model)  # a model whose logits dtp cannot find: one line, exit 2, here
    for tp in tps:
        checked = check(plan, model, tp, args.dp)  # every tp, so a plan error is exit 2 before any rank starts
        shape_problem = sequence_shape_problem(checked, tp, args.seq)
        if shape_problem:
            raise UsageError(shape_problem)
        if whole_on_rank0:  # rank 0 builds the whole model before scattering it
            check_init_memory(checked, model, tp, args.dp, device)
        if local and device == "cpu":  # every rank on this host (a GPU run is bounded by its GPUs)
            check_train_memory(checked, model, tp, args.dp, batch=args.batch, seq=args.seq, vocab=vocab,
                               act_elem=2 if args.dtype == "bfloat16" else 4, init_model=whole_on_rank0)
    if args.max_rank_memory is not None:
        for tp in tps:
            check_budget(check(plan, model, tp), model, tp, args.dp, args.max_rank_memory)
    corpus = data.prepare(args.data, Path(args.out, "cache"), tokenizer=args.tokenizer, model_vocab=vocab)
    data.check_fits(corpus, args.batch, args.seq)
    return corpus


def _config(args, tp: int, out: Path, device: str):
    # ranks read the plan themselves: a shipped plan's name (`hf/gpt2`) becomes its file's absolute path
    return TrainConfig(plan=str(resolve_plan(args.plan).absolute()), model=args.model, tp=tp, dp=args.dp, batch=args.batch, seq=args.seq,
                       steps=args.steps, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup,
                       weight_decay=args.weight_decay, clip=args.clip, dtype=args.dtype, eval_every=args.eval_every,
                       checkpoint_activations=args.checkpoint_activations, seed=args.seed, device=device,
                       timeout=args.timeout, out=str(out), progress=sys.stderr.isatty(),
                       checkpoint=args.checkpoint, save_every=args.save_every or 0, resume=args.resume,
                       convert=args.convert, init=args.init, check_replicas=args.check_replicas,
                       threads=getattr(args, "threads", None))


def run_training(cfg, corpus) -> list[dict]:
    """Train once (local ranks or this torchrun rank); every rank's summary, rank 0 first."""
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    Path(cfg.out, "metrics.jsonl").write_text("")  # a fresh run starts a fresh log
    world = torchrun_world()
    if world is not None:
        import torch.distributed as dist

        if cfg.tp * cfg.dp != world:
            raise UsageError(f"--tp {cfg.tp} × --dp {cfg.dp} = {cfg.tp * cfg.dp} ranks, but torchrun started {world}")
        with torchrun_group(cfg.device, cfg.timeout) as rank:  # each rank on its own GPU under CUDA (it was cuda:0 for all)
            mine = train(rank, world, cfg, corpus)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            return _replicas_held(cfg, gathered)
    # The checkpoint's lock for the whole run: a second run saving there is refused before its ranks start, and
    # what a killed save left (CHECKPOINT.tmp-*) is removed on the way out, after Ctrl-C or SIGTERM too.
    with held(cfg.checkpoint):
        results = launch_local(train, cfg.tp * cfg.dp, cfg, corpus, timeout=cfg.timeout, device=cfg.device,
                               prefix="dtp-train-", threads=cfg.threads)
    return _replicas_held(cfg, results)


def _replicas_held(cfg, results: list[dict]) -> list[dict]:
    """`results`, or a RunError (exit 1) when the tp ranks' replicated tensors diverged (every rank stopped;
    with dp > 1 the first rank whose tp group diverged says what differs)."""
    record = next((r["replicas"] for r in results if r["replicas"]["divergences"]), None)
    if record is not None:
        raise RunError(replica_checks.message(record, record["steps"][-1]))
    return results


def summary(cfg, corpus, results: list[dict]) -> dict:
    """The final summary (also written as OUT/summary.json)."""
    first = results[0]
    model = models.build(models.resolve(cfg.model), device="meta")
    table = param_bytes_per_rank(check(load(cfg.plan), model, cfg.tp), model, cfg.tp, cfg.dp)
    return {"config": asdict(cfg), "corpus": {"name": corpus.name, "tokens": corpus.n_tokens,
                                               "train_tokens": corpus.n_train, "tokenizer": corpus.tokenizer,
                                               "unigram_entropy": data.unigram_entropy(corpus)},
            "val_loss": first["val_loss"], "perplexity": math.exp(min(first["val_loss"], 700)),
            "final_loss": first["losses"][-1], "tokens_per_s": first["tokens_per_s"],
            "step_time_ms": first["step_time_ms"], "comm_share": first["comm_share"],
            "param_bytes_per_rank": [r["param_bytes"] for r in results], "param_bytes_table": table,
            "peak_memory_bytes": [r["peak_memory_bytes"] for r in results],
            "peak_memory_kind": first["peak_memory_kind"], "collectives": first["collectives"],
            "analytic_collectives": first["analytic_collectives"], "losses": first["losses"],
            "val_losses": first["val_losses"], "start_step": first["start_step"], "resumed": first["resumed"],
            "checkpoints": first["saves"], "replicas": first["replicas"],
            "threads_per_rank": first["threads"], "ranks": len(results), "cores": cores(), "plain": first["plain"]}


def render(s: dict) -> str:
    """The human summary."""
    cfg, corpus = s["config"], s["corpus"]
    coll, analytic = s["collectives"], s["analytic_collectives"]
    agree = "not modeled" if "not_modeled" in analytic else (
        "matches the analytic schedule" if all(coll[k] == analytic[k] for k in ("by_op", "forward", "backward"))
        else f"DIFFERS from the analytic schedule ({analytic['total']})")
    ops = ", ".join(f"{n} {op}" for op, n in sorted(coll["by_op"].items())) or "none"
    return "\n".join([
        f"dtp train: {cfg['model']} under {cfg['plan']}, tp={cfg['tp']} dp={cfg['dp']}, {cfg['dtype']}, "
        f"{cfg['steps']} steps of {cfg['batch']} × {cfg['seq']} tokens",
        f"  data: {corpus['name']} ({corpus['tokens']} tokens, {corpus['tokenizer']}; unigram entropy "
        f"{corpus['unigram_entropy']:.3f} nats)",
        *resumed_line(s),
        f"  validation loss {s['val_loss']:.4f} nats/token (perplexity {s['perplexity']:.2f}); final training "
        f"loss {s['final_loss']:.4f}",
        f"  speed: {s['tokens_per_s']:.0f} tokens/s, {s['step_time_ms']:.1f} ms/step (median), "
        f"communication {s['comm_share']:.0%} of the step; {_threads(s)}",
        f"  collectives per step: {coll['total']} ({ops}); {agree}",
        f"  parameters per rank: {', '.join(human_bytes(b) for b in s['param_bytes_per_rank'])} "
        f"(placement table: {', '.join(human_bytes(b) for b in s['param_bytes_table'])})",
        f"  peak memory ({s['peak_memory_kind']}) per rank: {', '.join(human_bytes(b) for b in s['peak_memory_bytes'])}",
        *replica_checks.line(s["replicas"]),
        *saved_line(s),
    ])


def _threads(s: dict) -> str:
    """'2 ranks × 1 thread (2 cores)', and 'plain PyTorch' for a one-rank model left without DTensor."""
    ranks, threads = s["ranks"], s["threads_per_rank"]
    text = (f"{ranks} rank{'s' if ranks > 1 else ''} × {threads} thread{'s' if threads > 1 else ''} "
            f"({s['cores']} core{'s' if s['cores'] > 1 else ''})")
    return text + (", plain PyTorch (no DTensor)" if s.get("plain") else "")


def train_command(args: argparse.Namespace) -> int:
    """`dtp train PLAN MODEL ...`: validate, pre-flight, train (or compare tps), summarise; the exit status."""
    validate(args)
    resume.validate(args)
    device = pick_device(args.device, 1)  # CUDA when this machine has one (torchrun gives each rank its own)
    tps = args.compare_tp or [args.tp]
    local = torchrun_world() is None  # a stray WORLD_SIZE is ignored (one warning); an incoherent set is exit 2
    if local and device == "cpu":
        for tp in tps:
            preflight.check_world(tp * args.dp, device)
    corpus = _preflight(args, tps, device, local)
    out = Path(args.out)
    if args.compare_tp:
        return _compare(args, corpus, out, device)
    cfg = _config(args, args.tp, out, device)
    try:
        results = run_training(cfg, corpus)
    except KeyboardInterrupt as stop:  # SIGTERM arrives as Terminated, a KeyboardInterrupt: 143, as apply
        print(f"{_stopped(stop)}; the metrics so far are in {out / 'metrics.jsonl'}", file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130
    except RunError as err:
        raise RunError(f"{err} (the metrics so far are in {out / 'metrics.jsonl'})") from None
    if os.environ.get("RANK", "0") != "0" and under_torchrun():
        return 0  # under torchrun rank 0 reports
    s = summary(cfg, corpus, results)
    _write(out / "summary.json", s)
    if args.json:
        _write(Path(args.json), s)
    print(render(s))
    note = loss_png(out / "loss.png", {f"tp={cfg.tp}": (s["losses"], s["val_losses"])},
                    f"{cfg.model}, {cfg.plan}, tp={cfg.tp} dp={cfg.dp}, {cfg.dtype}")
    print(f"  metrics: {out / 'metrics.jsonl'} · summary: {out / 'summary.json'}"
          + (f" · {note}" if note else f" · loss curve: {out / 'loss.png'}"))
    return 0


def _compare(args, corpus, out: Path, device: str) -> int:
    """Train at each tp from the same initial weights on the same batches; overlay and tabulate."""
    runs: dict[int, dict] = {}
    for tp in args.compare_tp:
        cfg = _config(args, tp, out / f"tp{tp}", device)
        print(f"training at tp={tp} …", file=sys.stderr, flush=True)
        try:
            runs[tp] = summary(cfg, corpus, run_training(cfg, corpus))
            _write(Path(cfg.out, "summary.json"), runs[tp])
        except KeyboardInterrupt as stop:
            print(f"{_stopped(stop)}; the metrics so far are in {out}/tp*/metrics.jsonl", file=sys.stderr)
            return 143 if isinstance(stop, Terminated) else 130
        except RunError as err:  # a failed tp fails the comparison (a plan whose replicas drift cannot pass)
            raise RunError(f"at tp={tp}: {err} (the metrics so far are in {Path(cfg.out, 'metrics.jsonl')})") from None
        print(render(runs[tp]), flush=True)
    verdict = compare(runs, args.dtype)  # the measured bands: dtp/train/parity.py
    table = markdown(verdict.rows, args.compare_tp[0])
    (out / "compare.md").write_text(table + "\n", encoding="utf-8")
    _write(out / "compare.json", {**verdict.as_json(), "dtype": args.dtype,
                                  "unigram_entropy": next(iter(runs.values()))["corpus"]["unigram_entropy"]})
    note = loss_png(out / "compare.png", {f"tp={tp}": (r["losses"], r["val_losses"]) for tp, r in runs.items()},
                    f"{args.model}, {args.plan}, {args.dtype}: same init, same batches")
    print("\n" + table)
    print(f"\nconvergence parity: {'OK' if verdict.ok else 'FAILED'} — worst per-step |Δloss| / loss "
          f"{verdict.worst_rel_dloss:.2e}, {verdict.worst_margin:.2f} of the band at its step "
          f"({args.dtype} band: {verdict.band.describe()})")
    for problem in verdict.problems:
        print(f"  {problem}")
    print(f"table: {out / 'compare.md'}" + (f" · {note}" if note else f" · curves: {out / 'compare.png'}"))
    return 0 if verdict.ok else 1


def _stopped(stop: KeyboardInterrupt) -> str:
    return "terminated" if isinstance(stop, Terminated) else "interrupted"


def _write(path: Path, data: dict) -> None:
    try:
        path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
